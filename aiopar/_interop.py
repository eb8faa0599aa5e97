"""Where an aiopar Future meets code written for asyncio's and concurrent.futures' own futures.

asyncio: an aiopar Future is not an asyncio future (``asyncio.isfuture`` is
false), so ``gather``, ``wait_for``, ``shield``, ``ensure_future``,
``as_completed`` and ``run_until_complete`` wrap it in a Task that awaits it.
Only ``asyncio.wait`` uses the object itself: it adds a done-callback on the
loop's thread and removes it again, and that callback touches the loop. So a
callback that asyncio's own code adds on a loop's thread runs on that loop,
through the batching bridge; every other callback runs in the thread that
settles the future, as a ``concurrent.futures`` callback does.

concurrent.futures: ``Future`` derives from ``concurrent.futures.Future``
and keeps its state in ``_state`` under the standard library's own names.
``wait`` and ``as_completed`` lock each future through ``_condition``, read
``_state`` and add their waiter to ``_waiters``. The condition is a view of
the future's own lock, made on access; while it is held, ``_waiters`` is a
list that keeps a standard waiter among the future's blocked threads, woken
the same way. Nothing here is allocated for a future that never meets this
code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import inspect
from asyncio import _get_running_loop
from collections.abc import Callable
from typing import Any

from ._bridge import Bridge, asyncio_bridge

__all__ = [
    "CfCondition",
    "LoopCallback",
    "adapt_callback",
    "describe_type",
    "has_future_protocol",
    "not_a_future_message",
]


# -- asyncio ----------------------------------------------------------------


def _is_asyncio_code(fn: Callable[..., Any]) -> bool:
    module = getattr(fn, "__module__", None)
    return isinstance(module, str) and (module == "asyncio" or module.startswith("asyncio."))


def adapt_callback(
    fn: Callable[[Any], object], context: contextvars.Context | None
) -> Callable[[Any], object]:
    """``fn`` itself, or a :class:`LoopCallback` when it needs one.

    It does if ``context`` is given, or if asyncio's own code adds ``fn`` on
    the thread of a running loop (``asyncio.wait`` does): asyncio runs every
    callback on its loop, and the ones it writes rely on that.
    """
    loop = _get_running_loop()
    if loop is not None and not _is_asyncio_code(fn):
        loop = None
    if loop is None and context is None:
        return fn
    return LoopCallback(fn, context, loop)


class LoopCallback:
    """A done-callback run in a given context and, if ``loop`` is given, on that loop.

    Posted to the loop through its bridge, so completions that arrive
    together cost one wake-up; run at once when the settling thread is the
    loop's own, or when the loop is closed (nobody would run it there). An
    exception it raises goes to the loop's exception handler, as one from
    any callback the loop runs.
    """

    __slots__ = ("bridge", "context", "fn", "loop")

    def __init__(
        self,
        fn: Callable[[Any], object],
        context: contextvars.Context | None,
        loop: asyncio.AbstractEventLoop | None,
    ) -> None:
        self.fn = fn
        self.context = context
        self.loop = loop
        # Made here, on the loop's thread: making a bridge registers a reader.
        self.bridge: Bridge | None = None if loop is None else asyncio_bridge(loop)

    def __call__(self, fut: Any) -> None:
        loop = self.loop
        if loop is None:
            self.run(fut)  # an exception goes to the caller, which reports it
        elif _get_running_loop() is loop or loop.is_closed():
            self._run_for_loop(loop, fut)
        else:
            self.bridge.post(functools.partial(self._run_for_loop, loop, fut))  # type: ignore[union-attr]

    def run(self, fut: Any) -> None:
        if self.context is None:
            self.fn(fut)
        else:
            self.context.run(self.fn, fut)

    def _run_for_loop(self, loop: asyncio.AbstractEventLoop, fut: Any) -> None:
        # Never raises: on the loop, that would drop the rest of the bridge's batch.
        try:
            self.run(fut)
        except Exception as exc:
            loop.call_exception_handler(
                {
                    "message": f"exception in done-callback {self.fn!r} of {fut!r}",
                    "exception": exc,
                    "future": fut,
                }
            )


# -- concurrent.futures -----------------------------------------------------
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
    still in it, so a future keeps nothing once they are gone.
    """

    __slots__ = ("_fut",)

    def __init__(self, fut: Any) -> None:
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

    def __init__(self, fut: Any, waiters: Any) -> None:
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

    def __init__(self, fut: Any, waiter: Any) -> None:
        self.fut = fut
        self.waiter = waiter

    def release(self) -> None:
        _tell(self.waiter, self.fut)


def _tell(waiter: Any, fut: Any) -> None:
    if fut.cancelled():
        waiter.add_cancelled(fut)
    elif fut._exception is not None:
        waiter.add_exception(fut)
    else:
        waiter.add_result(fut)


def has_future_protocol(obj: object) -> bool:
    """Whether ``obj`` answers as a ``concurrent.futures.Future`` does, with
    ``add_done_callback``, ``result``, ``exception``, ``cancelled`` and
    ``cancel`` (a ``dask.distributed`` Future does, and an asyncio future)."""
    return isinstance(obj, concurrent.futures.Future) or all(
        callable(getattr(obj, name, None)) for name in _FUTURE_PROTOCOL
    )


_FUTURE_PROTOCOL = ("add_done_callback", "result", "exception", "cancelled", "cancel")


# -- messages ---------------------------------------------------------------


def describe_type(obj: object) -> str:
    """The name a user knows ``obj``'s class by: ``concurrent.futures.Future``,
    ``asyncio.Task``, ``coroutine``, or its module and name."""
    if isinstance(obj, concurrent.futures.Future):
        return "concurrent.futures.Future"
    if isinstance(obj, asyncio.Task):
        return "asyncio.Task"
    if asyncio.isfuture(obj):
        return "asyncio.Future"
    kind = type(obj)
    if inspect.iscoroutine(obj) or kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


def not_a_future_message(obj: object, where: str) -> str:
    """Why ``obj`` is no aiopar Future, and the call that makes it one."""
    got = describe_type(obj)
    if has_future_protocol(obj):
        fix = (
            f"adapt it with aiopar.wrap(), which returns an aiopar.Future that settles "
            f"when the {got} does"
        )
    elif inspect.iscoroutine(obj):
        fix = (
            "fork the coroutine function instead, aiopar.fork(fn, *args), "
            "or adapt the coroutine with aiopar.wrap()"
        )
    elif inspect.isawaitable(obj):
        fix = "adapt it with aiopar.wrap(), which runs it on an event loop"
    else:
        fix = "aiopar.fork() returns one, and aiopar.wrap() adopts other futures and awaitables"
    return f"{where} takes an aiopar Future, got {got}; {fix}"
