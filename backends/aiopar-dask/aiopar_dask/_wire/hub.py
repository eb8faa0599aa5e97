"""The one thread of a process that does the rpc wire's waiting.

It waits on every connection of the process at once (``selectors``):
it reads what arrives and hands each message on, accepts new connections
and runs their handshakes, writes what a sender's non-blocking write left
over, and closes a connection whose handshake is late. So a peer has the
same few threads whether it talks to one peer or to a thousand, and no
thread waits on one socket alone. Nothing raised in it escapes it: a
socket whose handler fails is told so (``on_error``) and no longer
waited on, and the thread goes on with the others.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

__all__ = ["Hub", "Pollable"]

_logger = logging.getLogger("aiopar.rpc")


class Pollable(Protocol):
    """What the hub waits on: a socket and what to do when it is ready."""

    def fileno(self) -> int: ...

    def on_readable(self) -> None: ...

    def on_writable(self) -> None: ...

    def on_late(self) -> None: ...

    def on_error(self, exc: Exception) -> None:
        """One of the handlers above raised ``exc``: the hub waits on it no more."""


class Hub:
    """Waits on sockets in a thread of its own, started on first use.

    ``thread_init`` runs first in that thread. Every method may be called
    from any thread: they take effect in the hub's thread, in order.
    """

    def __init__(self, name: str = "aiopar-rpc-io", thread_init: Callable[[], object] = list):
        self._name = name
        self._thread_init = thread_init
        self._selector = selectors.DefaultSelector()
        self._wake_in, self._wake_out = socket.socketpair()
        for sock in (self._wake_in, self._wake_out):
            sock.setblocking(False)
        self._selector.register(self._wake_in, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._calls: deque[tuple[Callable[..., object], tuple[Any, ...]]] = deque()
        self._deadlines: dict[Pollable, float] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def call_soon(self, fn: Callable[..., object], *args: Any) -> bool:
        """Run ``fn(*args)`` in the hub's thread; False if the hub is closed."""
        with self._lock:
            if self._closed:
                return False
            self._calls.append((fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        with contextlib.suppress(OSError):  # BlockingIOError: a wake-up is pending anyway
            self._wake_out.send(b"\0")
        return True

    def call_soon_unlocked(self, fn: Callable[..., object], *args: Any) -> None:
        """:meth:`call_soon` without taking a lock, for a caller that may hold
        any lock already: a finalizer, which runs wherever the last reference
        goes. Nothing runs if the hub has not started or is closed."""
        if self._thread is None or self._closed:
            return
        self._calls.append((fn, args))  # (a deque's append needs no lock)
        with contextlib.suppress(OSError):  # closed meanwhile, or a wake-up is pending
            self._wake_out.send(b"\0")

    def add(self, target: Pollable, deadline: float | None = None) -> bool:
        """Wait for ``target`` to be readable; call its ``on_late()`` at
        ``deadline`` (``time.monotonic()``) unless :meth:`punctual` first."""
        return self.call_soon(self._add, target, deadline)

    def want_write(self, target: Pollable, wanted: bool) -> None:
        """In the hub's thread only: also wait for ``target`` to be writable, or no longer."""
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if wanted else 0)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.modify(target, events, target)

    def punctual(self, target: Pollable) -> None:
        """In the hub's thread only: ``target`` has no deadline any more."""
        self._deadlines.pop(target, None)

    def remove(self, target: Pollable, then: Callable[[], object]) -> None:
        """Stop waiting for ``target``, then call ``then()`` (to close its
        socket where no selector can still be using it)."""
        if not self.call_soon(self._remove, target, then):
            then()  # the hub is closed: nothing waits on it

    def _add(self, target: Pollable, deadline: float | None) -> None:
        try:
            self._selector.register(target, selectors.EVENT_READ, target)
        except (KeyError, ValueError, OSError):  # closed before it got here
            return
        if deadline is not None:
            self._deadlines[target] = deadline
        try:
            target.on_readable()  # what arrived before it was registered
        except Exception as exc:
            self._failed(target, exc)

    def _remove(self, target: Pollable, then: Callable[[], object]) -> None:
        self._deadlines.pop(target, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(target)
        then()

    def _run(self) -> None:
        self._thread_init()
        while self._round():
            pass

    def _round(self) -> bool:
        """Wait once, then handle what is ready, the calls and the deadlines
        due; False once the hub is closed. (A round of its own, so that no
        local holds a target or a call's arguments while the hub waits: a
        closed connection is freed as it closes.)"""
        calls, deadlines = self._calls, self._deadlines
        timeout = None
        if deadlines:
            timeout = max(0.0, min(deadlines.values()) - time.monotonic())
        for key, events in self._selector.select(timeout):
            target = key.data
            if target is None:
                with contextlib.suppress(OSError):
                    while self._wake_in.recv(4096):
                        pass
                continue
            try:
                if events & selectors.EVENT_WRITE:
                    target.on_writable()
                if events & selectors.EVENT_READ:
                    target.on_readable()
            except Exception as exc:
                self._failed(target, exc)
        while calls:  # appended under the lock, taken from here only
            fn, args = calls.popleft()
            self._call(fn, args)
        if self._closed:
            with self._lock:  # no call can come any more
                left = list(calls)
            for fn, args in left:
                self._call(fn, args)
            self._stop()
            return False
        if deadlines:
            now = time.monotonic()
            for target, deadline in list(deadlines.items()):
                if deadline <= now:
                    del deadlines[target]
                    try:
                        target.on_late()
                    except Exception as exc:
                        self._failed(target, exc)
        return True

    def _call(self, fn: Callable[..., object], args: tuple[Any, ...]) -> None:
        try:
            fn(*args)
        except Exception:
            _logger.exception("%r raised in the rpc wire's thread %r", fn, self._name)

    def _failed(self, target: Pollable, exc: Exception) -> None:
        _logger.error("a handler of %r raised in the rpc wire's thread", target, exc_info=exc)
        self._deadlines.pop(target, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(target)
        self._call(target.on_error, (exc,))

    def _stop(self) -> None:
        self._selector.close()
        self._wake_in.close()
        self._wake_out.close()

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the thread once the calls made so far have run, and wait up
        to ``timeout`` s for it (not when called from the hub's thread)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is None:
            self._stop()
            return
        with contextlib.suppress(OSError):
            self._wake_out.send(b"\0")
        if timeout and thread is not threading.current_thread():
            thread.join(timeout)
