"""The waiter protocol: how a thread's owner learns that the thread blocks.

A leaf module (it imports nothing of aiopar), so that the future, the bridge
to event loops and the thread budget can all reach the owner of a thread
without importing one another. A pool registers a :class:`Waiter` in each of
its threads with :func:`set_waiter`; every blocking wait in that thread
calls ``blocked``, then ``resumed`` (and ``blocked_long`` in between if it
lasts ``BLOCKED_LONG`` seconds).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Protocol

__all__ = ["BLOCKED_LONG", "Waiter", "get_waiter", "local", "set_waiter"]

# BLAS and OpenMP pools spin for about 0.1 s after each call (OpenBLAS for
# 2**28 cycles), so more threads for a shorter spell leave spinners behind
# that cost the tasks sharing the cores more than the spell gained.
#: seconds after which a thread still blocked in ``wait`` is told ``blocked_long``
BLOCKED_LONG = 0.1

# Per-thread state of the future module: `waiter` is the Waiter that owns
# this thread; `deferred` holds the callbacks of futures settled while this
# thread was already running callbacks; `steals` counts tasks a waiter runs
# nested in its own stack.
local = threading.local()


class Waiter(Protocol):
    """The owner of a thread, told when that thread blocks in :meth:`Future.wait`.

    A pool registers one in each of its threads with :func:`set_waiter`, so a
    worker that blocks on another task does not starve the pool (it lets
    another worker run, or secedes from a cluster worker's thread count)
    and does not hold on to its share of the cores.

    An owner may also have ``run_own_forks(fut)``: it then runs tasks the
    thread forked that are still queued, newest first, until ``fut`` is done
    or none is left, before the thread blocks (a work-first pool's worker).
    """

    def blocked(self) -> None:
        """The thread is about to block until a future is done."""

    def blocked_long(self) -> None:
        """The thread has been blocked for ``BLOCKED_LONG`` seconds and still is."""

    def resumed(self) -> None:
        """The thread stopped blocking (the future is done or the wait timed out)."""


def set_waiter(waiter: Waiter | None) -> Waiter | None:
    """Make ``waiter`` the owner of the calling thread; return the one it replaces.

    ``None`` removes the owner. Every blocking wait in this thread calls
    ``blocked``, then ``resumed`` (and ``blocked_long`` in between if it lasts).
    """
    state: dict[str, Any] = local.__dict__
    previous: Waiter | None = state.get("waiter")
    state["waiter"] = waiter
    return previous


def get_waiter() -> Waiter | None:
    """The owner of the calling thread, or None."""
    waiter: Waiter | None = local.__dict__.get("waiter")
    return waiter


def _after_fork_in_child() -> None:
    # The forking thread's owner (a pool's worker, say) does not exist in the child.
    local.__dict__.pop("waiter", None)


os.register_at_fork(after_in_child=_after_fork_in_child)
