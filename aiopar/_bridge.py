"""The bridge from worker threads to event loops, and awaiting a future on one.

Completions reach a loop in batches: the first completion posted to an idle
bridge schedules one thread-safe wake-up, and every completion that arrives
before the loop runs it rides along. On Linux, asyncio and uvloop loops are
woken through an eventfd they watch, and an await resumes its task as the
batch runs (see :class:`_Resumer`).

A pool's worker that completes an await as it settles its own task holds
that wake-up until the task's run is over (or anyone else's callback is to
run): see :func:`hold_wakes`.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import weakref
from collections.abc import Callable, Generator
from contextvars import Context, copy_context
from typing import Any

import sniffio

from . import _waiter

__all__ = [
    "Bridge",
    "asyncio_bridge",
    "hold_wakes",
    "running_async_library",
    "send_wakes",
    "wait_on_loop",
]

_get_running_loop = asyncio._get_running_loop
_sniffio_thread = sniffio.thread_local


class Bridge:
    """Runs callables on one event loop's thread, one wake-up per batch.

    ``wake``, set by the function that makes the bridge, must make the loop
    call :meth:`drain` soon; any thread may call it, and it raises nothing
    (a closed loop has nobody left to wake). ``fd``, if not -1, is
    the eventfd ``wake`` writes to, which :meth:`drain` reads back.
    """

    __slots__ = ("_awaiting", "_batch", "_lock", "fd", "wake")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._batch: list[Callable[[], None]] = []
        self._awaiting = 0  # aiopar futures awaited on this loop (only in a pool's thread)
        self.wake: Callable[[], Any]
        self.fd = -1

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

    def post(self, fn: Callable[[], None], done: object = None) -> None:
        """Have the loop call ``fn()`` soon. ``done``: the future whose
        done-callback this post is (``functools.partial(bridge.post, fn)``
        is one, with no Python function between the future and the post);
        if it is the future of the task whose wake-ups the calling thread
        holds (see :func:`hold_wakes`), the loop is woken once the thread
        sends them."""
        with self._lock:
            self._batch.append(fn)
            if len(self._batch) > 1:
                return  # a wake-up is already on its way and will run fn too
        if done is not None:
            state = _waiter.local.__dict__
            if id(done) == state.get("finishing"):
                state["wakes"].append(self.wake)
                return
        self.wake()

    def drain(self) -> None:
        """Run the batch posted so far (on the loop's thread)."""
        if self.fd != -1:  # the loop calls drain as the eventfd's reader
            try:  # noqa: SIM105 - once per wake-up: a try costs nothing, suppress() three calls
                os.eventfd_read(self.fd)
            except BlockingIOError:  # a late write already drained it
                pass
        with self._lock:
            batch, self._batch = self._batch, []
        todo = iter(batch)
        try:
            for fn in todo:
                fn()
        except BaseException:
            # A task resumed here re-raises a KeyboardInterrupt or SystemExit
            # out of its step, as out of the loop's own pass: what is left of
            # the batch runs on the loop's next pass.
            rest = list(todo)
            if rest:
                with self._lock:
                    self._batch[:0] = rest
                self.wake()
            raise


def hold_wakes() -> tuple[dict[str, Any], list[Callable[[], Any]]]:
    """Make the calling thread, a pool's worker, hold the wake-ups it owes
    event loops as it settles its own task; return the thread's state and
    the list they wait in.

    Before each task it runs, the worker sets ``state["finishing"]`` to the
    id of the task's future (an id, not the future: an idle thread keeps no
    task's result alive; a later future given the same id has its wake-up
    held at most as long): an await of that future completed by its
    settling wakes its loop when the worker calls :func:`send_wakes`, which
    it must do once the task's run is over, before its next task, before it
    blocks or stops; ``finishing`` is set to ``None`` before it sleeps.
    Before any other callback runs in this thread, the wake-ups go
    (``_callbacks.run_each``), so no code but aiopar's runs while one waits.

    Why: the write that wakes a loop lets the GIL go, and the loop may take
    it at once and fork again. Sent from inside the settling, it found the
    worker still busy with the rest of its task, and a second worker was
    woken; held to the end of the run, the worker first counts itself as
    on its way to the queues (as a worker just woken is), and a fork the
    loop makes before the worker sleeps wakes nobody: the worker takes it.
    """
    state = _waiter.local.__dict__
    wakes: list[Callable[[], Any]] = state.setdefault("wakes", [])
    state["finishing"] = None
    return state, wakes


def send_wakes(wakes: list[Callable[[], Any]]) -> None:
    """Wake the loops whose wake-ups this thread held (see :func:`hold_wakes`)."""
    while wakes:
        wakes.pop()()


# By a weak reference to their loop (or trio token): a bridge must not keep
# its loop alive, and goes with it. A plain dict, not a WeakKeyDictionary,
# whose get() is a Python call more on every await: a lookup makes a
# reference (which compares equal to the key while the loop lives) and
# gets it, both in C.
_bridges: dict[weakref.ref[Any], Bridge] = {}
_bridges_lock = threading.Lock()
_ref = weakref.ref


def _bridge(key: Any, new_bridge: Callable[[Any], Bridge]) -> Bridge:
    """The bridge to ``key``, made with ``new_bridge(key)`` on first use."""
    bridge = _bridges.get(_ref(key))
    if bridge is None:
        with _bridges_lock:
            bridge = _bridges.get(_ref(key))
            if bridge is None:
                bridge = new_bridge(key)
                _bridges[_ref(key, _forget)] = bridge
    return bridge


def _forget(gone: weakref.ref[Any]) -> None:
    # Its loop has gone. A reference to a dead object equals only itself:
    # ``gone`` is the dict's own key.
    _bridges.pop(gone, None)


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

    try:
        loop.add_reader(fd, bridge.drain)
    except NotImplementedError:  # the proactor loop watches no fds
        os.close(fd)
        return _call_soon_bridge(bridge, loop, "call_soon_threadsafe")
    bridge.fd = fd
    bridge.wake = functools.partial(os.eventfd_write, fd, 1)
    # Nothing can post once the loop is gone: every posted callable holds
    # an awaiting future of that loop. Not at exit: a loop that still runs
    # then (aiopar's own, finishing its forks) is still woken through it.
    weakref.finalize(loop, os.close, fd).atexit = False
    return bridge


#: ``asyncio_bridge(loop)``: the bridge to ``loop`` (made on first use, on
#: the loop's own thread: making one registers a reader with the loop). A
#: partial, not a function: once per await, it adds no Python call to
#: :func:`_bridge`'s.
asyncio_bridge: Callable[[asyncio.AbstractEventLoop], Bridge] = functools.partial(
    _bridge, new_bridge=_new_asyncio_bridge
)


def _call_soon_bridge(bridge: Bridge, loop: Any, method: str) -> Bridge:
    loop_ref = weakref.ref(loop)

    def wake() -> None:
        loop = loop_ref()
        if loop is not None:
            try:  # noqa: SIM105 - once per wake-up: a try costs nothing, suppress() three calls
                getattr(loop, method)(bridge.drain)
            except RuntimeError:  # a closed loop has nobody left to wake
                pass

    bridge.wake = wake
    return bridge


def _new_trio_bridge(token: Any) -> Bridge:
    return _call_soon_bridge(Bridge(), token, "run_sync_soon")


class _Resumer:
    """What an await of an aiopar future on asyncio (or uvloop) yields to the
    task that runs it, in place of an asyncio future: the calls a task makes
    on what its coroutine yields (``get_loop``, ``add_done_callback``, then
    ``result`` as it resumes, ``cancel`` if it is cancelled meanwhile).

    The bridge calls :meth:`resume` as it drains, which resumes the task
    there and then. An asyncio future set there would schedule the task's
    step for the loop's next pass: a second pass per await, with its
    ``select``, which cost a sequential ``await fork(f)`` a tenth of its
    instructions.
    """

    __slots__ = ("_asyncio_future_blocking", "_callbacks", "_cancel_message", "_cancelled", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._asyncio_future_blocking = True  # what tells a task to wait for it
        # (callback, context) pairs until it is done; a task adds one.
        self._callbacks: list[tuple[Callable[[Any], object], Context]] | None = []
        self._cancelled = False
        self._cancel_message: Any = None

    def __repr__(self) -> str:
        if self._callbacks is not None:
            return "<aiopar await pending>"
        return f"<aiopar await {'cancelled' if self._cancelled else 'done'}>"

    def get_loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def done(self) -> bool:
        return self._callbacks is None

    def cancelled(self) -> bool:
        return self._cancelled

    def add_done_callback(
        self, fn: Callable[[Any], object], *, context: Context | None = None
    ) -> None:
        if context is None:
            context = copy_context()
        if self._callbacks is None:
            self._loop.call_soon(fn, self, context=context)
        else:
            self._callbacks.append((fn, context))

    def result(self) -> None:
        """Nothing, or CancelledError if it was cancelled: a new one each
        time, as asyncio's futures raise it (kept here, its traceback would
        keep the awaiting frames, and the future they awaited, alive)."""
        if self._cancelled:
            message = self._cancel_message
            raise asyncio.CancelledError() if message is None else asyncio.CancelledError(message)

    def cancel(self, msg: Any = None) -> bool:
        """The task was cancelled: it resumes on the loop's next pass, and
        its coroutine gets CancelledError where it awaited."""
        callbacks = self._callbacks
        if callbacks is None:
            return False
        self._callbacks = None
        self._cancelled, self._cancel_message = True, msg
        for fn, context in callbacks:
            self._loop.call_soon(fn, self, context=context)
        return True

    def resume(self) -> None:
        """On the loop's thread, as the bridge drains: resume the task now,
        in its own context, unless it was cancelled meanwhile."""
        callbacks = self._callbacks
        if callbacks is None:
            return
        self._callbacks = None
        for fn, context in callbacks:
            context.run(fn, self)


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
        resumer = _Resumer(loop)
        bridge = asyncio_bridge(loop)
        subscribe(functools.partial(bridge.post, resumer.resume))
        owner = _waiter.get_waiter()
        if owner is not None:
            bridge.awaiting(owner)
        try:
            yield resumer
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
    subscribe(functools.partial(bridge.post, wake))
    await trio.lowlevel.wait_task_rescheduled(abort)


def _after_fork_in_child() -> None:
    # A bridge's eventfd would wake the parent's loop: bridges start afresh.
    global _bridges
    _bridges = {}


os.register_at_fork(after_in_child=_after_fork_in_child)
