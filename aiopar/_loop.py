"""The bridge from worker threads to event loops.

Completions reach a loop in batches: the first completion posted to an idle
bridge schedules one thread-safe wake-up, and every completion that arrives
before the loop runs it rides along. On Linux, asyncio and uvloop loops are
woken through an eventfd they watch. Coroutines forked outside any running
loop run on a loop thread owned by aiopar (uvloop when it is installed).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import os
import sys
import threading
import weakref
from collections.abc import Callable, Generator
from typing import Any

import sniffio

from . import _interrupt, _trace, _waiter
from ._errors import CancelledError

__all__ = [
    "close_owned_loop",
    "finish_owned_loop",
    "owned_loop",
    "owned_loop_running",
    "running_async_library",
    "start_coroutine",
    "wait_on_loop",
]

_get_running_loop = asyncio._get_running_loop
_sniffio_thread = sniffio.thread_local


class _Bridge:
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
    def awaiting(self, owner: _waiter.Waiter | None) -> _waiter.Waiter | None:
        """An await starts on this loop; ``owner`` is the loop thread's waiter.
        Returns the owner to hand to :meth:`awaited`, or None if none is told."""
        if owner is None:
            return None
        self._awaiting += 1  # only the loop's own thread counts
        if self._awaiting == 1:
            owner.blocked()
            owner.blocked_long()  # nothing computes here meanwhile
        return owner

    def awaited(self, owner: _waiter.Waiter) -> None:
        self._awaiting -= 1
        if self._awaiting == 0:
            owner.resumed()

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
    # an awaiting future of that loop. Not at exit: a loop that still runs
    # then (aiopar's own, finishing its forks) is still woken through it.
    weakref.finalize(loop, os.close, fd).atexit = False
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
    if _get_running_loop() is not None:
        return "asyncio"
    return _sniffio_thread.name  # trio sets it while its loop runs here


def on_event_loop() -> bool:
    """Whether an asyncio, uvloop or trio loop runs in this thread."""
    # running_async_library() inlined: this runs once per fork.
    return _get_running_loop() is not None or _sniffio_thread.name is not None


def wait_on_loop(fut: Any, *, cancel: bool = True) -> Generator[Any, None, None]:
    """Suspend the running coroutine until ``fut`` is done.

    If the coroutine is cancelled meanwhile and ``cancel`` is true, ``fut`` is
    cancelled too, which succeeds only if its task has not started.
    """
    loop = _get_running_loop()
    if loop is not None:
        waiter = loop.create_future()

        def wake() -> None:
            if not waiter.done():
                waiter.set_result(None)

        bridge = _bridge(loop, _asyncio_bridge)
        fut._add_callback(lambda _: bridge.post(wake))
        owner = bridge.awaiting(_waiter.get_waiter())
        try:
            yield from waiter
        except asyncio.CancelledError:
            if cancel:
                fut.cancel()
            raise
        finally:
            if owner is not None:
                bridge.awaited(owner)
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
        except (ImportError, RuntimeError):  # not installed; too late to import at exit
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="aiopar-loop", daemon=True
        )
        self.thread.start()

    def running(self) -> list[_CoroutineFork]:
        """The coroutine forks on this loop that have not finished."""
        return list(_forks_of(self.loop).values())

    def finish(self, *, cancel_pending: bool) -> None:
        """Return once every coroutine fork on the loop has finished; with
        ``cancel_pending``, those that have not started never do."""

        async def drain() -> None:
            while forks := _forks_of(self.loop):
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


def owned_loop() -> asyncio.AbstractEventLoop:
    """The event loop aiopar runs on its own thread, started on first use."""
    global _owned
    with _owned_lock:
        if _owned is None:
            _owned = _OwnedLoop()
        return _owned.loop


def owned_loop_running() -> list[str]:
    """Names of the coroutine forks still running on aiopar's own loop."""
    owned = _owned
    return [] if owned is None else [fork.name for fork in owned.running()]


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


# Event loops keep only weak references to tasks, so each loop keeps its
# coroutine forks alive until they finish: in a set stored on the loop, not
# in one of ours, so a loop dropped unfinished takes them along, and each
# then settles its future (see _CoroutineFork).
_FORKS_ATTRIBUTE = "_aiopar_coroutine_forks"


