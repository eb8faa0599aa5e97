"""How a thread waits for a future: first it runs the work it can, then it
blocks, telling its owner and the profiler, in a way that Ctrl-C ends.

The work it runs first is the awaited task itself if it has not started
(so ``wait(fork(f))`` costs about a function call, and a task that waits
never starves its pool), then, in a work-first pool's worker, the tasks the
thread forked that are still queued. Timeouts take two rules: aiopar's own
for ``wait()`` and concurrent.futures' for ``result()`` and ``exception()``.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
from asyncio import _get_running_loop
from types import FrameType
from typing import Any

import sniffio

from . import _interrupt, _trace, _waiter

__all__ = ["block", "cf_timeout", "check_timeout", "help_first", "warn_blocking_loop"]

_sniffio_thread = sniffio.thread_local

# A task a waiter runs adds about six frames to its stack: past a twelfth
# of the recursion limit in nested steals, a waiter blocks instead.
_FRAMES_PER_STEAL = 12


def help_first(fut: Any, task: Any, timeout: float | None) -> None:
    """Before this thread blocks on ``fut``, run the work it can: ``task``,
    the one behind ``fut``, if it has not started and no timeout is given
    (a timeout bounds the whole call, so the task is left to its pool);
    then, in a work-first pool's worker, the tasks the thread forked that
    are still queued, newest first, with or without a timeout (without
    that, nested forks could starve the pool).

    Warns first if an event loop runs in this thread, which the wait stalls.
    Work it runs nests in this thread's stack: a deep stack runs nothing
    and blocks instead, and the pool compensates, so deep recursion through
    fork and wait never hits the recursion limit.
    """
    if _get_running_loop() is not None or _sniffio_thread.name is not None:
        warn_blocking_loop()
    state = _waiter.local.__dict__
    steals = state.get("steals", 0)
    if steals >= sys.getrecursionlimit() // _FRAMES_PER_STEAL:
        return
    owner = state.get("waiter")
    run_own_forks = None if owner is None else getattr(owner, "run_own_forks", None)
    state["steals"] = steals + 1
    try:
        if timeout is None and task is not None and task.stealable:
            task.run()  # does nothing unless it wins the claim
        if run_own_forks is not None:
            run_own_forks(fut)
    finally:
        state["steals"] = steals
        del fut, task  # a task's failure holds this frame: no cycle (see Future)


def block(waiter: threading.Lock, timeout: float | None, task: Any) -> bool:
    """Block until ``waiter``, a held lock, is released, or ``timeout``
    passes; True if it was released.

    The thread's owner is told it blocked, and blocked long once that has
    lasted ``BLOCKED_LONG`` seconds, then that it resumed; the profiler
    records the time against ``task``. On the main thread, Ctrl-C ends the
    wait (see :mod:`aiopar._interrupt`).
    """
    owner = _waiter.get_waiter()
    profiler = _trace.active
    started = time.perf_counter() if profiler is not None else 0.0
    blocked_long = _waiter.BLOCKED_LONG
    released = False
    try:
        if owner is not None:
            owner.blocked()
        if owner is None or (timeout is not None and timeout <= blocked_long):
            released = _interrupt.acquire(waiter, timeout)
        else:
            released = _interrupt.acquire(waiter, blocked_long)
            if not released:
                owner.blocked_long()
                rest = None if timeout is None else timeout - blocked_long
                released = _interrupt.acquire(waiter, rest)
    finally:
        if owner is not None:
            owner.resumed()
        if profiler is not None:
            profiler.on_blocked(time.perf_counter() - started, task)
    return released


def check_timeout(timeout: float | None) -> float | None:
    """The timeout to wait with: None (for ever) for None, infinity or more
    seconds than a lock can wait; else ``timeout`` itself if it is a number
    >= 0. Anything else raises TypeError or ValueError."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"timeout must be None (wait for ever) or a number of seconds, "
            f"got {type(timeout).__name__} {timeout!r}"
        )
    if not timeout >= 0:  # NaN too
        raise ValueError(
            f"timeout must be None (wait for ever) or a number of seconds >= 0, got {timeout!r}"
        )
    return None if timeout > threading.TIMEOUT_MAX or math.isinf(timeout) else timeout


def cf_timeout(timeout: float | None) -> float | None:
    """The timeout to wait with, as :mod:`concurrent.futures` takes it: as
    :func:`check_timeout`'s, except that 0 or less (NaN too) is no wait at all."""
    if isinstance(timeout, int | float) and not isinstance(timeout, bool) and not timeout > 0:
        return 0
    return check_timeout(timeout)


_PACKAGE_DIR = os.path.dirname(__file__) + os.sep


def warn_blocking_loop() -> None:
    """Warn that this thread runs an event loop that a blocking wait stalls,
    once per line of the caller's code (the warnings module's default)."""
    frame: FrameType | None = sys._getframe(1)
    level = 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(
        # One text for every future: the warnings module shows a warning once
        # per line and text.
        "a blocking wait on an aiopar Future stalls the event loop running in this thread "
        "until the future is done (nothing else on the loop runs meanwhile); "
        "in a coroutine write 'await fut' (and 'async for' over aiopar.as_completed)",
        RuntimeWarning,
        stacklevel=level,
    )
