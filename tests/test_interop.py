"""aiopar futures in code written for asyncio's, concurrent.futures' and trio's own tools.

The asyncio tests run on asyncio and uvloop, in debug mode: there a
callback that touches the loop from another thread raises instead of
leaving the loop asleep.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import gc
import logging
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from typing import Any

import pytest
import trio
import uvloop
from helpers import eventually, run_python

import aiopar
from aiopar import CancelledError, Future

pytestmark = pytest.mark.timeout(60)

# Every wait in these tests is bounded: a regression fails, it never hangs.
LIMIT = 10


def square(x: int) -> int:
    return x * x


def fail(message: str) -> None:
    raise ValueError(message)


def settle_later(fut: Future[Any], value: Any, delay: float = 0.02) -> None:
    """Settle ``fut`` from another thread after ``delay`` seconds."""
    threading.Timer(delay, fut.set_result, args=(value,)).start()


async def until(condition: Callable[[], bool]) -> None:
    """Return once ``condition()`` holds, letting the loop run meanwhile; at most LIMIT s."""
    deadline = time.monotonic() + LIMIT
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


LOOPS = {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


@pytest.fixture(params=LOOPS.values(), ids=LOOPS.keys())
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """Runs a coroutine to its end on a fresh debug-mode loop of the parameter's kind."""

    def run(coroutine: Coroutine[Any, Any, Any]) -> Any:
        loop = request.param()
        loop.set_debug(True)
        try:
            task = loop.create_task(coroutine)
            # Not wait_for: it waits for what it cancels, so a task that can
            # never wake would hang it.
            loop.run_until_complete(asyncio.wait([task], timeout=LIMIT))
            if not task.done():
                task.cancel()
                raise AssertionError(f"the coroutine hung: still not done after {LIMIT} s")
            loop.run_until_complete(loop.shutdown_default_executor())
            return task.result()
        finally:
            loop.close()

    return run


