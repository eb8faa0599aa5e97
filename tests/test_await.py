"""await on asyncio, uvloop and trio (every test runs on all three)."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import traceback
import warnings
import weakref

import anyio
import pytest
from helpers import eventually

import aiopar
from aiopar import CancelledError, Future

pytestmark = pytest.mark.anyio


def square(x: int) -> int:
    return x * x


async def test_await_fork():
    assert await aiopar.fork(square, 7) == 49


async def test_await_done_future_does_not_suspend():
    fut: Future[int] = Future()
    fut.set_result(1)
    assert await fut == 1


async def test_await_user_future_settled_from_another_thread():
    fut: Future[str] = Future()
    threading.Timer(0.02, fut.set_result, args=("hello",)).start()
    assert await fut == "hello"


async def test_many_concurrent_awaits():
    results = []

    async def one(i):
        results.append(await aiopar.fork(square, i))

    async with anyio.create_task_group() as tg:
        for i in range(200):
            tg.start_soon(one, i)
    assert sorted(results) == sorted(i * i for i in range(200))


async def test_exception_reaches_await_with_traceback():
    def worker_failure():
        raise ArithmeticError("raised in the worker")

    with pytest.raises(ArithmeticError, match="raised in the worker") as info:
        await aiopar.fork(worker_failure)
    assert "worker_failure" in "".join(traceback.format_exception(info.value))


async def test_await_cancelled_future_raises_cancelled_error():
    fut: Future[int] = Future()
    fut.cancel()
    with pytest.raises(CancelledError):
        await fut


async def test_cancelling_the_awaiting_task_cancels_an_unstarted_fork():
    gate = threading.Event()
    ran = []
    backend = aiopar.get_backend("thread", max_workers=1)
    busy = backend.fork(gate.wait, 5)
    queued = backend.fork(ran.append, 1)
    with anyio.move_on_after(0.05):
        await queued
    assert queued.cancelled()
    gate.set()
    await busy
    await backend.fork(lambda: None)
    assert ran == []


async def test_cancelling_the_awaiting_task_leaves_a_running_fork_alone():
    started = threading.Event()
    gate = threading.Event()

    def task():
        started.set()
        gate.wait(5)
        return "finished"

    fut = aiopar.fork(task)
    while not started.is_set():
        await anyio.sleep(0.001)
    with anyio.move_on_after(0.02):
        await fut
    assert not fut.cancelled()
    gate.set()
    assert await fut == "finished"


async def test_fork_coroutine_function_runs_on_the_running_loop():
    loop_thread = threading.get_ident()

    async def where():
        await anyio.sleep(0)
        return threading.get_ident()

    assert await aiopar.fork(where) == loop_thread


async def test_forked_coroutine_failure_and_blocking_wait_from_another_thread():
    async def fails():
        await anyio.sleep(0)
        raise KeyError("coro")

    fut = aiopar.fork(fails)
    with pytest.raises(KeyError):
        await fut

    # The same kind of future is waitable from a plain thread.
    async def value():
        return 5

    fut2 = aiopar.fork(value)
    assert await anyio.to_thread.run_sync(fut2.wait) == 5


async def test_use_backend_holds_across_await_and_in_forked_tasks():
    with aiopar.use_backend("inline"):
        await anyio.sleep(0)
        assert aiopar.get_backend().name == "inline"

        def inner_backend():
            return aiopar.get_backend().name

        assert await aiopar.get_backend("thread").fork(inner_backend) == "inline"
    assert aiopar.get_backend().name == "thread"


async def test_as_completed_async():
    gates = [threading.Event() for _ in range(3)]
    backend = aiopar.get_backend("thread", max_workers=3)
    futs = [backend.fork(lambda g=g, i=i: (g.wait(5), i)[1]) for i, g in enumerate(gates)]
    order = []
    gates[1].set()
    async for fut in aiopar.as_completed(futs):
        order.append(fut.value())
        if len(order) == 1:
            gates[2].set()
        elif len(order) == 2:
            gates[0].set()
    assert order == [1, 2, 0]


async def test_as_completed_async_timeout():
    with pytest.raises(TimeoutError):
        async for _ in aiopar.as_completed([Future()], timeout=0.05):
            pass


async def test_async_task_group():
    async def coro(x):
        await anyio.sleep(0)
        return x

    async with aiopar.task_group() as tg:
        a = tg.fork(square, 3)
        b = tg.fork(coro, 4)
    assert (a.value(), b.value()) == (9, 4)


async def test_async_task_group_failure():
    def fail():
        raise ValueError("in group")

    with pytest.raises(ValueError, match="in group"):
        async with aiopar.task_group() as tg:
            tg.fork(fail)
            tg.fork(square, 2)


async def test_wrap_awaitable_on_running_loop():
    async def coro():
        await anyio.sleep(0)
        return "wrapped"

    assert await aiopar.wrap(coro()) == "wrapped"


BLOCKS_THE_LOOP = "stalls the event loop running in this thread"


def blocking_calls():
    """Each way of blocking on a future from a coroutine, on its own line.

    Each takes ``lasts``, the task it forks: run by a worker, it lasts until
    the wait has warned, so no future is done before its wait is called,
    however late this thread gets there on a busy machine."""

    def not_started(lasts):
        aiopar.fork(lasts).wait()  # the waiter runs the task itself

    def running(lasts):
        started = threading.Event()
        fut = aiopar.fork(lambda: (started.set(), lasts()))
        assert started.wait(10)  # a worker runs it
        fut.wait()

    def result(lasts):
        aiopar.fork(lasts).result()

    def sync_as_completed(lasts):
        for _ in aiopar.as_completed([aiopar.fork(lasts)]):
            pass

    def wait_all_runs_it(lasts):
        # The one worker is held: wait_all runs the queued task on the loop's thread.
        pool = aiopar.get_backend("thread", max_workers=1)
        gate = threading.Event()
        pool.fork(gate.wait, 5)
        aiopar.wait_all([pool.fork(gate.set)])

    def collect_all_wait(lasts):
        aiopar.collect_all([aiopar.fork(lasts)]).wait()

    return [
        not_started,
        running,
        result,
        sync_as_completed,
        wait_all_runs_it,
        collect_all_wait,
    ]


@pytest.mark.parametrize("block", blocking_calls(), ids=lambda f: f.__name__)
async def test_a_blocking_wait_on_the_loop_thread_warns_at_the_callers_line(block):
    with pytest.warns(RuntimeWarning, match=BLOCKS_THE_LOOP) as caught:
        block(lambda: eventually(lambda: len(caught), timeout=10))
    (warning,) = [w for w in caught if BLOCKS_THE_LOOP in str(w.message)]
    assert warning.filename == __file__, "attributed to the line that blocks"
    assert "await fut" in str(warning.message)


async def test_the_blocking_warning_is_shown_once_per_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            with pytest.raises(TimeoutError):
                Future().wait(timeout=0.001)  # never done: each wait blocks
    assert len([w for w in caught if BLOCKS_THE_LOOP in str(w.message)]) == 1


async def test_waiting_on_a_done_future_on_the_loop_thread_does_not_warn():
    fut = aiopar.fork(int, "1")
    await fut
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fut.wait() == 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_asyncio_interop_gather_wait_for_shield():
    import asyncio

    assert await asyncio.gather(aiopar.fork(square, 2), aiopar.fork(square, 3)) == [4, 9]
    assert await asyncio.wait_for(aiopar.fork(square, 4), timeout=5) == 16
    assert await asyncio.shield(aiopar.fork(square, 5)) == 25
    never: Future[int] = Future()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(never, timeout=0.02)
    assert never.cancelled()  # wait_for cancels what it gave up on


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_wrap_asyncio_future():
    import asyncio

    loop = asyncio.get_running_loop()
    source = loop.create_future()
    adopted = aiopar.wrap(source)
    loop.call_later(0.01, source.set_result, "via asyncio")
    assert await adopted == "via asyncio"


async def test_a_task_forked_from_a_loop_is_not_on_the_loop():
    # The forked task runs in a copy of the loop's context; it must still
    # know it is on a plain worker thread: it may block, and fork coroutines.
    async def coro():
        return "coro"

    def task():
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            return aiopar.fork(coro).wait(timeout=5)

    backend = aiopar.get_backend("thread", max_workers=1)
    assert await backend.fork(task) == "coro"


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts fds through /proc")
@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_a_loop_that_awaited_forks_leaves_no_fd_and_is_not_kept_alive(loop_factory):
    if loop_factory == "uvloop":
        new_loop = pytest.importorskip("uvloop").new_event_loop
    else:
        new_loop = asyncio.new_event_loop

    async def main():
        assert await aiopar.fork(square, 3) == 9

    def run_once():
        loop = new_loop()
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()
        return weakref.ref(loop)

    run_once()  # the first run may open fds that stay (the pool's threads, say)
    gc.collect()
    before = _open_fds()
    refs = [run_once() for _ in range(20)]
    gc.collect()
    assert all(ref() is None for ref in refs)
    assert _open_fds() <= before


def test_an_await_resumes_its_task_in_the_loop_pass_that_drains_its_wake_up():
    # An asyncio future set as the bridge drains would resume the task on
    # the loop's next pass: two passes, and two selects, per await.
    loop = asyncio.new_event_loop()
    select = loop._selector.select  # type: ignore[attr-defined]
    passes = 0

    def counting_select(timeout=None):
        nonlocal passes
        passes += 1
        return select(timeout)

    loop._selector.select = counting_select  # type: ignore[attr-defined]

    async def awaits(n: int) -> int:
        nonlocal passes
        await aiopar.fork(square, 2)  # the loop's bridge is made
        passes = 0
        for _ in range(n):
            await aiopar.fork(square, 2)
        return passes

    try:
        assert loop.run_until_complete(awaits(50)) <= 60
    finally:
        loop.close()


async def test_a_task_resumes_in_its_own_context_after_an_await():
    import contextvars

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var")
    seen: dict[str, list[str]] = {"a": [], "b": []}

    async def awaits(name: str) -> None:
        var.set(name)
        for _ in range(20):
            await aiopar.fork(square, 3)
            seen[name].append(var.get())

    async with anyio.create_task_group() as tg:
        tg.start_soon(awaits, "a")
        tg.start_soon(awaits, "b")
    assert seen == {"a": ["a"] * 20, "b": ["b"] * 20}


@pytest.mark.parametrize("loop_factory", ["asyncio", "uvloop"])
def test_the_message_of_a_cancel_reaches_the_coroutine_that_awaits(loop_factory):
    new_loop = (
        pytest.importorskip("uvloop").new_event_loop
        if loop_factory == "uvloop"
        else asyncio.new_event_loop
    )
    started, gate = threading.Event(), threading.Event()

    def runs() -> None:
        started.set()
        gate.wait(30)

    async def main() -> None:
        fut = aiopar.fork(runs)
        await asyncio.to_thread(started.wait, 30)  # a cancelled await cancels a fork not started
        caught: list[BaseException] = []

        async def awaits() -> None:
            try:
                await fut
            except asyncio.CancelledError as exc:
                caught.append(exc)
                raise

        task = asyncio.ensure_future(awaits())
        await asyncio.sleep(0)  # it awaits
        assert "aiopar await pending" in repr(task)
        task.cancel("why")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert [exc.args for exc in caught] == [("why",)]
        gate.set()
        await fut

    loop = new_loop()
    try:
        loop.run_until_complete(main())
    finally:
        gate.set()
        loop.close()


def test_what_a_batch_has_left_when_a_resumed_task_raises_runs_on_the_next_drain():
    # A task's step re-raises KeyboardInterrupt and SystemExit, out of the
    # bridge's drain that resumed it: the other awaits of its batch are not lost.
    from aiopar._bridge import Bridge

    bridge = Bridge()
    wakes: list[int] = []
    bridge.wake = lambda: wakes.append(1)
    ran: list[str] = []

    def interrupted() -> None:
        raise KeyboardInterrupt

    bridge.post(interrupted)
    bridge.post(lambda: ran.append("second"))
    assert wakes == [1]
    with pytest.raises(KeyboardInterrupt):
        bridge.drain()
    assert ran == [] and wakes == [1, 1]  # woken again for the rest
    bridge.drain()
    assert ran == ["second"]
