"""How a settled future's done-callbacks run: in the settling thread, one
batch after another, or handed to another thread.

Callbacks that settle further futures (a ``then()`` chain) do not nest: the
thread that is running callbacks already queues the next batch in its
"deferred" queue and runs it when the current one returns, so a chain of a
million links settles without recursion. A thread may hand its batches to
another thread instead (:func:`set_callback_runner`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from ._bridge import send_wakes
from ._log import logger
from ._waiter import local

__all__ = ["drain_deferred", "run_callbacks", "run_each", "set_callback_runner"]


def run_each(fut: Any, callbacks: Iterable[Callable[[Any], object]]) -> None:
    """Call each of ``callbacks`` with ``fut``, in order; what one raises is
    logged on the ``aiopar`` logger and the others still run."""
    # A pool's worker may hold wake-ups of event loops (_bridge.hold_wakes):
    # they go before a callback runs that may take any time.
    wakes = local.__dict__.get("wakes")
    for fn in callbacks:
        if wakes:
            send_wakes(wakes)
        try:
            fn(fut)
        except BaseException:
            # Whatever a callback raises (SystemExit and KeyboardInterrupt
            # too) is the callback's own failure: the thread that settled the
            # future, a pool's worker say, goes on.
            logger.exception("exception in a done-callback of %r", fut)


def run_callbacks(fut: Any, callbacks: list[Callable[[Any], object]]) -> None:
    """Run the callbacks of ``fut``, which has just been settled, here or,
    if this thread is running callbacks already, after those."""
    state = local.__dict__
    deferred = state.get("deferred")
    if deferred is not None:
        # Already running callbacks further up this thread's stack: queue
        # these for that loop instead of nesting another call.
        deferred.append((fut, callbacks))
        return
    state["deferred"] = deferred = deque()
    try:
        run_each(fut, callbacks)
        while deferred:
            run_each(*deferred.popleft())
    finally:
        state["deferred"] = None


def drain_deferred() -> None:
    """Run the batches this thread queued while it ran callbacks: a thread
    about to block may be waiting for one of them."""
    deferred = local.__dict__.get("deferred")
    while deferred:
        run_each(*deferred.popleft())


class _HandOff:
    """A thread's "deferred" queue that hands each batch of callbacks to
    another thread instead of keeping it (see :func:`set_callback_runner`)."""

    __slots__ = ("run",)

    def __init__(self, run: Callable[..., object]) -> None:
        self.run = run

    def append(self, item: tuple[Any, list[Callable[[Any], object]]]) -> None:
        self.run(run_each, *item)

    def __bool__(self) -> bool:
        return False  # nothing ever waits here to be drained


def set_callback_runner(run: Callable[..., object] | None) -> None:
    """From now on, the callbacks of the futures that this thread settles run
    through ``run(fn, *args)`` (which runs them in another thread, in order)
    instead of in this thread; None: in this thread again.

    For a thread that must never block, as one that reads replies off a
    connection: a callback may block, even on a reply that thread is to
    read. Each future's callbacks stay in registration order, and stay
    together.
    """
    local.deferred = None if run is None else _HandOff(run)
