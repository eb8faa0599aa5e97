"""Where an aiopar Future meets code written for asyncio's and concurrent.futures' own futures.

asyncio: an aiopar Future is not an asyncio future (``asyncio.isfuture`` is
false), so ``gather``, ``wait_for``, ``shield``, ``ensure_future``,
``as_completed`` and ``run_until_complete`` wrap it in a Task that awaits it.
Only ``asyncio.wait`` uses the object itself: it adds a done-callback on the
loop's thread and removes it again, and that callback touches the loop. So a
callback that asyncio's own code adds on a loop's thread runs on that loop,
through the batching bridge; every other callback runs in the thread that
settles the future, as a ``concurrent.futures`` callback does.

concurrent.futures: ``Future`` derives from ``concurrent.futures.Future``;
how its ``wait`` and ``as_completed`` see the future's state is the
future's own module's (``aiopar._future.CfCondition``). Here: whether an
object answers as one of its futures does, for ``aiopar.wrap``.
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


# -- other futures ------------------------------------------------------------


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
