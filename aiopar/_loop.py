"""The bridge from worker threads to event loops.

Completions reach a loop in batches: the first completion posted to an idle
bridge schedules one thread-safe wake-up, and every completion that arrives
before the loop runs it rides along. On Linux, asyncio and uvloop loops are
woken through an eventfd they watch. Coroutines forked outside any running
loop run on a loop thread owned by aiopar (uvloop when it is installed).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any

import sniffio

from ._errors import CancelledError

__all__ = ["owned_loop", "running_async_library", "start_coroutine", "wait_on_loop"]


class _Bridge:
    """Runs callables on one event loop's thread, one wake-up per batch.

    ``wake``, set by the function that makes the bridge, must make the loop
    call :meth:`drain` soon; any thread may call it.
    """

    __slots__ = ("_batch", "_lock", "wake")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batch: list[Callable[[], None]] = []
        self.wake: Callable[[], Any]

    def post(self, fn: Callable[[], None]) -> None:
        with self._lock:
            self._batch.append(fn)
            if len(self._batch) > 1:
                return  # a wake-up is already on its way and will run fn too
        with contextlib.suppress(RuntimeError):  # a closed loop has nobody left to wake
            self.wake()

    def drain(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for fn in batch:
            fn()


# Keyed weakly by loop (or trio token): a bridge must not keep its loop alive.
_bridges: weakref.WeakKeyDictionary[Any, _Bridge] = weakref.WeakKeyDictionary()
_bridges_lock = threading.Lock()


def _bridge(key: Any, new_bridge: Callable[[Any], _Bridge]) -> _Bridge:
    bridge = _bridges.get(key)
    if bridge is None:
        with _bridges_lock:
            bridge = _bridges.get(key)
            if bridge is None:
                bridge = _bridges[key] = new_bridge(key)
    return bridge


def _asyncio_bridge(loop: asyncio.AbstractEventLoop) -> _Bridge:
    """A bridge woken through an eventfd the loop watches, where there can be one.

    That costs the waking thread one write and the loop one read, where
    ``call_soon_threadsafe`` adds a handle, a self-pipe drained by two reads
    and a second pass of the loop; a sequential ``await fork(f)`` measures
    about a third faster on asyncio.
    """
    bridge = _Bridge()
    try:
        fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    except AttributeError:  # not Linux
        return _call_soon_bridge(bridge, loop, "call_soon_threadsafe")

    def on_readable() -> None:
        with contextlib.suppress(BlockingIOError):  # a late write already drained
            os.eventfd_read(fd)
        bridge.drain()

    try:
        loop.add_reader(fd, on_readable)
    except NotImplementedError:  # the proactor loop watches no fds
        os.close(fd)
        return _call_soon_bridge(bridge, loop, "call_soon_threadsafe")
    bridge.wake = functools.partial(os.eventfd_write, fd, 1)
    # Nothing can post once the loop is gone: every posted callable holds
    # an awaiting future of that loop.
    weakref.finalize(loop, os.close, fd)
    return bridge


def _call_soon_bridge(bridge: _Bridge, loop: Any, method: str) -> _Bridge:
    loop_ref = weakref.ref(loop)

    def wake() -> None:
        loop = loop_ref()
        if loop is not None:
            getattr(loop, method)(bridge.drain)

    bridge.wake = wake
    return bridge


def _trio_bridge(token: Any) -> _Bridge:
    return _call_soon_bridge(_Bridge(), token, "run_sync_soon")


def running_async_library() -> str | None:
    """Name of the async library whose loop runs in this thread, or ``None``.

    Only thread-bound state is read: sniffio's context variable is copied
    into forked tasks, so in a worker thread it may name a loop that runs
    elsewhere.
    """
    if asyncio._get_running_loop() is not None:
        return "asyncio"
    return sniffio.thread_local.name  # trio sets it while its loop runs here


def on_event_loop() -> bool:
    """Whether an asyncio, uvloop or trio loop runs in this thread."""
    return running_async_library() is not None


def wait_on_loop(fut: Any, *, cancel: bool = True) -> Generator[Any, None, None]:
    """Suspend the running coroutine until ``fut`` is done.

    If the coroutine is cancelled meanwhile and ``cancel`` is true, ``fut`` is
    cancelled too, which succeeds only if its task has not started.
    """
    loop = asyncio._get_running_loop()
    if loop is not None:
        waiter = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        bridge = _bridge(loop, _asyncio_bridge)
        fut._add_callback(lambda _: bridge.post(wake))
        try:
            yield from waiter
        except asyncio.CancelledError:
            if cancel:
                fut.cancel()
            raise
        return
    if running_async_library() == "trio":
        yield from _wait_on_trio(fut, cancel).__await__()
        return
    raise RuntimeError(
        "awaiting an aiopar Future needs a running asyncio, uvloop or trio event loop; "
        "outside one, call fut.wait() instead"
    )


async def _wait_on_trio(fut: Any, cancel: bool) -> None:
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
        if cancel:
            fut.cancel()
        return trio.lowlevel.Abort.SUCCEEDED

    bridge = _bridge(token, _trio_bridge)
    fut.add_done_callback(lambda _: bridge.post(wake))
    await trio.lowlevel.wait_task_rescheduled(abort)


class _OwnedLoop:
    """An event loop on a daemon thread, for coroutines forked outside any loop."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="aiopar-loop", daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


_owned: _OwnedLoop | None = None
_owned_lock = threading.Lock()


def owned_loop() -> asyncio.AbstractEventLoop:
    """The event loop aiopar runs on its own thread, started on first use."""
    global _owned
    with _owned_lock:
        if _owned is None:
            _owned = _OwnedLoop()
            atexit.register(_owned.close)
        return _owned.loop


# Event loops keep only weak references to tasks; these keep forked
# coroutines alive until they finish.
_running_tasks: set[Any] = set()


def _keep_until_done(task: asyncio.Task[Any]) -> None:
    _running_tasks.add(task)
    task.add_done_callback(_running_tasks.discard)


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(exc, trio.Cancelled)


def start_coroutine(
    fut: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: Any,
) -> None:
    """Run ``await fn(*args, **kwargs)`` on an event loop and settle ``fut``.

    The caller's running loop (asyncio, uvloop or trio) is used when there is
    one, else the owned loop. ``fut`` is claimed when the coroutine starts, so
    cancelling it before then means the coroutine never runs.
    """

    async def run() -> None:
        if not fut._claim():
            return
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            if not _is_cancellation(exc):
                fut._settle(None, exc)
                return
            error = CancelledError("the event loop running this coroutine cancelled it")
            error.__cause__ = exc
            fut._settle(None, error)
            raise  # a task must not swallow its own cancellation
        fut._settle(result, None)

    library = running_async_library()
    if library == "asyncio":
        _keep_until_done(asyncio.get_running_loop().create_task(run(), context=context))
    elif library == "trio":
        import trio

        trio.lowlevel.spawn_system_task(run, context=context)
    else:
        loop = owned_loop()
        loop.call_soon_threadsafe(
            lambda: _keep_until_done(loop.create_task(run(), context=context))
        )
