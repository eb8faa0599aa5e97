"""A fresh process pool is parallel from the first fork: tasks forked at once
start on as many workers as there are, none handed ahead to a worker while
another is starting."""

from __future__ import annotations

import process_helpers
import pytest
from process_helpers import meet

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
