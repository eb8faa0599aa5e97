"""aiopar.Executor: a concurrent.futures.Executor over any backend (the
behaviours CPython's test_concurrent_futures checks of an executor, its
thread pool and its shutdown, written against aiopar)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop
from helpers import eventually, run_python

import aiopar
from aiopar.backends.thread import ThreadBackend

pytestmark = pytest.mark.timeout(60)

LIMIT = 10  # every wait here is bounded: a regression fails, it never hangs

BACKENDS = ["inline", "thread", "openmp", "process"]


def mul(x: int, y: int) -> int:
    return x * y


def capture(*args: Any, **kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, kwargs


class Payload:
    def method(self) -> None:
        pass


@pytest.fixture
def pool() -> Iterator[ThreadBackend]:
    """A pool of one worker of this test's own."""
    backend = ThreadBackend(max_workers=1)
    yield backend
    backend.shutdown(wait=True, cancel_pending=True)


@pytest.fixture
def held(pool: ThreadBackend) -> Iterator[threading.Event]:
    """The pool's one worker is busy until the event is set (at the latest
    when the test ends)."""
    release = threading.Event()
    started = threading.Event()
    pool.fork(lambda: (started.set(), release.wait(LIMIT)))
    assert started.wait(LIMIT)
    yield release
    release.set()


# -- submit and map ------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_submit_and_map_on_every_backend(backend):
    with aiopar.Executor(backend) as executor:
        fut = executor.submit(pow, 2, 8)
        assert isinstance(fut, aiopar.Future) and fut.result(LIMIT) == 256
        assert list(executor.map(pow, range(10), range(10))) == list(map(pow, range(10), range(10)))
        assert list(executor.map(mul, range(10), range(10), chunksize=3)) == [
            x * x for x in range(10)
        ]


def test_submit_passes_every_keyword_and_takes_the_function_positionally():
    with aiopar.Executor() as executor:
        assert executor.submit(mul, 2, y=8).result(LIMIT) == 16
        assert executor.submit(capture, 1, self=2, fn=3).result(LIMIT) == (
            (1,),
            {"self": 2, "fn": 3},
        )
        with pytest.raises(TypeError):
            executor.submit(fn=capture, arg=1)  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            executor.submit(arg=1)  # type: ignore[call-arg]


def test_a_future_of_submit_can_be_waited_awaited_and_chained():
    with aiopar.Executor() as executor:
        fut = executor.submit(mul, 6, 7)
        assert fut.then(lambda f: f.value() + 1).wait(LIMIT) == 43

        async def main() -> int:
            return await executor.submit(mul, 2, 3)

        assert asyncio.run(main()) == 6


def test_map_raises_a_call_s_exception_where_its_result_comes():
    with aiopar.Executor() as executor:
        results = executor.map(divmod, [1, 1, 1, 1], [2, 3, 0, 5])
        assert next(results) == (0, 1)
        assert next(results) == (0, 1)
        with pytest.raises(ZeroDivisionError):
            next(results)


@pytest.mark.parametrize("chunksize", [1, 3, None])
def test_map_starts_every_call_before_any_result_is_read(chunksize):
    finished: list[int] = []
    executor = aiopar.Executor()
    executor.map(finished.append, range(10), chunksize=chunksize)
    executor.shutdown(wait=True)
    assert sorted(finished) == list(range(10))


@pytest.mark.parametrize("timeout", [0, -1])
def test_map_past_its_deadline_raises_timeout_error_and_cancels_what_has_not_started(
    pool, held, timeout
):
    # Executor.map passes a negative timeout once its deadline has passed:
    # result() must raise TimeoutError then, as concurrent.futures' does.
    ran: list[str] = []
    executor = aiopar.Executor(pool)
    results = executor.map(ran.append, ["second", "third"], timeout=timeout)
    with pytest.raises(TimeoutError):
        next(results)
    held.set()
    executor.shutdown(wait=True)
    assert ran == []


def test_closing_the_map_iterator_cancels_the_calls_not_started(pool, held):
    ran: list[int] = []
    executor = aiopar.Executor(pool)
    results = executor.map(ran.append, range(5))
    assert next(results) is None  # the pool is held: this thread ran the first call
    results.close()
    held.set()
    executor.shutdown(wait=True)
    assert ran == [0]


