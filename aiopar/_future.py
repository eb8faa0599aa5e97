"""The one Future type: block on it, await it, or chain callbacks on it.

A future moves PENDING -> RUNNING -> FINISHED, or PENDING ->
CANCELLED_AND_NOTIFIED; a future a user creates with ``Future()`` stays
PENDING until it is settled. Done means any state but PENDING and RUNNING,
and a done future never changes again. The states are concurrent.futures'
own names, which its ``wait()`` and ``as_completed()`` read in ``_state``: a
cancelled aiopar future tells every waiter at once, so it is what the
standard library calls cancelled and notified. (CANCELLED alone, a
standard future cancelled before its executor notified the waiters, is
never set here; a future put in it by hand behaves as a standard one.)

A failed future holds its exception, whose traceback holds every frame the
exception passed through and, through ``f_back``, every frame above them,
with the locals each had when it returned. A frame of aiopar's among them
that still held the future (or the exception) would make a reference cycle,
which keeps the failed call's locals (arrays, shared memory) until the
garbage collector runs: such frames drop those names before they return,
as CPython's ``concurrent.futures`` does (bpo-35930, gh-95169).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import threading
from asyncio import _get_running_loop
from collections.abc import Callable, Generator
from concurrent.futures._base import (
    CANCELLED,
    CANCELLED_AND_NOTIFIED,
    FINISHED,
    PENDING,
    RUNNING,
)
from typing import Any, Generic, TypeVar

from ._blocking import block, cf_timeout, check_timeout, help_first
from ._bridge import wait_on_loop
from ._callbacks import drain_deferred, run_callbacks, run_each
from ._errors import CancelledError, InvalidStateError
from ._interop import LoopCallback, adapt_callback, describe_type
from ._unretrieved import Unretrieved

__all__ = [
    "FailureWatch",
    "Future",
    "add_callback",
    "block_until_done",
    "cancel_claimed",
    "claim",
    "copy_outcome",
    "failed",
    "first_failed",
    "renew_lock",
    "retrieve",
    "settle",
    "until_done",
    "values",
]

T = TypeVar("T")
U = TypeVar("U")

# The states of a future that is not done. A test against it costs no Python
# call, where done() would, on the blocking path whose calls
# tests/test_overhead.py counts. A frozenset, not a tuple: the states are
# strings, and a tuple compares a done state with each of them by value.
_WAITING = frozenset((PENDING, RUNNING))
_CANCELLED = frozenset((CANCELLED, CANCELLED_AND_NOTIFIED))

# The FailureWatch objects of threads blocked in wait_all: a future that
# fails or is cancelled tells them; one that succeeds costs nothing here.
_watches: list[FailureWatch] = []

_DESCRIPTIONS = {
    PENDING: "pending",
    RUNNING: "running",
    CANCELLED: "cancelled",
    CANCELLED_AND_NOTIFIED: "cancelled",
    FINISHED: "finished",
}


class Future(Generic[T], concurrent.futures.Future[T]):
    """The result of a forked task, or a value a user settles by hand.

    Thread-safe: any thread may wait on, settle, cancel or add callbacks to
    it. ``await fut`` works on asyncio, uvloop and trio; ``wait()`` blocks the
    calling thread; ``then()`` chains work the way ``torch.futures.Future``
    does.
    """

    __slots__ = (
        "_callbacks",
        "_exception",
        "_lock",
        "_result",
        "_state",
        "_task",
        "_unretrieved",
        "_waiters",
    )

    # The names concurrent.futures.wait() and as_completed() read (see
    # CfCondition), with aiopar's own types rather than the base class's.
    _waiters: list[Any] | None  # type: ignore[assignment]

    def __init__(self) -> None:
        self._state = PENDING
        self._result: Any = None
        self._exception: BaseException | None = None
        self._callbacks: list[Callable[[Future[T]], object]] | None = None
        self._waiters = None
        self._lock = threading.Lock()
        self._task: Any = None  # the forked task behind this future, if any
        # Set while a failure nobody has read yet would be logged when the
        # future is collected; a future that succeeds gets one only if it
        # was abandoned first (see _abandon).
        self._unretrieved: Unretrieved | None = None

    def __repr__(self) -> str:
        state = self._state
        if state is FINISHED:
            if self._exception is not None:
                detail = f" raised {type(self._exception).__name__}"
            else:
                detail = f" returned {type(self._result).__name__}"
        else:
            detail = ""
        # "aiopar.Future": next to concurrent.futures' and asyncio's own in messages
        return f"<aiopar.{type(self).__name__} at {id(self):#x} {_DESCRIPTIONS[state]}{detail}>"

    def __reduce__(self) -> Any:
        # A future lives in one process: its waiters and callbacks cannot travel.
        raise TypeError(
            f"an aiopar.{type(self).__name__} cannot be pickled; send its value "
            f"(fut.wait()) or, across rpc peers, an RRef (rpc.remote)"
        )

    # -- state -------------------------------------------------------------

    def done(self) -> bool:
        """True once the future has a value, an exception, or was cancelled."""
        state = self._state
        return state is not PENDING and state is not RUNNING

    def cancelled(self) -> bool:
        """True if the future was cancelled."""
        state = self._state
        return state is CANCELLED_AND_NOTIFIED or state is CANCELLED

    def running(self) -> bool:
        """True while its task runs (a future's task runs at most once)."""
        return self._state is RUNNING

    def cancel(self) -> bool:
        """Cancel the future unless its task has started.

        Returns True if the future is now cancelled (its task will never
        run), False if the task is running or the future is already settled.
        A running task is never interrupted, but a cancel that comes too
        late still says its outcome is not wanted: if the task fails and
        nobody reads the failure, that is logged at DEBUG, not as an error
        (a cancelled ``await`` of the future cancels it so).
        """
        if self._cancel_from(PENDING):
            return True
        self._abandon()
        return self.cancelled()

    def _cancel_claimed(self) -> bool:
        """Cancel a future whose task was claimed but never started (a
        process task sent ahead to a worker that was stopped before it got
        to it), which :meth:`cancel` refuses as running; False if the
        future is not running. Only the code that claimed it knows."""
        return self._cancel_from(RUNNING)

    def _cancel_from(self, state: str) -> bool:
        """``state`` -> cancelled, waiters and callbacks told; False if the
        future is in another state."""
        with self._lock:
            if self._state is not state:
                return False
            self._state = CANCELLED_AND_NOTIFIED
            self._task = None  # it will never run: let it go
            waiters, callbacks = self._waiters, self._callbacks
            self._waiters = self._callbacks = None
        if waiters or callbacks:
            _notify(self, waiters, callbacks)
        if _watches:
            _tell_watches(self)
        return True

    def _abandon(self) -> None:
        """Whoever waited for this future gave up on it (a cancelled
        ``await``, a wait ended by Ctrl-C, a late :meth:`cancel`): a failure
        nobody reads is logged at DEBUG, not as an error."""
        with self._lock:
            report = self._unretrieved
            if report is None:
                if self._state not in _WAITING:
                    return  # it succeeded, was cancelled, or its failure was read
                # Made now, filled in by _settle if the future fails.
                report = self._unretrieved = Unretrieved(self, None)
            report.abandon()

    # -- settling ----------------------------------------------------------

    def set_result(self, result: T) -> None:
        """Settle a future made with ``Future()`` with a value.

        Raises InvalidStateError if it is done already (a future is settled
        once) or if it is the future of a forked task, which its task settles.
        """
        self._settle_by_hand(result, None, "set_result")

    def set_exception(self, exception: BaseException) -> None:  # type: ignore[override] # None is refused
        """Settle a future made with ``Future()`` with an exception (a class
        is instantiated); raises InvalidStateError as :meth:`set_result` does."""
        if isinstance(exception, type) and issubclass(exception, BaseException):
            exception = exception()
        if not isinstance(exception, BaseException):
            raise TypeError(
                f"set_exception() takes an exception instance, got {type(exception).__name__}"
            )
        self._settle_by_hand(None, exception, "set_exception")

    def _settle_by_hand(self, result: Any, exception: BaseException | None, method: str) -> None:
        # A forked task's future stays open to its task only: settled from
        # outside, the task's own outcome would be dropped, or the task
        # would never run (its claim fails) while its waiters had a value.
        task = self._task
        if task is not None:
            raise InvalidStateError(
                f"{method}() on {self!r}, the future of the forked task {task.name}(): "
                f"only its task settles it. {method}() is for a Future() you made yourself; "
                f"to stop the task, cancel() it (it never runs if it has not started), and "
                f"to pass on another outcome, settle a Future() of your own or chain one "
                f"with then()"
            )
        if not self._settle(result, exception):
            raise InvalidStateError(f"{self!r} is already done; a future is settled only once")

    def _claim(self) -> bool:
        """PENDING -> RUNNING; False if the task was cancelled or claimed already."""
        # Not "with": once per task, a with statement costs as much again as
        # the lock itself (about 50 ns on CPython 3.11). A Ctrl-C raised as
        # acquire() returns leaves this one future's lock held, and the
        # future with it (a Ctrl-C after the lock is let go strands its
        # waiters as surely); the lock every fork and exit need, the pool's,
        # is taken with "with" (backends/thread.py).
        lock = self._lock
        lock.acquire()
        try:
            if self._state is not PENDING:
                return False
            self._state = RUNNING
            return True
        finally:
            lock.release()

    def _settle(self, result: Any, exception: BaseException | None) -> bool:
        """FINISHED with this outcome; False if the future was done already."""
        lock = self._lock
        lock.acquire()  # see _claim
        try:
            state = self._state
            if state is not PENDING and state is not RUNNING:
                return False
            # A done future keeps no task: no cycle that only the garbage
            # collector breaks holds on to its result.
            self._task = None
            if exception is None:
                self._result = result
            else:
                # The traceback it was raised with: every re-raise starts from
                # it, so waiting often on a failed future grows nothing.
                self._result = exception.__traceback__
                self._exception = exception
                report = self._unretrieved
                if report is None:
                    self._unretrieved = Unretrieved(self, exception)
                else:  # made when the future was abandoned (see _abandon)
                    report.exception = exception
            self._state = FINISHED
            waiters, callbacks = self._waiters, self._callbacks
            self._waiters = self._callbacks = None
        finally:
            lock.release()
        if waiters or callbacks:
            _notify(self, waiters, callbacks)
        if exception is not None and _watches:
            _tell_watches(self)
        return True

    # -- reading -----------------------------------------------------------

    def value(self) -> T:
        """The value, without waiting.

        Raises the task's exception if it failed, CancelledError if it was
        cancelled, and InvalidStateError (a RuntimeError) if it is not done.
        """
        state = self._state
        if state is FINISHED:
            exception = self._exception
            if exception is not None:
                self._retrieve()
                try:
                    raise exception.with_traceback(self._result)
                finally:
                    del self, exception  # no cycle: see the module's docstring
            return self._result  # type: ignore[no-any-return]
        if state is not PENDING and state is not RUNNING:
            raise CancelledError(f"{self!r} was cancelled before its task started")
        raise InvalidStateError(f"{self!r} is not done; call wait() or await it to get its value")

    def wait(self, timeout: float | None = None) -> T:
        """Block until the future is done and return its value or raise its exception.

        Without a timeout, if the future's task has not started (on a
        backend that runs tasks in this process), the calling thread runs
        it itself: waiting never starves a pool, and ``wait(fork(f))``
        costs about a call of ``f``. A timeout bounds the whole call: the
        task is left to its pool, and TimeoutError is raised once
        ``timeout`` seconds pass (``wait(timeout=0)`` only looks). One
        exception keeps nested forks from starving a pool: a pool's worker
        first runs the tasks it forked that are still queued, with or
        without a timeout, newest first, the awaited one among them.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        # The state first: a done future's value is a call away (map and
        # as_completed read thousands), not a pass through the blocking path.
        if self._state in _WAITING and not self._block(timeout):
            raise TimeoutError(f"{self!r} is still not done after waiting {timeout} s")
        try:
            return self.value()
        finally:
            del self  # no cycle: see the module's docstring

    def result(self, timeout: float | None = None) -> T:
        """:meth:`wait` as :mod:`concurrent.futures` spells it, with its timeouts.

        ``None`` waits for ever; a timeout of 0 or less does not wait at all,
        so a future that is not done raises TimeoutError at once
        (``Executor.map`` passes negative timeouts once its deadline passes).
        """
        try:
            return self.wait(None if timeout is None else cf_timeout(timeout))
        finally:
            del self  # no cycle: see the module's docstring

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Block until done; return the task's exception, or None if it succeeded.

        Raises CancelledError if the future was cancelled, TimeoutError if
        ``timeout`` seconds pass first; timeouts as for :meth:`result`.
        """
        if not self._block(cf_timeout(timeout)):
            raise TimeoutError(f"{self!r} is still not done after waiting {timeout} s")
        if self._state is not FINISHED:
            raise CancelledError(f"{self!r} was cancelled before its task started")
        return self._retrieve()

    def _retrieve(self) -> BaseException | None:
        """The exception, which now counts as seen: it is not logged at collection."""
        unretrieved = self._unretrieved
        if unretrieved is not None:
            self._unretrieved = None
            unretrieved.exception = None
        return self._exception

    def _block(self, timeout: float | None) -> bool:
        """Wait until done or ``timeout`` passes; True if done.

        The calling thread first runs the work it can (see
        :func:`aiopar._blocking.help_first`), then blocks.
        """
        if self._state not in _WAITING:
            return True
        task = self._task
        help_first(self, task, timeout)
        if self._state not in _WAITING:
            del self  # the task may have failed below this frame: no cycle (module docstring)
            return True
        return self._sleep(timeout, task)

    def _sleep(self, timeout: float | None, task: Any, watch: FailureWatch | None = None) -> bool:
        """Block this thread until the future is done or ``timeout`` passes
        (``task``, the future's, is the profiler's), or, with ``watch``,
        until one of the futures it watches fails; True if done."""
        if task is not None and task.runs_on_this_thread():
            raise RuntimeError(
                f"{self!r} is a coroutine fork that runs on this thread's event loop, which "
                f"wait() would block for ever; use 'await fut' inside the loop instead"
            )
        drain_deferred()  # they may be what settles this future
        if self._state not in _WAITING:
            return True
        waiter = threading.Lock()
        waiter.acquire()
        with self._lock:
            if self._state not in _WAITING:
                return True
            if self._waiters is None:
                self._waiters = [waiter]
            else:
                self._waiters.append(waiter)
        released = False
        try:
            if watch is None or watch.sleeps(self, waiter):
                released = block(waiter, timeout, task)
        except KeyboardInterrupt:
            self._abandon()  # Ctrl-C ended the wait: as a cancelled await, it gave up
            raise
        finally:
            if watch is not None:
                watch.woke()
            if not released:  # timed out, interrupted (Ctrl-C), or a watched future failed
                self._forget_waiter(waiter)
        return self._state not in _WAITING

    def _forget_waiter(self, waiter: threading.Lock) -> bool:
        """Take ``waiter`` off this future's list; False if settling took it already."""
        with self._lock:
            if self._waiters is not None and waiter in self._waiters:
                self._waiters.remove(waiter)
                return True
            return False

    # -- callbacks ---------------------------------------------------------

    def add_done_callback(
        self,
        fn: Callable[[Future[T]], object],
        *,
        context: contextvars.Context | None = None,
    ) -> None:
        """Call ``fn(self)`` once the future is done.

        It runs in the thread that settles the future, or at once in this
        thread if the future is done already. An exception it raises is
        logged on the ``aiopar`` logger and otherwise ignored. With
        ``context`` (asyncio's keyword), it runs in that
        :class:`contextvars.Context`. A callback that asyncio's own code adds
        on an event loop's thread (``asyncio.wait`` does) runs on that loop,
        as asyncio runs its callbacks, and the loop's exception handler gets
        what it raises.
        """
        if not callable(fn):
            raise TypeError(f"add_done_callback() takes a callable, got {type(fn).__name__}")
        if context is not None or _get_running_loop() is not None:
            fn = adapt_callback(fn, context)
        self._add_callback(fn)

    def _add_callback(self, fn: Callable[[Future[T]], object]) -> None:
        """add_done_callback for aiopar's own callbacks, which need no checks."""
        with self._lock:
            if (state := self._state) is PENDING or state is RUNNING:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        run_each(self, (fn,))

    def then(self, callback: Callable[[Future[T]], U]) -> Future[U]:
        """Return a future settled by ``callback(self)`` once this one is done.

        The callback's return value becomes the new future's value; an
        exception it raises becomes the new future's exception and goes
        nowhere else. Chains of any length settle without recursion.
        """
        if not callable(callback):
            raise TypeError(f"then() takes a callable, got {type(callback).__name__}")
        chained: Future[U] = Future()
        try:
            self._add_callback(_Chain(callback, chained))
            return chained
        finally:
            del chained  # the callback may have failed in this frame: no cycle (module docstring)

    # -- interop: asyncio and concurrent.futures code --------------------
    #
    # Future derives from concurrent.futures.Future so that isinstance
    # checks pass (asyncio.wrap_future, run_in_executor-style code). It
    # overrides every public method and never runs that class's __init__,
    # whose condition and lists a future needs only when
    # concurrent.futures.wait() or as_completed() meets it (see CfCondition).
    # The base brings an instance __dict__, never used, that costs each
    # future about 32 bytes, in one more small allocation on CPython 3.11
    # (about 7 ns).

    def remove_done_callback(self, fn: Callable[[Future[T]], object]) -> int:
        """Remove every pending callback equal to ``fn``; return how many were removed.

        asyncio's spelling. A callback that has already run, or is on its
        way to run, is not recalled.
        """
        with self._lock:
            callbacks = list(self._callbacks or ())
        # Compared outside the lock: a callback's __eq__ may call back into
        # this future (bpo-28963, gh-97592), and the lock is not reentrant.
        equal = {
            id(cb) for cb in callbacks if cb == fn or (type(cb) is LoopCallback and cb.fn == fn)
        }
        if not equal:
            return 0
        with self._lock:
            pending = self._callbacks or []
            kept = [cb for cb in pending if id(cb) not in equal]
            self._callbacks = kept or None
        return len(pending) - len(kept)

    def set_running_or_notify_cancel(self) -> bool:
        """The :mod:`concurrent.futures` executor's claim on a future it will run.

        Returns True and marks the future running if it is pending, False if
        it was cancelled (its waiters have been told, now if not before).
        Raises InvalidStateError if it is already running or done.
        """
        with self._lock:
            state = self._state
            if state is PENDING:
                self._state = RUNNING
                return True
            if state is CANCELLED:  # set by hand: see the module's docstring
                self._state = CANCELLED_AND_NOTIFIED
                waiters, self._waiters = self._waiters, None
            elif state is CANCELLED_AND_NOTIFIED:
                return False
            else:
                raise InvalidStateError(
                    f"{self!r} is already running or done; a future runs only once"
                )
        _notify(self, waiters, None)
        return False

    @property
    def _condition(self) -> CfCondition:  # type: ignore[override] # made on demand
        # What concurrent.futures.wait() and as_completed() lock.
        return CfCondition(self)

    # -- await -------------------------------------------------------------

    def __await__(self) -> Generator[Any, None, T]:
        if (state := self._state) is PENDING or state is RUNNING:
            # A cancelled await cancels the future, which stops its task if
            # it has not started.
            yield from wait_on_loop(self._add_callback, self.cancel)
        try:
            return self.value()
        except StopIteration as exc:
            # Python turns a StopIteration that leaves a coroutine into a
            # RuntimeError saying nothing (PEP 479): say what happened.
            raise RuntimeError(
                f"{self!r} failed with StopIteration, which 'await' cannot raise (PEP 479); "
                f"catch it inside the task, or call fut.wait() outside a coroutine to get it "
                f"as it is"
            ) from exc
        finally:
            del self  # no cycle: see the module's docstring

    def _until_done(self) -> _UntilDone:
        """An awaitable that waits for this future without raising its outcome."""
        return _UntilDone(self)


class _Chain(Generic[T, U]):
    """The done-callback of :meth:`Future.then`: settles ``chained`` with
    ``callback(fut)``, and lets go of it (no cycle: see the module docstring)."""

    __slots__ = ("callback", "chained")

    def __init__(self, callback: Callable[[Future[T]], U], chained: Future[U]) -> None:
        self.callback = callback
        self.chained = chained

    def __call__(self, fut: Future[T]) -> None:
        chained = self.chained
        del self.chained
        try:
            value = self.callback(fut)
        except BaseException as exc:
            chained._settle(None, exc)
        else:
            chained._settle(value, None)
        del chained


class _UntilDone:
    __slots__ = ("_fut",)

    def __init__(self, fut: Future[Any]) -> None:
        self._fut = fut

    def __await__(self) -> Generator[Any, None, None]:
        fut = self._fut
        if not fut.done():
            yield from wait_on_loop(fut._add_callback, fut._abandon)


def copy_outcome(source: Any, target: Future[Any]) -> None:
    """Settle ``target`` as ``source``, a done future of another kind, was
    settled (unless ``target`` is done already); what reading ``source``
    raises settles it too. Nothing is raised here, so no frame of aiopar's
    joins the traceback of ``source``'s exception."""
    try:
        if source.cancelled():
            target.cancel()
            return
        exception = source.exception()
        if exception is None:
            target._settle(source.result(), None)
        elif isinstance(exception, BaseException):
            target._settle(None, exception)
        else:
            raise TypeError(
                f"{describe_type(source)}.exception() returned {describe_type(exception)}, "
                f"not an exception or None, so aiopar.wrap() cannot read its outcome "
                f"(a dask Future of an asynchronous Client does that: await it on the "
                f"client's loop instead)"
            )
    except BaseException as error:
        target._settle(None, error)
        del source, target  # the error's traceback holds this frame: no cycle (see Future)


class FailureWatch:
    """Wakes a thread blocked on one of ``futures`` when another of them
    fails or is cancelled: wait_all's "raises as soon as one fails" without
    a callback on each future (a batch of forks that all succeed pays
    nothing for it). Active inside its ``with`` block."""

    __slots__ = ("_futures", "_lock", "_members", "_sleeping", "failed")

    def __init__(self, futures: list[Future[Any]]) -> None:
        self._futures = futures  # not changed while the watch is active
        # The set to look a failed future up in, made at the first failure
        # the watch hears of, so a batch that succeeds never hashes its futures.
        self._members: set[Future[Any]] | None = None
        self._lock = threading.Lock()
        self._sleeping: tuple[Future[Any], threading.Lock] | None = None
        self.failed = False

    def __enter__(self) -> FailureWatch:
        _watches.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _watches.remove(self)
        # A failure's traceback may hold the watcher's frame, and the frame
        # this watch: it keeps no future (see the module's docstring).
        self._futures, self._members = [], None

    def sleeps(self, fut: Future[Any], waiter: threading.Lock) -> bool:
        """The watching thread is about to block on ``waiter``, which ``fut``
        releases; False if a watched future has failed already."""
        with self._lock:
            if self.failed:
                return False
            self._sleeping = (fut, waiter)
            return True

    def woke(self) -> None:
        with self._lock:
            self._sleeping = None

    def saw_failure(self, fut: Future[Any]) -> None:
        """``fut`` failed or was cancelled: if it is watched, wake the watcher."""
        members = self._members
        if members is None:
            members = self._members = set(self._futures)
        if fut not in members:
            return
        with self._lock:
            self.failed = True
            sleeping, self._sleeping = self._sleeping, None
        # Released here only if its future's settling has not taken it: a
        # lock released twice would raise in the thread that settles.
        if sleeping is not None and sleeping[0]._forget_waiter(sleeping[1]):
            sleeping[1].release()


def _tell_watches(fut: Future[Any]) -> None:
    for watch in list(_watches):
        watch.saw_failure(fut)


def _notify(fut: Future[Any], waiters: list[Any] | None, callbacks: list[Any] | None) -> None:
    """Wake the threads blocked on a future that just became done, then run its callbacks."""
    if waiters:
        for waiter in waiters:
            waiter.release()
    if callbacks:
        run_callbacks(fut, callbacks)


# -- concurrent.futures' view of a future ------------------------------------
#
# concurrent.futures.wait and as_completed reach into a future's private
# attributes: they hold `_condition` while they read `_state` and append
# their waiter to `_waiters` (of every future, done or not), and later
# remove it. Each waiter of a future that was not done then is told once,
# through add_result/add_exception/add_cancelled, that it is done.


class CfCondition:
    """``fut._condition`` for concurrent.futures: the future's own lock.

    Holding it makes ``fut._waiters`` a :class:`CfWaiters`. Releasing it
    makes it a plain list again (or ``None``) unless a standard waiter is
    still in it, so a future keeps nothing once they are gone. Nothing here
    is allocated for a future that never meets concurrent.futures' code.
    """

    __slots__ = ("_fut",)

    def __init__(self, fut: Future[Any]) -> None:
        self._fut = fut

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        fut = self._fut
        if not fut._lock.acquire(blocking, timeout):
            return False
        waiters = fut._waiters
        if type(waiters) is not CfWaiters:
            fut._waiters = CfWaiters(fut, waiters or ())
        return True

    def release(self) -> None:
        fut = self._fut
        waiters = fut._waiters
        if type(waiters) is CfWaiters and not any(type(w) is _CfWaiter for w in waiters):
            fut._waiters = list(waiters) or None
        fut._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class CfWaiters(list):  # type: ignore[type-arg]
    """A future's waiters: threads blocked in ``wait()``, and concurrent.futures waiters.

    The future wakes each waiter by calling its ``release()``; a standard
    waiter is kept in a :class:`_CfWaiter` that tells it the outcome.
    """

    __slots__ = ("_fut",)

    def __init__(self, fut: Future[Any], waiters: Any) -> None:
        super().__init__(waiters)
        self._fut = fut

    def append(self, waiter: Any) -> None:
        if hasattr(waiter, "add_result"):  # not a thread blocked in Future.wait()
            waiter = _CfWaiter(self._fut, waiter)
        super().append(waiter)

    def remove(self, waiter: Any) -> None:
        for i, item in enumerate(self):
            if item is waiter or (type(item) is _CfWaiter and item.waiter is waiter):
                del self[i]
                return
        # Not here: it was told, and dropped, when the future settled.


class _CfWaiter:
    __slots__ = ("fut", "waiter")

    def __init__(self, fut: Future[Any], waiter: Any) -> None:
        self.fut = fut
        self.waiter = waiter

    def release(self) -> None:
        fut, waiter = self.fut, self.waiter
        if fut.cancelled():
            waiter.add_cancelled(fut)
        elif fut._exception is not None:
            waiter.add_exception(fut)
        else:
            waiter.add_result(fut)


# -- wait_all's waiting --------------------------------------------------------


def first_failed(futures: list[Future[Any]]) -> int | None:
    """Wait until all of ``futures`` are done, or one has failed or been
    cancelled; return the index of the first of those in list order, or None.

    The calling thread runs a task that has not started only once its
    future is the last one not done (a task it ran could not be stopped
    when another failed meanwhile); a pool's worker first runs the tasks it
    forked that are still queued, as before any wait. The last task may run
    here, so its failure's traceback holds this frame: it lets go of the
    failed future before it returns."""
    # Watched from before the first look, so that a failure is either seen
    # by that look or heard by the watch: when neither happens, the futures
    # need no second look once they are all done.
    with FailureWatch(futures) as watch:
        index = _index_of_failed(futures)
        if index is not None:
            return index
        pending = [fut for fut in futures if fut._state in _WAITING]
        if not pending:
            return None
        if len(pending) == 1:
            pending[0]._block(None)  # runs its task here if it has not started
        else:
            _wait_unless_one_fails(pending, watch)
        pending.clear()
        if not watch.failed:
            return None
    return _index_of_failed(futures)


def values(futures: list[Future[Any]]) -> list[Any]:
    """The values of ``futures``, every one of which succeeded."""
    # value()'s common case, without its call: a batch of forks pays no call per value.
    return [fut._result for fut in futures]


def _wait_unless_one_fails(pending: list[Future[Any]], watch: FailureWatch) -> None:
    """Block until all of ``pending`` are done or ``watch`` hears that one
    of its futures failed or was cancelled, running none of their tasks
    here (a task this thread ran could not be stopped when another failed),
    except that a pool's worker first runs its own queued forks, as before
    any wait."""
    # Newest first: forks run in about the order they were made, so the
    # thread blocks about once, not once per future.
    for fut in reversed(pending):
        if fut._state in _WAITING:
            help_first(fut, None, None)  # a pool's worker runs its queued forks first
            if fut._state in _WAITING and not watch.failed:
                fut._sleep(None, fut._task, watch)
        if watch.failed:
            return


def _index_of_failed(futures: list[Future[Any]]) -> int | None:
    """The index of the first of ``futures`` that failed or was cancelled, or None."""
    for index, fut in enumerate(futures):
        # A success, the common case, costs two identity tests.
        if fut._exception is not None or (fut._state is not FINISHED and fut._state in _CANCELLED):
            del fut  # no cycle: see first_failed
            return index
    return None


# -- the internal interface ----------------------------------------------------
#
# What the rest of aiopar does to a future beyond its public methods: a
# backend claims it and settles it; the API blocks on it and reads whether
# it failed. Other modules use these names, never a future's private
# fields. Each is the Future's own method, so calling one costs what
# calling the method did: no Python call is added on the hot path, whose
# calls tests/test_overhead.py counts.
#
# One exception: Backend.fork and submit_chunk, and _loop.start_coroutine for
# a coroutine fork, store a forked task's future's ``_task`` themselves (the
# task that settles it, which a waiter may run: see _blocking.help_first),
# once, before the task is queued. A call for it, even a C one (the slot's
# setter), cost 5% of a batch of forks.

#: ``claim(fut)``: PENDING -> RUNNING, for the one thread that will run its
#: task; False if it was cancelled or claimed already.
claim: Callable[[Future[Any]], bool] = Future._claim

#: ``settle(fut, result, exception)``: FINISHED with this outcome (with
#: ``exception`` if it is not None), waiters woken and callbacks run; False
#: if the future was done already. A forked task's future is settled only so.
settle: Callable[[Future[Any], Any, BaseException | None], bool] = Future._settle

#: ``cancel_claimed(fut)``: RUNNING -> cancelled, for a task claimed but
#: never started (see :meth:`Future._cancel_claimed`); False if not running.
cancel_claimed: Callable[[Future[Any]], bool] = Future._cancel_claimed


def renew_lock(fut: Future[Any]) -> None:
    """Give ``fut`` a new lock, in a child made by ``os.fork()``: a thread
    of the parent, which the child does not have, may have held the old one."""
    fut._lock = threading.Lock()


#: ``retrieve(fut)``: its exception or None; the failure now counts as read,
#: so it is not logged when the future goes.
retrieve: Callable[[Future[Any]], BaseException | None] = Future._retrieve

#: ``block_until_done(fut, timeout)``: wait until done or ``timeout``
#: passes, running the work this thread can first; True if done. Raises
#: nothing of the future's outcome.
block_until_done: Callable[[Future[Any], float | None], bool] = Future._block

#: ``until_done(fut)``: an awaitable that waits for the future without
#: raising its outcome.
until_done: Callable[[Future[Any]], _UntilDone] = Future._until_done

#: ``add_callback(fut, fn)``: ``add_done_callback`` without its checks, for
#: aiopar's own callbacks: ``fn(fut)`` runs in the settling thread.
add_callback: Callable[[Future[Any], Callable[[Future[Any]], object]], None] = Future._add_callback


def failed(fut: Future[Any]) -> bool:
    """True if ``fut`` finished with an exception. The failure does not count
    as read (compare :func:`retrieve`)."""
    return fut._exception is not None
