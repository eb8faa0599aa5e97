"""The thread pool's work-first order, and the loads it must not deadlock under.

Order tests are event-based: a pool of one or two workers is held on gates
so each queue's content is known when a worker next looks; their pools have
no stall watcher, which would count a worker held on a gate out of the pool
and start another (tests/test_blocking_calls.py tests that). Load tests run in
a subprocess with a timeout (a regression fails instead of stalling) and
check the issue's bounds: within 3x the ideal time, with at most
``max_workers + COMPENSATION_LIMIT`` pool threads.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

import pytest
from helpers import eventually, run_python

import aiopar
from aiopar.backends import _stall
from aiopar.backends.thread import ThreadBackend

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def no_stall_watcher(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools started in the test have no stall watcher."""
    monkeypatch.setattr(_stall, "SUPPORTED", False)


def test_forks_made_in_a_pool_task_run_newest_first():
    ran: list[str] = []

    def parent() -> None:
        for name in "abc":
            aiopar.fork(ran.append, name)

    with aiopar.use_backend("thread", max_workers=1) as pool:
        pool.fork(parent).wait(timeout=10)
        pool.fork(lambda: None).wait(timeout=10)  # after the forks, on the one worker
    assert ran == ["c", "b", "a"]
    pool.shutdown()


def test_forks_from_outside_the_pool_run_oldest_first():
    ran: list[str] = []
    gate = threading.Event()
    with aiopar.use_backend("thread", max_workers=1) as pool:
        held = pool.fork(gate.wait, 10)
        futures = [pool.fork(ran.append, name) for name in "abc"]
        gate.set()
        held.wait(timeout=10)
        for fut in futures:
            fut.wait(timeout=10)
    assert ran == ["a", "b", "c"]


def test_a_pool_starts_all_its_workers_then_wakes_the_one_idle_longest():
    # A fork wakes no idle worker while the pool is below its size: a
    # sequence of forks and waits takes the workers in turn, never the one
    # that has only just gone to sleep.
    pool = ThreadBackend(max_workers=2)

    def idle(count: int) -> Callable[[], bool]:
        return lambda: len(pool._idle) == count

    try:
        first = pool.fork(threading.get_ident)
        eventually(idle(1))  # it ran, and sleeps
        second = pool.fork(threading.get_ident)
        eventually(idle(2))
        third = pool.fork(threading.get_ident)
        eventually(idle(2))
        fourth = pool.fork(threading.get_ident)
        eventually(fourth.done)  # a worker ran it, not a wait here
        idents = [fut.value() for fut in (first, second, third, fourth)]
        assert len(pool._workers) == 2
        assert idents[0] != idents[1], "a fork woke the idle worker before the pool was full"
        assert idents[2:] == idents[:2], "the workers did not take turns, idle longest first"
    finally:
        pool.shutdown()


def test_a_free_worker_steals_a_blocked_tasks_fork_before_the_shared_queue():
    ran: list[str] = []
    hold_first, fork_now, forked, hold_forker = (threading.Event() for _ in range(4))

    def forker() -> None:
        fork_now.wait(10)
        aiopar.fork(ran.append, "stolen")  # into this worker's own deque
        forked.set()
        hold_forker.wait(10)  # blocked, but not in wait(): nothing runs its forks

    with aiopar.use_backend("thread", max_workers=2) as pool:
        first = pool.fork(hold_first.wait, 10)
        second = pool.fork(forker)
        shared = pool.fork(ran.append, "shared")  # both workers are busy: it queues
        fork_now.set()
        assert forked.wait(10)
        hold_first.set()  # the first worker is free with both queued
        shared.wait(timeout=10)
        hold_forker.set()
        for fut in (first, second):
            fut.wait(timeout=10)
    assert ran == ["stolen", "shared"]