def test_map_keeps_no_result_it_has_yielded():
    # No collection: a cycle that held a result would keep it too (and a
    # full collection of this process's heap took a quarter of a second).
    with aiopar.Executor() as executor:
        for value in executor.map(lambda _: Payload(), range(10)):
            ref = weakref.ref(value)
            del value
            # (the worker that made it may hold it a moment longer)
            eventually(lambda ref=ref: ref() is None, timeout=LIMIT)


def test_the_executor_keeps_no_reference_to_a_dropped_call():
    collected = threading.Event()
    payload = Payload()
    ref = weakref.ref(payload, lambda _: collected.set())
    with aiopar.Executor() as executor:
        executor.submit(payload.method)  # the future is dropped at once
        del payload
        assert collected.wait(LIMIT), ref


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_max_workers_must_be_a_whole_number_of_at_least_one(bad):
    with pytest.raises(ValueError, match="max_workers must be a whole number >= 1"):
        aiopar.Executor("thread", max_workers=bad)


def test_max_workers_goes_with_a_name_not_a_backend_or_one_without_workers(pool):
    with pytest.raises(TypeError, match="with a backend name"):
        aiopar.Executor(pool, max_workers=2)
    with pytest.raises(TypeError, match=r"the 'inline' backend does not take it.*'max_workers'"):
        aiopar.Executor("inline", max_workers=2)
    with pytest.raises(TypeError, match="takes a backend name or an aiopar Backend, got int"):
        aiopar.Executor(3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        aiopar.Executor("nope")


def test_a_named_executor_runs_on_the_backend_get_backend_gives():
    assert aiopar.Executor("thread").backend is aiopar.get_backend("thread")
    assert aiopar.Executor("thread", max_workers=3).backend is aiopar.get_backend(
        "thread", max_workers=3
    )


def test_at_most_max_workers_calls_run_at_once():
    running, most = 0, 0
    lock = threading.Lock()
    release = threading.Semaphore(0)

    def busy() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        release.acquire(timeout=LIMIT)
        with lock:
            running -= 1

    backend = ThreadBackend(max_workers=4)
    executor = aiopar.Executor(backend)
    futs = [executor.submit(busy) for _ in range(60)]
    for _ in futs:
        release.release()
    concurrent.futures.wait(futs, timeout=LIMIT)  # runs none of them in this thread
    backend.shutdown()
    assert all(f.exception() is None for f in futs) and 1 <= most <= 4


# -- asyncio --------------------------------------------------------------------


@pytest.mark.parametrize("new_loop", [asyncio.new_event_loop, uvloop.new_event_loop])
def test_run_in_executor_takes_an_executor(new_loop):
    async def main(executor: aiopar.Executor) -> list[int]:
        loop = asyncio.get_running_loop()
        calls = [
            loop.run_in_executor(executor, mul, 3, 4),
            loop.run_in_executor(executor, functools.partial(mul, y=5), 2),
        ]
        return list(await asyncio.gather(*calls))

    loop = new_loop()
    try:
        with aiopar.Executor() as executor:
            assert loop.run_until_complete(main(executor)) == [12, 10]
    finally:
        loop.close()


# -- shutdown -------------------------------------------------------------------


def test_submit_and_map_after_shutdown_raise_runtime_error():
    executor = aiopar.Executor()
    executor.shutdown()
    executor.shutdown()  # again: no harm
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        executor.submit(pow, 2, 5)
    with pytest.raises(RuntimeError, match="cannot schedule new futures after shutdown"):
        executor.map(pow, [2], [5])


def test_an_executor_on_a_backend_that_was_shut_down_says_so():
    backend = ThreadBackend(max_workers=1)
    executor = aiopar.Executor(backend)
    backend.shutdown()
    with pytest.raises(RuntimeError, match=r"backend of .* has been shut down"):
        executor.submit(pow, 2, 5)


def test_shutdown_waits_for_every_call_queued_or_running(pool, held):
    executor = aiopar.Executor(pool)
    futs = [executor.submit(mul, i, i) for i in range(50)]
    held.set()
    executor.shutdown(wait=True)
    assert all(f.done() for f in futs)
    assert [f.result() for f in futs] == [i * i for i in range(50)]


def test_shutdown_cancel_futures_cancels_the_calls_not_started(pool, held):
    executor = aiopar.Executor(pool)
    futs = [executor.submit(mul, i, i) for i in range(50)]
    executor.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in futs)
    held.set()


