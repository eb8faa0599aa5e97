"""Every fault, callback and exit path ends: futures always settle, workers
survive whatever callbacks do, and nothing hangs. Whatever could hang runs in
a child process, or under a timeout, so a regression fails instead of stalling."""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import threading
import time
import traceback

import anyio
import pytest
from helpers import eventually, run_python

import aiopar
from aiopar import _budget_slots
from aiopar.backends.thread import COMPENSATION_LIMIT, ThreadBackend

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pool():
    backend = ThreadBackend(max_workers=2)
    yield backend
    backend.shutdown(wait=True, cancel_pending=True)


# -- callbacks that block, or raise anything ----------------------------------


def test_a_callback_that_waits_works_wherever_it_runs():
    done = run_python(
        """
        import time, aiopar
        a = aiopar.fork(time.sleep, 0.5); b = aiopar.fork(int, "1")
        print(b.then(lambda _: a.wait()).wait(timeout=5))
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "None\n"
    assert "Traceback" not in done.stderr


def test_a_callback_in_a_worker_can_fork_and_wait(pool):
    first: aiopar.Future[None] = aiopar.Future()
    chained = first.then(lambda _: pool.fork(sum, range(10)).wait() + pool.fork(int, "5").wait())
    pool.fork(first.set_result, None)  # a worker settles it, and runs the callback
    assert chained.wait(timeout=10) == 50


@pytest.mark.parametrize(
    "exc", [SystemExit(3), KeyboardInterrupt(), asyncio.CancelledError(), ValueError("v")]
)
def test_anything_a_callback_raises_is_logged_and_the_worker_goes_on(pool, caplog, exc):
    one_worker = ThreadBackend(max_workers=1)
    try:

        def raise_it(_):
            raise exc

        with caplog.at_level(logging.ERROR, logger="aiopar"):
            settled: aiopar.Future[None] = aiopar.Future()
            settled.add_done_callback(raise_it)
            one_worker.fork(settled.set_result, None)
            # The only worker settled that future and ran the callback: it must
            # still run tasks, for timed waits, and be woken again once idle.
            assert one_worker.fork(int, "7").wait(timeout=5) == 7
            eventually(lambda: len(one_worker._idle) == len(one_worker._workers))
            assert one_worker.fork(int, "8").wait(timeout=5) == 8
        assert any(type(exc).__name__ in r.getMessage() or r.exc_info for r in caplog.records)
    finally:
        one_worker.shutdown(wait=True)


# -- coroutine forks always settle ---------------------------------------------


async def forever():
    await asyncio.sleep(3600)


def test_a_coroutine_fork_cancelled_before_its_first_step_is_cancelled():
    async def main():
        fut = aiopar.fork(forever)
        for task in asyncio.all_tasks():
            if task is not asyncio.current_task():
                task.cancel()  # before the fork's first step
        await asyncio.sleep(0.01)
        return fut

    fut = asyncio.run(main())
    assert fut.cancelled()


def test_a_coroutine_fork_whose_loop_is_cancelled_midway_fails_saying_so():
    async def main():
        fut = aiopar.fork(forever)
        await asyncio.sleep(0.01)  # it has started
        return fut

    fut = asyncio.run(main())
    with pytest.raises(aiopar.CancelledError, match="event loop running this coroutine"):
        fut.wait(timeout=5)


@pytest.fixture
def quiet_asyncio(caplog):
    """asyncio logs "Task was destroyed but it is pending!" for the tasks of
    a loop dropped unfinished, which these tests do on purpose."""
    with caplog.at_level(logging.CRITICAL, logger="asyncio"):
        yield
        gc.collect()


def fork_left_suspended_on_a_closed_loop() -> aiopar.Future[None]:
    """A coroutine fork that started on a loop that was then closed with
    the fork still suspended in it (the loop is left for the caller to drop)."""
    loop = asyncio.new_event_loop()

    async def start():
        fut = aiopar.fork(forever)
        await asyncio.sleep(0.01)
        return fut

    fut = loop.run_until_complete(start())
    loop.close()
    return fut


@pytest.mark.usefixtures("quiet_asyncio")
def test_a_coroutine_fork_on_a_closed_loop_settles_when_waited_for():
    fut = fork_left_suspended_on_a_closed_loop()
    with pytest.raises(aiopar.CancelledError, match="was closed before it finished"):
        fut.wait(timeout=5)


@pytest.mark.usefixtures("quiet_asyncio")
def test_a_coroutine_fork_on_a_dropped_loop_settles_when_collected():
    fut = fork_left_suspended_on_a_closed_loop()
    gc.collect()  # the loop is gone
    assert fut.done()
    assert isinstance(fut.exception(timeout=0), aiopar.CancelledError)


@pytest.mark.anyio
async def test_waiting_on_a_coroutine_fork_from_its_own_loop_raises_at_once():
    async def sleeps():
        await anyio.sleep(3600)

    fut = aiopar.fork(sleeps)
    started = time.monotonic()
    with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="use 'await fut'"):
        fut.wait()
    assert time.monotonic() - started < 1
    fut.cancel()


# -- fork() -------------------------------------------------------------------

FORK_CHILD = """
    import asyncio, multiprocessing, os, sys, aiopar

    def child_work():
        powers = aiopar.wait_all([aiopar.fork(pow, 2, i) for i in range(20)])
        assert powers == [2**i for i in range(20)]

        async def awaits():
            return await aiopar.fork(sum, range(5))

        assert asyncio.run(awaits()) == 10

        async def coro():
            await asyncio.sleep(0.01)
            return "coroutine"

        assert aiopar.fork(coro).wait(timeout=10) == "coroutine"
        chunks = []
        aiopar.parallel_for(0, 100, 10, lambda b, e: chunks.append((b, e)))
        assert sorted(chunks)[0][0] == 0 and sorted(chunks)[-1][1] == 100
        print("child ok", flush=True)

    # the parent's pools, loop thread and budget are all in use
    aiopar.wait_all([aiopar.fork(pow, 2, i) for i in range(20)])

    async def warm():
        return await aiopar.fork(int, "1")

    asyncio.run(warm())

    async def coro():
        return 1

    aiopar.fork(coro).wait()
    {start_child}
    child_work()  # and the parent goes on
"""


@pytest.mark.parametrize(
    "start_child",
    [
        "pid = os.fork()\n"
        "    if pid == 0:\n"
        "        child_work(); sys.stdout.flush(); os._exit(0)\n"
        "    assert os.waitpid(pid, 0)[1] == 0",
        "p = multiprocessing.get_context('fork').Process(target=child_work)\n"
        "    p.start(); p.join(30); assert p.exitcode == 0, p.exitcode",
    ],
    ids=["os.fork", "multiprocessing fork"],
)
def test_a_forked_child_can_use_every_backend(start_child):
    done = run_python(FORK_CHILD.format(start_child=start_child), timeout=45)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "child ok\nchild ok\n"


# -- compensation and deep nesting ---------------------------------------------


def test_compensation_is_bounded_and_every_blocked_task_still_finishes(pool):
    release: aiopar.Future[None] = aiopar.Future()
    futs = [pool.fork(release.wait) for _ in range(300)]
    # Once every worker has blocked, the pool has decided on each block.
    limit = pool.max_workers + COMPENSATION_LIMIT
    eventually(lambda: len(pool._workers) >= limit and pool._blocked == len(pool._workers))
    assert len(pool._workers) == limit
    release.set_result(None)
    aiopar.wait_all(futs)
    assert all(f.done() for f in futs)


def test_a_thread_that_cannot_start_leaves_the_pool_counting_right(pool, monkeypatch):
    gate: aiopar.Future[None] = aiopar.Future()
    started = refused = 0
    start = threading.Thread.start

    def limited_start(self):
        nonlocal started, refused
        if self.name.startswith("aiopar-") and started >= 3:
            refused += 1
            raise RuntimeError("can't start new thread")
        started += 1
        start(self)

    monkeypatch.setattr(threading.Thread, "start", limited_start)
    futs = [pool.fork(gate.wait) for _ in range(30)]
    eventually(lambda: refused)  # the pool has tried to add a thread, and failed
    gate.set_result(None)
    for fut in futs:
        assert fut.wait(timeout=10) is None
    deadline = time.monotonic() + 5
    while pool._blocked and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool._blocked == 0


def test_a_fork_whose_new_worker_cannot_start_wakes_an_idle_one(monkeypatch):
    # Below its size a pool starts a worker rather than wake an idle one:
    # if the system refuses the thread, the idle worker takes the task.
    backend = ThreadBackend(max_workers=2)
    try:
        first = backend.fork(threading.get_ident)
        eventually(lambda: len(backend._idle) == 1)

        def no_threads(self):
            raise RuntimeError("can't start new thread")

        monkeypatch.setattr(threading.Thread, "start", no_threads)
        second = backend.fork(threading.get_ident)
        eventually(second.done)  # a worker ran it: wait() here would run it itself
        assert second.value() == first.value()
    finally:
        monkeypatch.undo()
        backend.shutdown()


def test_a_task_whose_start_the_budget_fails_to_count_fails_and_the_pool_goes_on(monkeypatch):
    # An error of aiopar's own as a worker starts a task: the task's future
    # fails with it (it stayed running for ever), and the worker goes on.
    backend = ThreadBackend(max_workers=1)

    def broken(slot):
        raise RuntimeError("the budget broke")

    try:
        monkeypatch.setattr(_budget_slots.Slot, "first_task", broken)
        failed = backend.fork(int, "1")
        eventually(failed.done)  # a worker ran it: wait() here would run it itself
        with pytest.raises(RuntimeError, match="the budget broke"):
            failed.value()
        monkeypatch.undo()
        fine = backend.fork(int, "2")
        eventually(fine.done)
        assert fine.value() == 2
    finally:
        monkeypatch.undo()
        backend.shutdown()


def test_the_first_worker_that_cannot_start_fails_the_fork_saying_why(monkeypatch):
    backend = ThreadBackend(max_workers=2)

    def no_threads(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_threads)
    with pytest.raises(RuntimeError, match="can't start new thread"):
        backend.fork(int, "1")
    monkeypatch.undo()
    assert backend.fork(int, "2").wait(timeout=5) == 2
    backend.shutdown()


def depth(n: int) -> int:
    return 0 if n == 0 else 1 + aiopar.fork(depth, n - 1).wait()


def test_wait_all_raises_as_soon_as_one_fails_while_another_still_runs(pool):
    # On a warm pool the caller used to take the first queued task, a slow
    # one, and raised only once it returned. Five rounds: the race the
    # caller used to win is lost by it in none.
    warm_up = threading.Barrier(2)
    aiopar.wait_all([pool.fork(warm_up.wait, 10) for _ in range(2)])
    for _ in range(5):
        release = threading.Event()
        slow = pool.fork(release.wait, 10)
        with pytest.raises(ValueError, match="invalid literal"):
            aiopar.wait_all([slow, pool.fork(int, "x")])
        assert not slow.done()  # raised while it still runs
        release.set()
        assert slow.wait(10) is True


def test_deep_nesting_never_raises_recursion_error():
    assert aiopar.fork(depth, 2000).wait(timeout=50) == 2000


def test_a_stolen_task_adds_few_frames():
    def inner():
        return len(traceback.extract_stack())

    def outer():
        return len(traceback.extract_stack()), aiopar.fork(inner).wait()

    outer_depth, inner_depth = aiopar.get_backend("inline").fork(outer).wait()
    assert inner_depth - outer_depth <= 6


# -- event loops in pool tasks --------------------------------------------------


def test_pool_tasks_running_an_event_loop_let_the_pool_run_their_forks(pool):
    def runs_a_loop(i):
        async def main():
            return sum(await asyncio.gather(*(pool.fork(pow, i, k) for k in range(3))))

        return asyncio.run(main())

    barrier = threading.Barrier(2, timeout=10)

    def both_at_once(i):
        barrier.wait()  # both workers are taken by loop-running tasks
        return runs_a_loop(i)

    futs = [pool.fork(both_at_once, i) for i in (2, 3)]
    assert [f.wait(timeout=20) for f in futs] == [1 + 2 + 4, 1 + 3 + 9]


# -- failures nobody read ------------------------------------------------------


def test_a_failure_nobody_retrieved_is_logged_once_when_collected(caplog):
    def fail():
        raise ValueError("lost failure")

    with caplog.at_level(logging.ERROR, logger="aiopar"):
        fut = aiopar.fork(fail)
        aiopar.collect_all([fut]).wait()
        del fut
        gc.collect()
    records = [r for r in caplog.records if "nobody retrieved" in r.getMessage()]
    assert len(records) == 1
    assert "lost failure" in caplog.text and "in fail" in caplog.text


def test_a_failure_that_was_read_is_not_logged(caplog):
    def fail():
        raise ValueError("read failure")

    with caplog.at_level(logging.ERROR, logger="aiopar"):
        fut = aiopar.fork(fail)
        with pytest.raises(ValueError):
            fut.wait()
        del fut
        ok = aiopar.fork(int, "1")
        assert ok.wait() == 1 and ok._unretrieved is None
        gc.collect()
    assert "nobody retrieved" not in caplog.text
    assert not hasattr(aiopar.Future, "__del__"), "a future that succeeds costs no finalizer"


# -- small ones ----------------------------------------------------------------


def test_waiting_often_on_a_failed_future_does_not_grow_its_traceback():
    fut: aiopar.Future[None] = aiopar.Future()
    try:
        raise ValueError("once")
    except ValueError as exc:
        fut.set_exception(exc)
    lengths = set()
    for _ in range(100):
        try:
            fut.wait()
        except ValueError as exc:
            lengths.add(len(traceback.extract_tb(exc.__traceback__)))
    assert len(lengths) == 1


@pytest.mark.anyio
async def test_awaiting_a_future_that_holds_stop_iteration_says_so():
    fut: aiopar.Future[int] = aiopar.Future()
    fut.set_exception(StopIteration(5))
    with pytest.raises(RuntimeError, match="StopIteration, which 'await' cannot raise") as info:
        await fut
    assert isinstance(info.value.__cause__, StopIteration)
    with pytest.raises(StopIteration):
        fut.wait()  # outside a coroutine it is raised as it is


@pytest.mark.parametrize("timeout", [math.inf, 1e10, 10**12])
def test_huge_timeouts_mean_wait_for_ever(timeout):
    def settled_soon() -> aiopar.Future[int]:
        fut: aiopar.Future[int] = aiopar.Future()
        threading.Timer(0.05, fut.set_result, (3,)).start()
        return fut

    assert settled_soon().wait(timeout=timeout) == 3
    assert [f.value() for f in aiopar.as_completed([settled_soon()], timeout=timeout)] == [3]


@pytest.mark.parametrize("timeout", ["1", [1], True])
def test_a_timeout_that_is_not_a_number_gets_a_clear_type_error(timeout):
    with pytest.raises(TypeError, match=r"timeout must be None .* or a number of seconds"):
        aiopar.Future().wait(timeout=timeout)


def test_ctrl_c_while_the_main_thread_runs_a_stolen_task_is_raised_there():
    done = run_python(
        """
        import signal, threading, time, aiopar

        def task():
            # Ctrl-C, as a terminal sends it, while the main thread sleeps in the task
            main = threading.main_thread().ident
            threading.Timer(0.2, signal.pthread_kill, (main, signal.SIGINT)).start()
            time.sleep(60)
            return "finished"

        fut = aiopar.fork(task)
        try:
            fut.wait()  # runs the task in this thread
        except KeyboardInterrupt:
            print("interrupted", type(fut.exception()).__name__)
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "interrupted CancelledError\n"


@pytest.mark.timeout(120)  # above the script's own: it took 25 s on a busy machine
def test_a_thread_that_ran_tasks_gets_its_own_openmp_thread_count_back():
    pytest.importorskip("torch")
    done = run_python(
        """
        import torch, aiopar
        before = torch.get_num_threads()
        x = torch.ones(64, 64)

        def matmul():
            return (x @ x).sum().item()

        for _ in range(3):
            aiopar.wait_all([aiopar.fork(matmul) for _ in range(20)])
        print(before == torch.get_num_threads(), before, torch.get_num_threads())
        """,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("True"), done.stdout


def test_logged_tracebacks_are_formatted_without_parsing_source(caplog, monkeypatch):
    # CPython 3.11 shares the parser's recursion counter between threads
    # (gh-106905): aiopar, which logs from workers and finalizers, must not
    # parse source to underline a traceback.
    import ast

    def no_parsing(*args, **kwargs):
        raise AssertionError("ast.parse called while formatting an aiopar log record")

    fut: aiopar.Future[int] = aiopar.Future()

    def broken(_):
        return [1][2]

    fut.add_done_callback(broken)
    monkeypatch.setattr(ast, "parse", no_parsing)
    with caplog.at_level(logging.ERROR, logger="aiopar"):
        fut.set_result(1)
    (record,) = caplog.records
    assert "IndexError: list index out of range" in record.exc_text
    assert "in broken" in record.exc_text and "^^^" not in record.exc_text
    assert "IndexError" in caplog.text