def test_a_worker_that_waits_with_a_timeout_runs_its_own_forks_newest_first():
    def parent() -> tuple[list[str], int]:
        ran: list[str] = []
        here = threading.get_ident()
        where: list[int] = []

        def child(name: str) -> None:
            ran.append(name)
            where.append(threading.get_ident())

        a, b, c = (aiopar.fork(child, name) for name in "abc")
        b.wait(timeout=10)  # runs c, then b; a stays queued
        seen = list(ran)
        a.wait(timeout=10)
        c.wait(timeout=10)
        return seen + ran, sum(w == here for w in where)

    # max_workers=1: the only worker is the waiter, so no thief takes a fork.
    with aiopar.use_backend("thread", max_workers=1) as pool:
        order, on_the_waiter = pool.fork(parent).wait(timeout=10)
    assert order == ["c", "b", "c", "b", "a"]
    assert on_the_waiter == 3


BLOCKERS = """
import sys, threading, time, aiopar
from aiopar.backends.thread import COMPENSATION_LIMIT

form = sys.argv[1]
peak = 0

def leaf():
    global peak
    # Pool threads only: the main thread and aiopar's loop thread are not the pool's.
    peak = max(peak, sum(t.name.startswith("aiopar-thread-") for t in threading.enumerate()))
    time.sleep(0.01)
    return 1

def blocker():
    fut = aiopar.fork(leaf)
    return fut.wait() if form == "wait" else fut.wait(timeout=60)

async def coroutine_blocker():
    return await aiopar.fork(leaf)

fn = coroutine_blocker if form == "await" else blocker
n, workers = 400, 2  # the issue's had 1000: 400 would still queue leaves behind 300 blockers
started = time.perf_counter()
with aiopar.use_backend("thread", max_workers=workers):
    futures = [aiopar.fork(fn) for _ in range(n)]
    total = sum(f.wait(timeout=50) for f in futures)
elapsed = time.perf_counter() - started
ideal = n * 0.01 / workers
assert total == n, total
assert elapsed <= 3 * ideal, f"{elapsed:.1f} s, ideal {ideal:.1f} s"
assert peak <= workers + COMPENSATION_LIMIT, peak
print("ok", round(elapsed / ideal, 2), peak)
"""


@pytest.mark.parametrize("form", ["timeout", "wait", "await"])
def test_hundreds_of_blockers_each_waiting_on_a_leaf_finish_on_two_workers(form):
    # The program: with a FIFO queue and wait(timeout=...), 66 threads
    # blocked on leaves queued behind 934 more blockers until the timeouts.
    done = run_python(BLOCKERS, form, timeout=55)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout


PROCESS_BLOCKERS = """
import sys, time, aiopar

def leaf():
    time.sleep(0.01)
    return 1

def blocker(form):
    fut = aiopar.fork(leaf)  # inside the worker process, on its own thread pool
    return fut.wait() if form == "wait" else fut.wait(timeout=60)

if __name__ == "__main__":
    form = sys.argv[1]
    n, workers = 400, 2
    with aiopar.use_backend("process", max_workers=workers):
        aiopar.fork(leaf).wait(timeout=30)  # the workers are up: time the blockers only
        started = time.perf_counter()
        futures = [aiopar.fork(blocker, form) for _ in range(n)]
        total = sum(f.wait(timeout=50) for f in futures)
        elapsed = time.perf_counter() - started
    ideal = n * 0.01 / workers
    assert total == n, total
    assert elapsed <= 3 * ideal, f"{elapsed:.1f} s, ideal {ideal:.1f} s"
    print("ok", round(elapsed / ideal, 2))
"""