def test_shutdown_cancel_futures_lets_running_calls_finish(pool):
    started, release = threading.Event(), threading.Event()
    executor = aiopar.Executor(pool)
    running = executor.submit(lambda: (started.set(), release.wait(LIMIT))[1])
    queued = [executor.submit(mul, i, i) for i in range(10)]
    assert started.wait(LIMIT)
    executor.shutdown(wait=False, cancel_futures=True)
    assert all(f.cancelled() for f in queued) and not running.done()
    release.set()
    executor.shutdown(wait=True)
    assert running.result() is True


def test_shutdown_does_not_hang_on_a_call_cancelled_before_it(pool):
    # CPython's gh-94440.
    executor = aiopar.Executor(pool)
    executor.submit(int).result(LIMIT)
    executor.submit(int).cancel()
    executor.shutdown(wait=True)


def test_shutting_an_executor_down_leaves_its_backend_serving_others(pool):
    first, second = aiopar.Executor(pool), aiopar.Executor(pool)
    first.shutdown(wait=True)
    assert not pool.closed
    assert second.submit(mul, 6, 7).result(LIMIT) == 42
    assert pool.fork(mul, 2, 3).wait(LIMIT) == 6
    with aiopar.Executor(pool):
        pass
    assert not pool.closed


@pytest.mark.parametrize("end", ["shutdown without waiting", "dropped"])
def test_map_results_still_come_once_the_executor_is_shut_down_or_dropped(end):
    executor = aiopar.Executor()
    results = executor.map(abs, range(-5, 5))
    if end == "dropped":
        del executor
        gc.collect()
    else:
        executor.shutdown(wait=False)
    assert list(results) == [5, 4, 3, 2, 1, 0, 1, 2, 3, 4]


def test_shutdown_returns_while_a_call_keeps_submitting_itself():
    # A call that submits itself again and again: shutdown stops it taking
    # more (the stdlib pool's does), where shutting the backend down let a
    # task of the pool fork on it for ever.
    done = run_python(
        """
        import aiopar

        def again(executor):
            executor.submit(again, executor)

        with aiopar.Executor(max_workers=1) as executor:
            executor.submit(again, executor)
        print("returned")
        """,
        timeout=30,
    )
    assert done.stdout == "returned\n", done.stderr


@pytest.mark.parametrize("backend", ["thread", "process"])
def test_calls_submitted_and_never_waited_for_still_run_at_exit(backend):
    done = run_python(
        f"""
        import sys, time
        import aiopar

        def late(message):
            time.sleep(0.2)
            sys.stdout.write(message + "\\n")  # one write: the two workers print at once
            sys.stdout.flush()

        executor = aiopar.Executor({backend!r})
        executor.submit(late, "apple")
        executor.submit(late, "pear")
        executor.shutdown(wait=False)
        """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["apple", "pear"]


def test_exit_after_a_shutdown_that_cancelled_the_queued_calls_runs_none_of_them():
    done = run_python(
        """
        import time
        import aiopar

        def late(message):
            time.sleep(0.1)
            print(message, flush=True)

        executor = aiopar.Executor(max_workers=1)
        for message in ("apple", "pear", "plum"):
            executor.submit(late, message)
        executor.shutdown(wait=False, cancel_futures=True)
        """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout in ("", "apple\n")  # the first call may have started


def test_submit_after_interpreter_shutdown_raises_runtime_error():
    done = run_python(
        """
        import atexit

        @atexit.register
        def run_last():  # after aiopar's own exit handler
            try:
                executor.submit(id, None)
            except RuntimeError as exc:
                print(exc)

        import aiopar

        executor = aiopar.Executor()
        executor.submit(id, 42).result()
        """,
        timeout=60,
    )
    assert done.stdout.startswith("cannot schedule new futures: the backend"), done.stderr


def test_an_executor_is_what_concurrent_futures_code_takes():
    executor = aiopar.Executor()
    assert isinstance(executor, concurrent.futures.Executor)
    assert "running on <ThreadBackend" in repr(executor)
    executor.shutdown()
    assert "shut down" in repr(executor)


@pytest.mark.parametrize("args", [(), (3, 4)])
def test_a_backend_handed_over_as_an_executor_names_aiopar_executor(args):
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(TypeError, match=r"not a concurrent.futures.Executor.*aiopar.Executor"):
            loop.run_in_executor(aiopar.get_backend("thread"), mul, *args)
    finally:
        loop.close()
