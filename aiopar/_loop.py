"""Where a coroutine fork runs: on the caller's running loop (asyncio,
uvloop or trio), else on an event loop aiopar owns, on a daemon thread of
its own (uvloop when it is installed), started on first use and run to the
end of its forks at interpreter exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import Any

from . import _interrupt, _trace
from ._bridge import running_async_library
from ._coroutine_fork import CoroutineFork, forks_of, settling_run, start_on_asyncio

__all__ = [
    "close_owned_loop",
    "finish_owned_loop",
    "on_owned_loop",
    "owned_loop",
    "owned_loop_running",
    "start_coroutine",
]


class _OwnedLoop:
    """An event loop on a daemon thread, for coroutines forked outside any loop."""

    def __init__(self) -> None:
        try:
            import uvloop

            self.loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        except (ImportError, RuntimeError):  # not installed; too late to import at exit
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="aiopar-loop", daemon=True
        )
        self.thread.start()

    def running(self) -> list[CoroutineFork]:
        """The coroutine forks on this loop that have not finished."""
        return list(forks_of(self.loop).values())

    def finish(self, *, cancel_pending: bool) -> None:
        """Return once every coroutine fork on the loop has finished; with
        ``cancel_pending``, those that have not started never do."""

        async def drain() -> None:
            while forks := forks_of(self.loop):
                if cancel_pending:
                    for fork in list(forks.values()):
                        fork.future.cancel()  # only if it has not started
                await asyncio.wait(list(forks))

        drained = asyncio.run_coroutine_threadsafe(drain(), self.loop)
        while not drained.done():  # in slices, so that Ctrl-C ends it (see _interrupt)
            concurrent.futures.wait([drained], _interrupt.SLICE)
        drained.result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


_owned: _OwnedLoop | None = None
_owned_lock = threading.Lock()


def _owned_loop() -> _OwnedLoop:
    global _owned
    with _owned_lock:
        if _owned is None:
            _owned = _OwnedLoop()
        return _owned


def owned_loop() -> asyncio.AbstractEventLoop:
    """The event loop aiopar runs on its own thread, started on first use."""
    return _owned_loop().loop


def owned_loop_running() -> list[str]:
    """Names of the coroutine forks still running on aiopar's own loop."""
    owned = _owned
    return [] if owned is None else [fork.name for fork in owned.running()]


def on_owned_loop() -> bool:
    """Whether the calling thread is the one aiopar's own loop runs on."""
    owned = _owned
    return owned is not None and owned.thread is threading.current_thread()


def finish_owned_loop(*, cancel_pending: bool = False) -> None:
    """Run the coroutine forks on aiopar's own loop to their end (at exit)."""
    owned = _owned
    if owned is not None and owned.thread.is_alive():
        owned.finish(cancel_pending=cancel_pending)


def close_owned_loop() -> None:
    global _owned
    with _owned_lock:
        owned, _owned = _owned, None
    if owned is not None:
        owned.close()


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
    cancelling it before then means the coroutine never runs. Whatever
    happens to the loop, ``fut`` settles: cancelled if the coroutine never
    started, failed with CancelledError if it stopped before its end.
    """
    profiler = _trace.active
    record = None if profiler is None else profiler.on_fork_coroutine(fn)
    run = settling_run(fut, fn, args, kwargs, record)
    library = running_async_library()
    if library == "asyncio":
        loop = asyncio.get_running_loop()
        fut._task = fork = CoroutineFork(fut, fn, loop, threading.get_ident())
        start_on_asyncio(fork, loop, run, context)
    elif library == "trio":
        import trio

        fut._task = CoroutineFork(fut, fn, None, threading.get_ident())
        trio.lowlevel.spawn_system_task(run, context=context)
    else:
        owned = _owned_loop()
        assert owned.thread.ident is not None  # started
        fut._task = fork = CoroutineFork(fut, fn, owned.loop, owned.thread.ident)
        owned.loop.call_soon_threadsafe(start_on_asyncio, fork, owned.loop, run, context)


def _after_fork_in_child() -> None:
    # The owned loop's thread is gone in a child: it starts afresh when next used.
    global _owned
    _owned = None


os.register_at_fork(after_in_child=_after_fork_in_child)
