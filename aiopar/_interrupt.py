"""Blocking waits that Ctrl-C always ends.

CPython runs a Python signal handler only when the main thread next checks
for one, between two bytecodes. A SIGINT that arrives after the main
thread's last check but before it blocks on a lock (while it waits for the
GIL, say), or that the kernel hands to another thread, does not wake that
lock's wait: a wait without a time limit then never returns to raise the
KeyboardInterrupt, and Ctrl-C does nothing. On the main thread, the waits
here therefore block in slices of :data:`SLICE` seconds, so a pending
KeyboardInterrupt is raised within one slice; other threads, which never
run signal handlers, block in one piece.

A leaf module: it imports nothing of aiopar.
"""

from __future__ import annotations

import os
import threading
import time
from threading import get_ident
from typing import Protocol

__all__ = ["SLICE", "acquire", "join", "on_main_thread"]

#: seconds a wait on the main thread blocks before it looks for a pending signal
SLICE = 0.1


class _Lock(Protocol):
    def acquire(self, blocking: bool = ..., timeout: float = ...) -> bool: ...


def on_main_thread() -> bool:
    """Whether the calling thread is the one that runs signal handlers."""
    return get_ident() == _main_thread


# The id of the thread that runs signal handlers, read at import and after
# os.fork() (the forking thread is the child's main thread): a compare of
# ids costs none of the calls current_thread() and main_thread() make.
_main_thread = threading.main_thread().ident


def _after_fork_in_child() -> None:
    # threading registered its own after-fork handler first, which has made
    # this thread the child's main thread.
    global _main_thread
    _main_thread = threading.main_thread().ident


os.register_at_fork(after_in_child=_after_fork_in_child)


def acquire(lock: _Lock, timeout: float | None = None) -> bool:
    """``lock.acquire(True, timeout)``, ``None`` meaning no limit, that a
    KeyboardInterrupt ends on the main thread; True if the lock was acquired."""
    # on_main_thread(), inline: once per blocking wait, whose Python calls are
    # counted (tests/test_overhead.py); tests/test_budget_copies.py checks
    # that the two agree.
    if get_ident() != _main_thread:
        return lock.acquire(True, -1 if timeout is None else timeout)
    if timeout is None:
        while not lock.acquire(True, SLICE):
            pass
        return True
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if lock.acquire(True, min(max(left, 0.0), SLICE)):
            return True
        if left <= SLICE:
            return False


def join(thread: threading.Thread, timeout: float | None = None) -> None:
    """``thread.join(timeout)`` that a KeyboardInterrupt ends on the main thread."""
    # on_main_thread(), inline: once per blocking wait, whose Python calls are
    # counted (tests/test_overhead.py); tests/test_budget_copies.py checks
    # that the two agree.
    if get_ident() != _main_thread:
        thread.join(timeout)
        return
    deadline = None if timeout is None else time.monotonic() + timeout
    while thread.is_alive():
        left = SLICE if deadline is None else min(deadline - time.monotonic(), SLICE)
        if left <= 0:
            return
        thread.join(left)