@pytest.mark.parametrize("form", ["timeout", "wait"])
def test_hundreds_of_blockers_on_the_process_backend_finish(tmp_path, form):
    script = tmp_path / "blockers.py"
    script.write_text(PROCESS_BLOCKERS)
    done = run_python(
        f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", form, timeout=55
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout


def test_a_hundred_pool_tasks_each_running_an_event_loop_that_awaits_a_fork():
    # Each task's loop blocks its worker while it awaits: the fork it awaits
    # sits in that worker's deque, and a compensating worker steals it
    # before it starts another loop.
    done = run_python(
        """
        import asyncio, aiopar

        def child():
            return 1

        async def parent():
            return await aiopar.fork(child)

        def task():
            return asyncio.run(parent())

        with aiopar.use_backend("thread", max_workers=2):
            futures = [aiopar.fork(task) for _ in range(100)]
            print(sum(f.wait(timeout=40) for f in futures))
        """,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["100"]


def test_shutdown_cancels_outside_the_pool_lock_so_a_cancel_callback_may_fork():
    # The callback ran under the pool's lock, and its fork waited for that lock.
    done = run_python(
        """
        import threading, aiopar

        pool = aiopar.get_backend("thread", max_workers=1)
        started, gate = threading.Event(), threading.Event()

        def hold():
            started.set()
            return gate.wait(10)

        held = pool.fork(hold)
        assert started.wait(10)  # the one worker is busy: the next task queues
        queued = pool.fork(lambda: 1)
        said = []

        def on_cancel(fut):
            try:
                pool.fork(lambda: 2)
            except RuntimeError as exc:
                said.append(str(exc))

        queued.add_done_callback(on_cancel)
        pool.shutdown(wait=False, cancel_pending=True)
        gate.set()
        pool.shutdown()
        assert queued.cancelled() and held.wait(timeout=10) is True
        print(said)
        """,
        timeout=20,
    )
    assert done.returncode == 0, done.stderr
    assert "shut down" in done.stdout


def test_a_worker_that_an_error_of_aiopar_stops_leaves_the_pool_working():
    # Not a task's error (those settle its future): an error in the worker's
    # own loop ends its thread. The pool replaces it, the task it had taken
    # and its queued forks run, and threading's excepthook reports the error.
    code = """
        import threading
        import aiopar
        from aiopar.backends import thread

        pool = aiopar.get_backend("thread", max_workers=1)
        run = thread.Task.run  # what a worker runs each task with
        failed = []

        def first_run_fails(task, *args):
            if not failed:
                failed.append(threading.current_thread())
                raise RuntimeError("an error of aiopar's own")
            run(task, *args)

        thread.Task.run = first_run_fails
        futures = [pool.fork(int, "7") for _ in range(5)]
        print([f.wait(timeout=10) for f in futures], flush=True)  # never run by this thread
        failed[0].join(10)  # its report is written
    """
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[7,", "7,", "7,", "7,", "7]"], done.stdout
    assert "an error of aiopar's own" in done.stderr


# -- a fork that finds every worker busy queues its task without the lock ----
#
# Each test forces one interleaving of such a fork with a worker going idle,
# or with a shutdown, by holding one side at the step where it would race.


class _Gated(collections.deque):  # type: ignore[type-arg]
    """A deque whose next append first runs ``before`` (once)."""

    before: Callable[[], None] | None = None

    def append(self, item: object) -> None:
        before, self.before = self.before, None
        if before is not None:
            before()
        super().append(item)


class _Announcing:
    """A worker's wake-up lock that sets ``asleep`` as the worker goes to sleep on it."""

    def __init__(self, lock: threading.Lock, asleep: threading.Event) -> None:
        self.lock, self.asleep = lock, asleep

    def acquire(self, timeout: float = -1) -> bool:
        self.asleep.set()
        return self.lock.acquire(timeout=timeout)

    def release(self) -> None:
        self.lock.release()


def _busy_pool(shared_queue: type[_Gated] = _Gated) -> tuple[ThreadBackend, threading.Event]:
    """A pool of one worker, busy until the event returned is set."""
    pool = ThreadBackend(max_workers=1)
    pool._tasks = shared_queue()
    pool._idle = _Gated()
    release, started = threading.Event(), threading.Event()
    pool.fork(lambda: started.set() or release.wait(10))
    assert started.wait(10)
    return pool, release


def test_a_worker_going_idle_sees_a_task_queued_after_its_last_look():
    # The worker looked at the queues (empty) and is about to go idle when
    # the fork, finding it still busy, queues its task and looks for an idle
    # worker (none yet): the worker's look after going idle finds the task.
    pool, release = _busy_pool()
    forked: list[aiopar.Future[int]] = []

    def fork_now() -> None:  # in the worker, as it goes idle, under the pool's lock
        done = threading.Event()
        threading.Thread(target=lambda: forked.append(pool.fork(int, "1")) or done.set()).start()
        assert done.wait(10), "the fork waited for the pool's lock"

    pool._idle.before = fork_now
    release.set()
    eventually(lambda: forked)
    assert forked[0].wait(timeout=10) == 1  # with a timeout, no thread but the worker runs it
    pool.shutdown()


def test_a_fork_that_queued_without_the_lock_wakes_a_worker_gone_idle_meanwhile():
    # The worker goes idle, looks at the queues again (empty) and sleeps
    # after the fork found it busy and before the fork queued its task: the
    # fork's look after queuing finds it idle and wakes it.
    pool, release = _busy_pool()
    (worker,) = pool._workers
    asleep = threading.Event()
    worker.wake_up = _Announcing(worker.wake_up, asleep)

    def let_it_sleep() -> None:
        release.set()
        assert asleep.wait(10)

    pool._tasks.before = let_it_sleep
    assert pool.fork(int, "1").wait(timeout=10) == 1
    pool.shutdown()


def test_a_fork_that_queued_without_the_lock_as_the_pool_shut_down_is_refused():
    # The pool shut down and its last worker stopped between the fork's look
    # and its queuing: nobody would run the task, so the fork raises as a
    # fork after shutdown does, and leaves nothing queued.
    pool, release = _busy_pool()
    (worker,) = pool._workers

    def shut_down() -> None:
        pool.shutdown(wait=False)
        release.set()
        worker.thread.join(10)
        assert not worker.thread.is_alive()

    pool._tasks.before = shut_down
    with pytest.raises(RuntimeError, match="has been shut down"):
        pool.fork(int, "1")
    assert not pool._tasks


def test_a_fork_that_queued_without_the_lock_gets_a_worker_for_one_blocked_meanwhile():
    # The one worker blocks in wait (counted out of the pool) after the fork
    # found it busy and before the fork queued its task: the fork's look after
    # queuing finds the pool short of a worker and starts one for the task.
    pool = ThreadBackend(max_workers=1)
    pool._tasks = _Gated()
    started, block = threading.Event(), threading.Event()
    unblock: aiopar.Future[None] = aiopar.Future()

    def busy() -> None:
        started.set()
        assert block.wait(10)
        unblock.wait()

    held = pool.fork(busy)
    assert started.wait(10)

    def let_it_block() -> None:
        block.set()
        eventually(lambda: pool._blocked == 1)

    pool._tasks.before = let_it_block
    try:
        assert pool.fork(int, "1").wait(timeout=10) == 1
    finally:
        unblock.set_result(None)
    held.wait(10)
    pool.shutdown()


def test_a_task_left_queued_by_a_fork_ctrl_c_cut_short_runs_when_the_pool_drains():
    # Ctrl-C as the fork's append returned skips its look for an idle worker,
    # and the one worker went idle meanwhile: drain (as exit does) wakes it.
    class CutShort(_Gated):
        cut_short = False

        def append(self, item: object) -> None:
            super().append(item)
            if self.cut_short:
                raise KeyboardInterrupt  # as Ctrl-C does when the call returns

    pool, release = _busy_pool(CutShort)
    (worker,) = pool._workers
    asleep = threading.Event()
    worker.wake_up = _Announcing(worker.wake_up, asleep)
    ran: list[str] = []

    def let_it_sleep() -> None:
        release.set()
        assert asleep.wait(10)

    pool._tasks.before, pool._tasks.cut_short = let_it_sleep, True
    with pytest.raises(KeyboardInterrupt):
        pool.fork(ran.append, "ran")
    drained = threading.Thread(target=pool.drain)
    drained.start()
    drained.join(10)
    try:
        assert not drained.is_alive(), "drain waited for ever for a task no worker was woken for"
        assert ran == ["ran"]
    finally:
        pool.shutdown()