@pytest.fixture
def no_errors_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fail if aiopar or asyncio logs an error (a callback that raised, say)."""
    with caplog.at_level(logging.ERROR):
        yield
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# -- asyncio.wait: the one asyncio call that uses the future itself ---------


def test_asyncio_wait_returns_the_futures_once_done(run, no_errors_logged):
    async def main() -> None:
        user: Future[str] = Future()
        settle_later(user, "set by a thread")
        futs = [aiopar.fork(square, n) for n in range(20)] + [user]
        done, pending = await asyncio.wait(futs)
        assert done == set(futs) and pending == set()
        assert user.value() == "set by a thread"

    run(main())


def test_asyncio_wait_with_a_timeout_returns_what_is_pending(run, no_errors_logged):
    never: Future[int] = Future()

    async def main() -> None:
        quick = aiopar.fork(square, 3)
        await quick
        done, pending = await asyncio.wait([quick, never], timeout=0.05)
        assert done == {quick} and pending == {never}
        never.set_result(1)  # asyncio removed its callback: nothing runs or fails
        await asyncio.sleep(0.01)

    run(main())
    assert never.value() == 1


def test_asyncio_wait_first_completed_and_first_exception(run, no_errors_logged):
    async def main() -> None:
        gate: Future[None] = Future()
        quick = aiopar.fork(square, 2)
        done, pending = await asyncio.wait([gate, quick], return_when=asyncio.FIRST_COMPLETED)
        assert done == {quick} and pending == {gate}

        failing = aiopar.fork(fail, "boom")
        done, pending = await asyncio.wait([gate, failing], return_when=asyncio.FIRST_EXCEPTION)
        assert done == {failing} and pending == {gate}
        gate.set_result(None)

    run(main())


def test_asyncio_wait_on_futures_done_or_settled_on_the_loop(run, no_errors_logged):
    async def main() -> None:
        done_already: Future[int] = Future()
        done_already.set_result(1)
        on_loop: Future[int] = Future()
        asyncio.get_running_loop().call_later(0.01, on_loop.set_result, 2)
        cancelled = aiopar.Future()
        cancelled.cancel()
        done, pending = await asyncio.wait([done_already, on_loop, cancelled])
        assert done == {done_already, on_loop, cancelled} and not pending

    run(main())


# -- every asyncio call that takes a future ----------------------------------


async def _via_wait(fut: Future[Any]) -> Any:
    done, _ = await asyncio.wait([fut])
    return done.pop().value()


async def _via_as_completed(fut: Future[Any]) -> Any:
    (first,) = asyncio.as_completed([fut])
    return await first


async def _via_task(fut: Future[Any]) -> Any:
    async def awaits() -> Any:
        return await fut

    return await asyncio.create_task(awaits())


ASYNCIO_CALLS: dict[str, Callable[[Future[Any]], Awaitable[Any]]] = {
    "wait": _via_wait,
    "gather": lambda fut: asyncio.gather(fut),
    "wait_for": lambda fut: asyncio.wait_for(fut, LIMIT),
    "shield": asyncio.shield,
    "ensure_future": asyncio.ensure_future,
    "as_completed": _via_as_completed,
    "task awaiting it": _via_task,
    "wrap_future": asyncio.wrap_future,
}


@pytest.mark.parametrize("call", ASYNCIO_CALLS.values(), ids=ASYNCIO_CALLS.keys())
def test_every_asyncio_call_takes_a_fork(run, no_errors_logged, call):
    async def main() -> None:
        result = await call(aiopar.fork(square, 5))
        assert result in (25, [25])  # gather gives a list
        with pytest.raises(ValueError, match="in a fork"):
            await call(aiopar.fork(fail, "in a fork"))

    run(main())


@pytest.mark.parametrize("loop_factory", LOOPS.values(), ids=LOOPS.keys())
def test_run_until_complete_takes_a_fork(loop_factory, no_errors_logged):
    loop = loop_factory()
    try:
        assert loop.run_until_complete(aiopar.fork(square, 6)) == 36
    finally:
        loop.close()


def test_an_aiopar_future_is_not_an_asyncio_future():
    # So asyncio wraps it in a Task that awaits it, and a timeout or a
    # cancellation ends that Task at once even when the fork already runs.
    assert not asyncio.isfuture(Future())


def test_wait_for_gives_up_on_a_running_fork_at_once(run):
    started, release = threading.Event(), threading.Event()

    def blocks() -> str:
        started.set()
        release.wait(LIMIT)
        return "finished anyway"

    async def main() -> None:
        fut = aiopar.fork(blocks)
        await asyncio.to_thread(started.wait, LIMIT)
        begun = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(fut, 0.05)
        assert time.monotonic() - begun < LIMIT / 2  # did not wait for the task
        assert fut.running()  # a running task is never interrupted
        release.set()
        assert await fut == "finished anyway"

    run(main())


def test_wrap_future_carries_cancellation_both_ways(run):
    async def main() -> None:
        source: Future[int] = Future()
        wrapped = asyncio.wrap_future(source)
        wrapped.cancel()
        await asyncio.sleep(0)
        assert source.cancelled()

        source = Future()
        wrapped = asyncio.wrap_future(source)
        source.cancel()
        with pytest.raises(asyncio.CancelledError):
            await wrapped

    run(main())


class ForkExecutor(concurrent.futures.Executor):
    """An Executor whose futures are aiopar's."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        return aiopar.fork(fn, *args, **kwargs)


def test_run_in_executor_takes_an_executor_of_aiopar_futures(run, no_errors_logged):
    async def main() -> None:
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(ForkExecutor(), square, 9) == 81

    run(main())
    assert list(ForkExecutor().map(square, range(4))) == [0, 1, 4, 9]


# -- done-callbacks -----------------------------------------------------------


