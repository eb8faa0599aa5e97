"""A pool's worker holds the wake-up of an await its task completes until it
stops running aiopar's code (aiopar._bridge.hold_wakes): never past code of
anyone else's. Every test runs on asyncio, uvloop and trio."""

from __future__ import annotations

import gc
import threading
import weakref

import anyio
import pytest
from helpers import eventually

import aiopar

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def noop() -> None:
    pass


async def test_another_callback_of_the_future_runs_after_the_await_is_woken():
    # The callback blocks until the awaiting coroutine has resumed: a
    # wake-up held past it would never come.
    resumed = threading.Event()
    saw_resumed: list[bool] = []
    gate = threading.Event()
    with aiopar.get_backend("thread", max_workers=1) as pool:
        fut = pool.fork(gate.wait, 30)
        waiting = anyio.Event()

        async def awaits() -> None:
            waiting.set()
            await fut
            resumed.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(awaits)
            await waiting.wait()
            # After the await's own callback: runs in the worker, after it.
            fut.add_done_callback(lambda _: saw_resumed.append(resumed.wait(30)))
            gate.set()
        eventually(lambda: saw_resumed)
        assert saw_resumed == [True]


async def test_a_future_settled_inside_a_task_wakes_its_loop_before_the_task_ends():
    # A nested settle is the task's own code, not its end: its await is
    # woken at once, while the task goes on (here, until the await is back).
    settled: aiopar.Future[int] = aiopar.Future()
    back = threading.Event()

    def task() -> bool:
        settled.set_result(1)
        return back.wait(30)

    with aiopar.get_backend("thread", max_workers=1) as pool:
        fut = pool.fork(task)
        assert await settled == 1
        back.set()
        assert await fut is True


async def test_an_idle_worker_keeps_nothing_of_its_last_task():
    class Result:
        pass

    with aiopar.get_backend("thread", max_workers=1) as pool:
        result = await pool.fork(Result)
        gone = weakref.ref(result)
        del result
        eventually(lambda: len(pool._idle) == 1)

        def collected() -> bool:
            gc.collect()
            return gone() is None

        eventually(collected)
