"""The bridge from worker threads to event loops, and awaiting a future on one.

Completions reach a loop in batches: the first completion posted to an idle
bridge schedules one thread-safe wake-up, and every completion that arrives
before the loop runs it rides along. On Linux, asyncio and uvloop loops are
woken through an eventfd they watch.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any

import sniffio

from . import _waiter

__all__ = ["Bridge", "asyncio_bridge", "running_async_library", "wait_on_loop"]

_get_running_loop = asyncio._get_running_loop
_sniffio_thread = sniffio.thread_local


class Bridge:
    """Runs callables on one event loop's thread, one wake-up per batch.

    ``wake``, set by the function that makes the bridge, must make the loop
    call :meth:`drain` soon; any thread may call it.
    """

    __slots__ = ("_awaiting", "_batch", "_lock", "wake")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batch: list[Callable[[], None]] = []
        self._awaiting = 0  # aiopar futures awaited on this loop (only in a pool's thread)
        self.wake: Callable[[], Any]

    # A loop that runs inside a pool's thread (``asyncio.run`` in a forked
    # task) blocks that thread while it awaits forks, as a blocking wait
    # would: the thread's owner is told, so the pool can run the forks.
    def awaiting(self, owner: _waiter.Waiter) -> None:
        """An await starts on this loop; ``owner`` is the loop thread's
        waiter, to hand to :meth:`awaited` when the await ends."""
        self._awaiting += 1  # only the loop's own thread counts
        if self._awaiting == 1:
            owner.blocked()
            owner.blocked_long()  # nothing computes here meanwhile

    def awaited(self, owner: _waiter.Waiter) -> None:
        self._awaiting -= 1
        if self._awaiting == 0:
            owner.resumed()

    def post(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._batch.append(fn)
            if len(self._batch) > 1:
                return  # a wake-up is already on its way and will run fn too
        # Once per await: a try costs nothing, contextlib.suppress three calls.
        try:  # noqa: SIM105
            self.wake()
        except RuntimeError:  # a closed loop has nobody left to wake
            pass

    def drain(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for fn in batch:
            fn()


# Keyed weakly by loop (or trio token): a bridge must not keep its loop alive.
_bridges: weakref.WeakKeyDictionary[Any, Bridge] = weakref.WeakKeyDictionary()
_bridges_lock = threading.Lock()


def _bridge(key: Any, new_bridge: Callable[[Any], Bridge]) -> Bridge:
    bridge = _bridges.get(key)
    if bridge is None:
        with _bridges_lock:
            bridge = _bridges.get(key)
            if bridge is None:
                bridge = _bridges[key] = new_bridge(key)
    return bridge


def asyncio_bridge(loop: asyncio.AbstractEventLoop) -> Bridge:
    """The bridge to ``loop`` (made on first use, on the loop's own thread:
    making one registers a reader with the loop)."""
    return _bridge(loop, _new_asyncio_bridge)


def _new_asyncio_bridge(loop: asyncio.AbstractEventLoop) -> Bridge:
    """A bridge woken through an eventfd the loop watches, where there can be one.

    That costs the waking thread one write and the loop one read, where
    ``call_soon_threadsafe`` adds a handle, a self-pipe drained by two reads
    and a second pass of the loop; a sequential ``await fork(f)`` measures
    about a third faster on asyncio.
    """
    bridge = Bridge()
    try:
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    except AttributeError:  # not Linux
        return _call_soon_bridge(bridge, loop, "call_soon_threadsafe")

    def on_readable() -> None:
        try:  # noqa: SIM105 - once per wake-up, as in post()
            os.eventfd_read(fd)
        except BlockingIOError:  # a late write already drained it
            pass
        bridge.drain()

    try:
        loop.add_reader(fd, on_readable)
    except NotImplementedError:  # the proactor loop watches no fds
        os.close(fd)
        return _call_soon_bridge(bridge, loop, "call_soon_threadsafe")
    bridge.wake = functools.partial(os.eventfd_write, fd, 1)
    # Nothing can post once the loop is gone: every posted callable holds
    # an awaiting future of that loop. Not at exit: a loop that still runs
    # then (aiopar's own, finishing its forks) is still woken through it.
    weakref.finalize(loop, os.close, fd).atexit = False
    return bridge


def _call_soon_bridge(bridge: Bridge, loop: Any, method: str) -> Bridge:
    loop_ref = weakref.ref(loop)

    def wake() -> None:
        loop = loop_ref()
        if loop is not None:
            getattr(loop, method)(bridge.drain)

    bridge.wake = wake
    return bridge


def _new_trio_bridge(token: Any) -> Bridge:
    return _call_soon_bridge(Bridge(), token, "run_sync_soon")


def running_async_library() -> str | None:
    """Name of the async library whose loop runs in this thread, or ``None``.

    Only thread-bound state is read: sniffio's context variable is copied
    into forked tasks, so in a worker thread it may name a loop that runs
    elsewhere.
    """
    if _get_running_loop() is not None:
        return "asyncio"
    return _sniffio_thread.name  # trio sets it while its loop runs here


def wait_on_loop(
    subscribe: Callable[[Callable[[Any], object]], None], give_up: Callable[[], object]
) -> Generator[Any, None, None]:
    """Suspend the running coroutine until what it waits for is done:
    ``subscribe(callback)`` has ``callback`` called once it is, in any thread.

    If the coroutine is cancelled meanwhile, ``give_up()`` is called: for a
    future, a cancel (which stops its task if it has not started) or an
    abandon, so that a failure nobody reads is logged at DEBUG only, as
    ``asyncio.to_thread`` says nothing of the failure of a call whose caller
    was cancelled.
    """
    loop = _get_running_loop()
    if loop is not None:
        waiter = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        bridge = asyncio_bridge(loop)
        subscribe(lambda _: bridge.post(wake))
        owner = _waiter.get_waiter()
        if owner is not None:
            bridge.awaiting(owner)
        try:
            yield from waiter
        except asyncio.CancelledError:
            give_up()
            raise
        finally:
            if owner is not None:
                bridge.awaited(owner)
        return
    if running_async_library() == "trio":
        yield from _wait_on_trio(subscribe, give_up).__await__()
        return
    raise RuntimeError(
        "awaiting an aiopar Future needs a running asyncio, uvloop or trio event loop; "
        "outside one, call fut.wait() instead"
    )


async def _wait_on_trio(
    subscribe: Callable[[Callable[[Any], object]], None], give_up: Callable[[], object]
) -> None:
    import trio

    task = trio.lowlevel.current_task()
    token = trio.lowlevel.current_trio_token()
    aborted = False

    def wake() -> None:
        if not aborted:
            trio.lowlevel.reschedule(task)

    def abort(_raise_cancel: Any) -> trio.lowlevel.Abort:
        nonlocal aborted
        aborted = True
        give_up()
        return trio.lowlevel.Abort.SUCCEEDED

    bridge = _bridge(token, _new_trio_bridge)
    subscribe(lambda _: bridge.post(wake))
    await trio.lowlevel.wait_task_rescheduled(abort)


def _after_fork_in_child() -> None:
    # A bridge's eventfd would wake the parent's loop: bridges start afresh.
    global _bridges
    _bridges = weakref.WeakKeyDictionary()


os.register_at_fork(after_in_child=_after_fork_in_child)