def _asyncio_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, presented as asyncio's own code (as asyncio.wait's callback is)."""
    fn.__module__ = "asyncio.tasks"
    return fn


def test_callbacks_asyncio_adds_run_on_its_loop_those_users_add_where_settled(run):
    async def main() -> None:
        loop_thread = threading.get_ident()
        asyncio_ran: list[int] = []
        user_ran: list[int] = []
        futs: list[Future[int]] = [Future() for _ in range(50)]
        for fut in futs:
            fut.add_done_callback(
                _asyncio_code(lambda f: asyncio_ran.append(threading.get_ident()))
            )
            fut.add_done_callback(lambda f: user_ran.append(threading.get_ident()))
        settler = threading.Thread(target=lambda: [f.set_result(0) for f in futs])
        settler.start()
        await asyncio.to_thread(settler.join)
        await until(lambda: len(asyncio_ran) == len(futs))
        assert asyncio_ran == [loop_thread] * len(futs)
        assert user_ran == [settler.ident] * len(futs)

    run(main())


def test_an_asyncio_callback_that_raises_goes_to_the_loop_handler_and_spares_the_rest(run):
    async def main() -> None:
        reported: list[BaseException] = []
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: reported.append(context["exception"])
        )
        ran: list[Future[int]] = []
        futs: list[Future[int]] = [Future() for _ in range(20)]
        for fut in futs:
            fut.add_done_callback(_asyncio_code(lambda f: 1 / 0))
            fut.add_done_callback(_asyncio_code(ran.append))
        futs[0].set_result(0)  # settled on the loop's thread: run at once
        await asyncio.to_thread(lambda: [f.set_result(0) for f in futs[1:]])
        await until(lambda: len(ran) == len(futs))
        assert ran == futs
        assert len(reported) == len(futs)
        assert all(isinstance(exc, ZeroDivisionError) for exc in reported)

    run(main())


def test_an_asyncio_callback_whose_loop_closed_runs_where_settled():
    ran: list[int] = []
    fut: Future[int] = Future()

    async def add() -> None:
        fut.add_done_callback(_asyncio_code(lambda f: ran.append(threading.get_ident())))

    asyncio.run(add())
    settler = threading.Thread(target=fut.set_result, args=(1,))
    settler.start()
    settler.join(LIMIT)
    assert ran == [settler.ident]


def test_add_done_callback_runs_in_the_context_given():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="outside")
    context = contextvars.copy_context()
    context.run(var.set, "inside")
    seen: list[str] = []
    fut: Future[int] = Future()
    fut.add_done_callback(lambda f: seen.append(var.get()), context=context)
    fut.set_result(1)
    fut.add_done_callback(lambda f: seen.append(var.get()), context=context)  # done: at once
    assert seen == ["inside", "inside"]


def test_remove_done_callback_removes_every_equal_pending_callback():
    ran: list[str] = []
    fut: Future[int] = Future()

    def one(f: Future[int]) -> None:
        ran.append("one")

    def other(f: Future[int]) -> None:
        ran.append("other")

    context = contextvars.copy_context()
    fut.add_done_callback(one)
    fut.add_done_callback(other)
    fut.add_done_callback(one, context=context)
    assert fut.remove_done_callback(one) == 2
    assert fut.remove_done_callback(one) == 0
    fut.set_result(1)
    assert ran == ["other"]
    assert fut.remove_done_callback(other) == 0


# -- concurrent.futures -------------------------------------------------------


def test_an_aiopar_future_is_a_concurrent_future():
    assert isinstance(aiopar.fork(square, 2), concurrent.futures.Future)


def test_set_running_or_notify_cancel_as_an_executor_calls_it():
    fut: Future[int] = Future()
    assert fut.set_running_or_notify_cancel() is True
    assert fut.running() and not fut.cancel()
    with pytest.raises(aiopar.InvalidStateError, match="runs only once"):
        fut.set_running_or_notify_cancel()
    cancelled: Future[int] = Future()
    cancelled.cancel()
    assert cancelled.set_running_or_notify_cancel() is False


def test_concurrent_wait_all_completed_mixes_aiopar_and_executor_futures():
    done_already: Future[int] = Future()
    done_already.set_result(0)
    later: Future[int] = Future()
    settle_later(later, 1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futs = [done_already, later, aiopar.fork(square, 3), pool.submit(square, 4)]
        done, not_done = concurrent.futures.wait(futs, timeout=LIMIT)
    assert done == set(futs) and not not_done


def test_concurrent_wait_first_completed_and_first_exception():
    gate: Future[None] = Future()
    quick = aiopar.fork(square, 2)
    done, not_done = concurrent.futures.wait(
        [gate, quick], timeout=LIMIT, return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert done == {quick} and not_done == {gate}

    failing = aiopar.fork(fail, "boom")
    done, not_done = concurrent.futures.wait(
        [gate, failing], timeout=LIMIT, return_when=concurrent.futures.FIRST_EXCEPTION
    )
    assert done == {failing} and not_done == {gate}

    cancelled: Future[None] = Future()
    threading.Timer(0.02, cancelled.cancel).start()
    done, not_done = concurrent.futures.wait(
        [gate, cancelled], timeout=LIMIT, return_when=concurrent.futures.FIRST_COMPLETED
    )
    assert done == {cancelled} and not_done == {gate}
    gate.set_result(None)


def test_concurrent_wait_timeout_then_the_future_settles_normally():
    pending: Future[int] = Future()
    done, not_done = concurrent.futures.wait([pending], timeout=0.02)
    assert not done and not_done == {pending}
    blocked = threading.Thread(target=pending.wait, args=(LIMIT,))
    blocked.start()
    settle_later(pending, 7)
    assert pending.wait(LIMIT) == 7
    blocked.join(LIMIT)
    assert not blocked.is_alive()


def test_concurrent_wait_and_a_blocked_thread_wait_on_one_future():
    fut: Future[int] = Future()
    results: list[int] = []
    blocked = threading.Thread(target=lambda: results.append(fut.wait(LIMIT)))
    blocked.start()
    eventually(lambda: fut._waiters)  # it blocks first, so both kinds of waiter are registered
    settle_later(fut, 5)
    done, _ = concurrent.futures.wait([fut], timeout=LIMIT)
    blocked.join(LIMIT)
    assert done == {fut} and results == [5]


def test_concurrent_as_completed_yields_each_once_in_completion_order():
    first: Future[str] = Future()
    second: Future[str] = Future()
    done_already: Future[str] = Future()
    done_already.set_result("done")
    finished = concurrent.futures.as_completed([second, first, done_already, first], LIMIT)
    assert next(finished) is done_already
    first.set_result("first")
    assert next(finished) is first
    settle_later(second, "second")  # the iterator blocks until then
    assert next(finished) is second
    assert list(finished) == []  # the duplicate of first came once


def test_concurrent_as_completed_timeout():
    never: Future[int] = Future()
    with pytest.raises(TimeoutError):
        list(concurrent.futures.as_completed([aiopar.fork(square, 1), never], timeout=0.05))


def test_a_future_left_by_concurrent_wait_is_freed_at_once():
    # No cycle through the waiters: the future goes when its last reference does.
    gc.disable()
    try:
        done: Future[int] = Future()
        done.set_result(1)
        pending: Future[int] = Future()
        concurrent.futures.wait([done, pending], timeout=0.01)
        list(concurrent.futures.as_completed([done]))
        refs = [weakref.ref(done), weakref.ref(pending)]
        del done, pending
        assert [ref() for ref in refs] == [None, None]
    finally:
        gc.enable()


# -- an aiopar Future where another one was expected, and the other way round --


@pytest.mark.parametrize("call", [aiopar.wait, aiopar.wait_all, aiopar.collect_all])
def test_an_executor_future_given_to_aiopar_names_both_and_the_fix(call):
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        foreign = pool.submit(square, 2)
        arg = foreign if call is aiopar.wait else [foreign]
        with pytest.raises(TypeError) as info:
            call(arg)
    message = str(info.value)
    assert "aiopar Future" in message
    assert "concurrent.futures.Future" in message
    assert "aiopar.wrap()" in message
    assert aiopar.wrap(foreign).wait(LIMIT) == 4  # the fix it names works


def test_asyncio_futures_and_coroutines_given_to_aiopar_name_the_fix(run):
    async def main() -> None:
        task = asyncio.ensure_future(asyncio.sleep(0, "slept"))
        with pytest.raises(TypeError, match=r"got asyncio\.Task; adapt it with aiopar\.wrap\(\)"):
            aiopar.wait(task)
        assert await aiopar.wrap(task) == "slept"
        coroutine = asyncio.sleep(0)
        with pytest.raises(TypeError, match=r"got coroutine; fork the coroutine function"):
            aiopar.as_completed([coroutine])
        await coroutine

    run(main())


def test_wrap_of_something_else_says_what_it_takes():
    with pytest.raises(TypeError, match=r"got int; to run a function, use aiopar\.fork"):
        aiopar.wrap(42)


class DaskLikeFuture:
    """What a dask.distributed Future of a synchronous client offers: the
    concurrent.futures callback protocol, callbacks run on a thread of their
    own, and an ``__await__`` that calls ``result()`` (a value, not an
    awaitable, outside the client's loop)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[DaskLikeFuture], object]] = []
        self._outcome: tuple[str, Any] | None = None

    def add_done_callback(self, fn: Callable[[DaskLikeFuture], object]) -> None:
        with self._lock:
            if self._outcome is None:
                self._callbacks.append(fn)
                return
        threading.Thread(target=fn, args=(self,)).start()

    def settle(self, kind: str, what: Any = None) -> None:
        with self._lock:
            self._outcome = (kind, what)
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            threading.Thread(target=fn, args=(self,)).start()

    def done(self) -> bool:
        return self._outcome is not None

    def cancelled(self) -> bool:
        return self._outcome is not None and self._outcome[0] == "cancelled"

    def cancel(self) -> None:
        self.settle("cancelled")

    def exception(self, timeout: float | None = None) -> Any:
        assert self._outcome is not None, "the test reads only done futures"
        return self._outcome[1] if self._outcome[0] == "error" else None

    def result(self, timeout: float | None = None) -> Any:
        assert self._outcome is not None, "the test reads only done futures"
        kind, what = self._outcome
        if kind == "error":
            raise what
        return what

    def __await__(self) -> Any:
        return self.result().__await__()


def test_wrap_adopts_a_future_with_the_concurrent_futures_protocol_not_its_await():
    # A dask Future used to be awaited on aiopar's loop thread, where its
    # result() is a value: "'int' object has no attribute '__await__'".
    succeeds, fails, cancelled = DaskLikeFuture(), DaskLikeFuture(), DaskLikeFuture()
    adopted = [aiopar.wrap(f) for f in (succeeds, fails, cancelled)]
    error = KeyError("remote")
    succeeds.settle("value", 2)
    fails.settle("error", error)
    cancelled.cancel()
    assert adopted[0].wait(LIMIT) == 2
    assert adopted[1].exception(LIMIT) is error
    with pytest.raises(CancelledError):
        adopted[2].wait(LIMIT)


def test_cancelling_what_wrap_returned_cancels_the_original():
    original = DaskLikeFuture()
    assert aiopar.wrap(original).cancel()
    assert original.cancelled()


def test_a_future_whose_outcome_wrap_cannot_read_fails_what_it_returned_saying_why():
    class AsynchronousClientFuture(DaskLikeFuture):
        def exception(self, timeout: float | None = None) -> Any:
            return object()  # an asynchronous dask client gives a coroutine

    original = AsynchronousClientFuture()
    adopted = aiopar.wrap(original)
    original.settle("value", 1)
    with pytest.raises(TypeError, match="asynchronous Client"):
        adopted.wait(LIMIT)


def test_a_dask_like_future_given_to_aiopar_names_wrap():
    with pytest.raises(TypeError, match=r"DaskLikeFuture; adapt it with aiopar\.wrap\(\)"):
        aiopar.wait(DaskLikeFuture())  # type: ignore[arg-type]


def test_wrap_adopts_a_real_dask_future():
    pytest.importorskip("distributed")
    done = run_python(
        """
        from distributed import Client, LocalCluster
        import aiopar

        def inc(x):
            return x + 1

        def fail():
            raise KeyError("on the worker")

        with LocalCluster(
            n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None
        ) as cluster, Client(cluster) as client:
            print(aiopar.wrap(client.submit(inc, 1)).wait(30))
            print(type(aiopar.wrap(client.submit(fail)).exception(30)).__name__)
        """,
        timeout=120,
    )
    assert done.stdout.split() == ["2", "KeyError"], done.stderr


# -- trio ---------------------------------------------------------------------


def test_trio_move_on_after_cancels_an_unstarted_fork_and_leaves_a_running_one():
    started, release = threading.Event(), threading.Event()

    def blocks() -> str:
        started.set()
        release.wait(LIMIT)
        return "ran to the end"

    async def main() -> None:
        with aiopar.use_backend("thread", max_workers=1):
            running = aiopar.fork(blocks)
            queued = aiopar.fork(square, 3)
        await trio.to_thread.run_sync(started.wait, LIMIT)
        with trio.move_on_after(0.02) as scope:
            await queued
        assert scope.cancelled_caught and queued.cancelled()
        with trio.move_on_after(0.02) as scope:
            await running
        assert scope.cancelled_caught and running.running()
        release.set()
        assert await running == "ran to the end"
        with pytest.raises(CancelledError):
            await queued

    trio.run(main)


def test_trio_fail_after_and_nurseries():
    async def main() -> None:
        never: Future[int] = Future()
        with pytest.raises(trio.TooSlowError):
            with trio.fail_after(0.02):
                await never
        assert never.cancelled()  # not started, so the cancellation reached it

        results: dict[int, int] = {}

        async def one(n: int) -> None:
            results[n] = await aiopar.fork(square, n)

        with trio.fail_after(LIMIT):
            async with trio.open_nursery() as nursery:
                for n in range(20):
                    nursery.start_soon(one, n)
        assert results == {n: n * n for n in range(20)}

    trio.run(main)
