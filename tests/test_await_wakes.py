"""A pool's worker holds the wake-up of an await its task completes until the
task's run is over (aiopar._bridge.hold_wakes): never past code of anyone
else's. Every test runs on asyncio, uvloop and trio."""

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


async def test_a_fork_made_as_the_worker_heads_for_the_queues_wakes_no_other(monkeypatch):
    # The worker wakes the loop once its task's run is over, and counts as
    # on its way to the queues (as a woken worker does) until it takes a
    # task or goes idle: the loop's next fork meanwhile is left to it.
    from aiopar.backends import thread

    forked_again = threading.Event()
    sent = thread.send_wakes

    def send_then_pause(wakes: list) -> None:
        sent(wakes)
        assert forked_again.wait(30)

    monkeypatch.setattr(thread, "send_wakes", send_then_pause)
    gate = threading.Event()
    with thread.ThreadBackend(max_workers=2) as pool:  # a pool of its own: no worker yet
        # The task ends only once the await waits for it, so that the
        # worker has a wake-up to send (a task done before its await starts
        # leaves it none: it goes idle, and the next fork starts another).
        first = pool.fork(gate.wait, 30)
        async with anyio.create_task_group() as tg:
            tg.start_soon(_set, gate)  # runs once this task waits
            assert await first
        second = pool.fork(threading.get_ident)
        workers = len(pool._workers)
        forked_again.set()
        assert await second == next(iter(pool._workers)).thread.ident
    assert workers == 1


async def _set(event: threading.Event) -> None:
    event.set()