def _forks_of(loop: Any) -> dict[asyncio.Task[Any], _CoroutineFork]:
    forks = getattr(loop, _FORKS_ATTRIBUTE, None)
    if forks is None:
        forks = {}
        setattr(loop, _FORKS_ATTRIBUTE, forks)
    return forks


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(exc, trio.Cancelled)


class _CoroutineFork:
    """What a coroutine fork's future knows of its run: where it runs, so a
    blocking wait that could never end fails at once, and a run that ends
    any other way than by finishing still settles the future."""

    __slots__ = ("__weakref__", "future", "loop", "name", "thread_id")

    stealable = False
    record = None  # the profiler's record (coroutine forks have none)

    def __init__(self, fut: Any, fn: Callable[..., Any], loop: Any, thread_id: int) -> None:
        self.future = fut
        self.name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        # Weakly: a future must not keep a dropped loop alive.
        self.loop = None if loop is None else weakref.ref(loop)
        self.thread_id = thread_id  # of the loop, when it started the coroutine

    def runs_on_this_thread(self) -> bool:
        if self.loop is None:  # trio's
            return self.thread_id == threading.get_ident() and running_async_library() == "trio"
        loop = self.loop()
        if loop is None or loop.is_closed():
            self.abandoned("was closed before it finished")
            return False
        return _get_running_loop() is loop

    def abandoned(self, what_happened: str) -> None:
        """The loop will never run the coroutine to its end: settle the future."""
        fut = self.future
        if fut is None or fut.done():
            return
        if not fut.cancel():  # it had started
            fut._settle(
                None, CancelledError(f"the event loop running this coroutine {what_happened}")
            )


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

    async def run() -> None:
        nonlocal fut
        try:
            if not fut._claim():
                return
            try:
                if record is None:
                    result = await fn(*args, **kwargs)
                else:
                    result = await record.run_in_steps(fn, args, kwargs)
            except BaseException as exc:
                if not _is_cancellation(exc) and not isinstance(exc, GeneratorExit):
                    fut._settle(None, exc)
                    return
                closed = isinstance(exc, GeneratorExit)
                what = "was closed before it finished" if closed else "cancelled it"
                error = CancelledError(f"the event loop running this coroutine {what}")
                error.__cause__ = exc
                fut._settle(None, error)
                raise  # a task must not swallow its own cancellation
            fut._settle(result, None)
        finally:
            fut = None  # a failure's traceback holds this frame: no cycle (see Future)

    library = running_async_library()
    if library == "asyncio":
        loop = asyncio.get_running_loop()
        fut._task = fork = _CoroutineFork(fut, fn, loop, threading.get_ident())
        _start_asyncio(fork, loop, run, context)
    elif library == "trio":
        import trio

        fut._task = _CoroutineFork(fut, fn, None, threading.get_ident())
        trio.lowlevel.spawn_system_task(run, context=context)
    else:
        loop = owned_loop()
        owned = _owned
        assert owned is not None and owned.thread.ident is not None  # owned_loop() started it
        fut._task = fork = _CoroutineFork(fut, fn, loop, owned.thread.ident)
        loop.call_soon_threadsafe(_start_asyncio, fork, loop, run, context)


def _start_asyncio(
    fork: _CoroutineFork, loop: asyncio.AbstractEventLoop, run: Callable[[], Any], context: Any
) -> None:
    task = loop.create_task(run(), context=context)
    forks = _forks_of(loop)
    forks[task] = fork

    def done(task: asyncio.Task[Any]) -> None:
        del forks[task]
        fork.abandoned("cancelled it")  # before its first step: its body never ran
        fork.future._task = None

    task.add_done_callback(done)
    # Collected unfinished, with its loop dropped. Not at exit, which runs
    # the forks on aiopar's own loop to their end.
    weakref.finalize(task, fork.abandoned, "was closed before it finished").atexit = False


def _after_fork_in_child() -> None:
    # The owned loop's thread is gone in a child, and a bridge's eventfd
    # would wake the parent's loop: both start afresh when next used.
    global _owned, _bridges
    _owned = None
    _bridges = weakref.WeakKeyDictionary()


os.register_at_fork(after_in_child=_after_fork_in_child)
