"""A fresh process pool is parallel from the first fork: tasks forked at once
start on as many workers as there are, none handed ahead to a worker while
another is starting."""

from __future__ import annotations

import process_helpers
import pytest
from helpers import eventually
from process_helpers import FileGate, add, meet, run_script, sleep_then, until_opened

nothing_left_behind = process_helpers.nothing_left_behind
own_pool = process_helpers.own_pool


@pytest.mark.parametrize("workers", [2, 4])
def test_tasks_forked_at_once_on_a_fresh_pool_run_at_once_on_distinct_workers(
    own_pool, tmp_path, workers
):
    # Each task waits until every one has started: run one after the other
    # on one worker, the first would wait in vain.
    backend = own_pool(workers)
    futures = [backend.fork(meet, str(tmp_path), workers) for _ in range(workers)]
    outcomes = [future.wait(timeout=60) for future in futures]
    pids = [pid for pid, _ in outcomes]
    assert all(met for _, met in outcomes), outcomes
    assert len(set(pids)) == workers, pids


def test_a_task_goes_ahead_to_a_busy_worker_once_none_is_idle_or_starting(own_pool, tmp_path):
    # On a warm pool the queue still goes ahead (prefetch): more tasks than
    # workers, each a quick one, are handed to the busy workers in advance.
    backend = own_pool(2, prefetch=2)
    for future in [backend.fork(meet, str(tmp_path), 2) for _ in range(2)]:
        future.wait(timeout=60)
    gate = tmp_path / "gate"
    busy = [backend.fork(process_helpers.until_opened, str(gate)) for _ in range(2)]
    queued = [backend.fork(process_helpers.add, i) for i in range(4)]
    workers = backend._pool.workers
    try:
        assert sum(len(worker.inflight) for worker in workers) == 6
    finally:
        process_helpers.FileGate(gate).open()
    assert [future.wait(timeout=60) for future in busy + queued] == [None, None, 0, 1, 2, 3]


def test_a_pool_below_its_size_starts_a_worker_rather_than_send_a_task_ahead(own_pool, tmp_path):
    backend = own_pool(2)
    backend.fork(process_helpers.add, 1).wait(timeout=60)  # one worker is up, and idle
    futures = [backend.fork(meet, str(tmp_path), 2) for _ in range(2)]
    outcomes = [future.wait(timeout=60) for future in futures]
    assert all(met for _, met in outcomes), outcomes
    assert len({pid for pid, _ in outcomes}) == 2, outcomes


def test_no_task_is_sent_ahead_before_one_finished_nor_while_tasks_are_long(own_pool, tmp_path):
    # Sent ahead, a task can no longer be cancelled (and after a Ctrl-C
    # it would wait behind the running one): the pace must first be known
    # to be quick enough for a round trip to matter.
    backend = own_pool(1)
    gate = FileGate(tmp_path / "gate")
    first = backend.fork(until_opened, gate.path)
    queued = backend.fork(add, 1)
    try:
        eventually(first.running)  # handed to the worker as it came up
        assert queued.cancel()
    finally:
        gate.open()
    assert first.wait(timeout=30) is None
    assert backend.fork(sleep_then, 0.1, 2).wait(timeout=30) == 2  # the pace: 100 ms a task
    gate = FileGate(tmp_path / "gate-again")
    busy = backend.fork(until_opened, gate.path)
    queued = backend.fork(add, 1)
    try:
        eventually(busy.running)
        assert queued.cancel()
    finally:
        gate.open()
    assert busy.wait(timeout=30) is None


@pytest.mark.parametrize("prefetch", [None, 1])
def test_a_ctrl_c_cancels_every_task_no_worker_runs_yet(tmp_path, prefetch):
    # Forked at once on a fresh pool, long tasks go to no worker ahead of
    # their turn, unless prefetch says so; either way what an uncaught
    # KeyboardInterrupt ends is cancelled if it never started, and none
    # fails with "never ran: it was queued on the worker".
    done = run_script(
        tmp_path,
        f"""
        import os, time, aiopar
        from helpers import eventually
        from process_helpers import meet

        os.mkdir("started")
        backend = aiopar.get_backend("process", max_workers=2, grace=0.5, prefetch={prefetch})
        futures = [backend.fork(meet, os.path.abspath("started"), 99) for _ in range(4)]
        for future in futures:
            future.add_done_callback(
                lambda f: print("cancelled" if f.cancelled() else repr(f.exception()), flush=True)
            )
        if {prefetch}:
            eventually(lambda: sum(len(w.inflight) for w in backend._pool.workers) == 4)
        eventually(lambda: len(os.listdir("started")) == 2)  # two run, two wait
        raise KeyboardInterrupt
        """,
    )
    assert done.returncode != 0  # the interrupt still ends the program
    assert done.stdout.count("cancelled") == 2, done.stdout
    assert done.stdout.count("terminated at shutdown") == 2, done.stdout
    assert "never ran" not in done.stdout + done.stderr
