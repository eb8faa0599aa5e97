"""Running aiopar futures' done-callbacks off the event loop and off the rpc wire's thread.

A future's done-callbacks run in the thread that settles it, and a callback
may block in ``wait()`` on another remote result. On the event loop that
result could never arrive, so the loop (and the wire's thread) settles
futures with their callbacks handed to a settler thread
(``set_callback_runner``): a thread waiting on a future wakes from where
its result arrived, and only callbacks take the hop. One thread does the
work while callbacks return quickly; a thread whose callback blocks hands
the queue to a new one (the waiter protocol tells it), so a blocking
callback never stalls the others. A settler of several
threads (``threads``) also starts a new one for a call that would wait
behind a busy one, so a slow call delays no other.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from aiopar.lowlevel import set_waiter

__all__ = ["Settler"]

_IDLE_EXIT = 2.0  # seconds a surplus thread stays idle before it exits


class Settler:
    """A queue of calls run in order by a thread that is replaced while it
    blocks; with ``threads`` above 1, by up to that many at once.
    ``thread_init`` runs first in each of its threads."""

    def __init__(
        self, name: str, threads: int = 1, thread_init: Callable[[], object] = list
    ) -> None:
        self._name = name
        self._most = threads  # busy threads at once, blocked ones not counted
        self._thread_init = thread_init
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...]]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._threads: set[threading.Thread] = set()
        self._idle = 0  # threads waiting on _wake
        self._busy = 0  # threads running calls, not blocked in wait()
        self._closed = False

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in a settler thread; never blocks. Thread-safe."""
        with self._lock:
            closed = self._closed
            if not closed:
                self._calls.append((fn, args))
                if self._idle:
                    self._wake.notify()
                elif self._busy < self._most:
                    self._start()
        if closed:
            fn(*args)  # a late result after close: settled here rather than lost

    def _start(self) -> None:
        # Called with the lock held.
        thread = threading.Thread(
            target=self._run, name=f"aiopar-{self._name}-settler", daemon=True
        )
        self._threads.add(thread)
        self._busy += 1
        thread.start()

    def _run(self) -> None:
        self._thread_init()
        set_waiter(_Handover(self))
        calls, lock = self._calls, self._lock
        try:
            while True:
                with lock:
                    while not calls:
                        if self._closed:
                            return
                        self._busy -= 1
                        self._idle += 1
                        woken = self._wake.wait(_IDLE_EXIT)
                        self._idle -= 1
                        self._busy += 1
                        if not woken and not calls and len(self._threads) > 1:
                            return
                    fn, args = calls.popleft()
                fn(*args)
        finally:
            with lock:
                self._busy -= 1
                self._threads.discard(threading.current_thread())

    def _blocked(self) -> None:
        with self._lock:
            self._busy -= 1
            if self._calls and not self._idle and self._busy < self._most and not self._closed:
                self._start()

    def _resumed(self) -> None:
        with self._lock:
            self._busy += 1

    def close(self, timeout: float = 5.0) -> None:
        """Run what is queued, then stop the threads (waiting up to ``timeout`` s)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            threads = list(self._threads)
        current = threading.current_thread()
        for thread in threads:
            if thread is not current:
                thread.join(timeout)


class _Handover:
    """The settler thread's waiter: while its callback blocks, another thread takes over."""

    __slots__ = ("_settler",)

    def __init__(self, settler: Settler) -> None:
        self._settler = settler

    def blocked(self) -> None:
        self._settler._blocked()

    def blocked_long(self) -> None:
        pass

    def resumed(self) -> None:
        self._settler._resumed()
