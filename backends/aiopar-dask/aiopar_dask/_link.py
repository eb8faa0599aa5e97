"""The caller's side of the rpc wire: one :class:`Link` per callee.

A caller keeps one connection to each callee it calls (see ``_wire`` for why
not a dask comm) and writes its calls on it from its own thread; the
process's hub reads the replies. A reply of plain data (``_wire.plain``:
nothing in it runs code as it is read) settles its call's future there;
any other reply is unpickled in a reply thread of its own
(:meth:`Caller.read_later`), so one that is slow to unpickle, or that waits
for other replies as it is unpickled, delays its own call only. Callbacks of
the futures run elsewhere (see ``set_callback_runner``). :class:`Timeouts`
fails the calls that have no reply by their deadline. What a link needs of
the agent whose calls it carries is a :class:`Caller`.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import aiopar
from aiopar.lowlevel import set_callback_runner

from . import _errors, _wire

__all__ = ["Caller", "Link", "Reply", "Timeouts", "fail", "read_reply", "settle_reply"]

_TICK = 0.05  # timeouts are checked this often


class Caller(Protocol):
    """The peer whose calls links carry."""

    @property
    def hub(self) -> _wire.Hub:
        """The hub that reads this peer's connections."""

    @property
    def timeouts(self) -> Timeouts:
        """The deadlines of this peer's pending calls."""

    @property
    def stopped(self) -> BaseException | None:
        """Why this peer stopped calling, or None while it calls."""

    def forget_link(self, link: Link) -> None:
        """``link`` broke: the next call to its callee connects anew."""

    def read_later(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in a reply thread, behind no other slow reply."""


class Link:
    """This peer's connection to one callee, and the calls waiting for its replies."""

    def __init__(
        self, caller: Caller, name: str, address: str, connection: _wire.Connection
    ) -> None:
        self._caller = caller
        self.name = name
        self.address = address
        self.connection = connection
        self.ids = itertools.count()
        self.lock = threading.Lock()
        # call id -> (future, what was called, its timeout's tick or None)
        self.pending: dict[int, tuple[aiopar.Future[Any], str, int | None]] = {}
        self.broken: BaseException | None = None
        connection.serve(caller.hub, _wire.messages(connection, self._on_reply), self.fail_all)

    def call(self, future: aiopar.Future[Any], what: str, frames: Any, timeout: float) -> None:
        with self.lock:
            if self.broken is not None:
                raise aiopar.BrokenWorkerError(str(self.broken)) from self.broken
            call_id = next(self.ids)
            # 0, infinity and more than a lock can wait: no limit (aiopar.rpc gives 0 for all)
            limited = 0 < timeout <= threading.TIMEOUT_MAX
            tick = self._caller.timeouts.add(timeout, self, call_id) if limited else None
            self.pending[call_id] = (future, what, tick)
        deadline = time.monotonic() + timeout if limited else None
        try:
            self.connection.send(
                _wire.CALL, call_id, *frames, deadline=deadline, abandoned=future.done
            )
        except _wire.ConnectionClosed as exc:
            self.fail_all(exc)

    def pop(self, call_id: int) -> tuple[aiopar.Future[Any], str] | None:
        """The call's future and name, unless it was settled already."""
        with self.lock:
            entry = self.pending.pop(call_id, None)
        if entry is None:
            return None
        future, what, tick = entry
        if tick is not None:
            self._caller.timeouts.discard(tick, self, call_id)
        return future, what

    def _on_reply(self, connection: _wire.Connection, kind: int, call_id: int, frames: Any) -> None:
        """In the hub's thread: whatever a reply holds settles that reply's call only."""
        if kind == _wire.VALUE:
            value = _wire.plain(frames)
            if value is not _wire.NOT_PLAIN:
                self._settle(call_id, (value, None, None))
                return
        self._caller.read_later(self._read, call_id, kind, frames)

    def _read(self, call_id: int, kind: int, frames: Any) -> None:
        """In a reply thread: unpickle the reply, and settle its call."""
        # Read before the call's future is at hand: a remote traceback is made
        # of frames whose callers are this stack, so no frame of it may hold
        # the future (a reference cycle: see aiopar's Future).
        self._settle(call_id, read_reply(kind, frames))

    def _settle(self, call_id: int, reply: Reply) -> None:
        entry = self.pop(call_id)
        if entry is not None:  # else it timed out already
            settle_reply(entry[0], reply, entry[1], self.name)

    def fail_all(self, exc: BaseException) -> None:
        """The connection broke: every pending call fails, naming the peer."""
        stopped = self._caller.stopped
        with self.lock:
            if self.broken is None:
                self.broken = stopped or self._gone(exc, "")
            call_ids = list(self.pending)
        self._caller.forget_link(self)
        self.connection.close()
        for call_id in call_ids:
            entry = self.pop(call_id)
            if entry is None:
                continue
            future, what = entry
            if stopped is not None:
                error: BaseException = RuntimeError(
                    f"the call of {what} to {self.name!r} was pending when this peer shut down"
                )
            else:
                error = self._gone(exc, f" while the call of {what} was pending")
            error.__cause__ = exc
            fail(future, error)

    def _gone(self, exc: BaseException, during: str) -> aiopar.BrokenWorkerError:
        return aiopar.BrokenWorkerError(
            f"rpc peer {self.name!r} ({self.address}) has left or died: the connection to it "
            f"broke{during} ({type(exc).__name__}: {exc})"
        )


class Timeouts:
    """Deadlines of pending calls, checked every ``_TICK`` s by one thread,
    which hands the callbacks of the calls it fails to ``run_callbacks``."""

    def __init__(self, run_callbacks: Callable[..., object]) -> None:
        self._run_callbacks = run_callbacks
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # tick -> the calls due then: (link, call id) -> timeout
        self._ticks: dict[int, dict[tuple[Link, int], float]] = {}
        self._heap: list[int] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, timeout: float, link: Link, call_id: int) -> int:
        """Fail the call after ``timeout`` s unless discarded first; return its tick."""
        tick = int((time.monotonic() + timeout) / _TICK) + 1
        with self._lock:
            due = self._ticks.get(tick)
            if due is None:
                due = self._ticks[tick] = {}
                heapq.heappush(self._heap, tick)
                if self._heap[0] == tick:
                    self._wake.notify()
            due[(link, call_id)] = timeout
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="aiopar-rpc-timeouts")
                self._thread.daemon = True
                self._thread.start()
        return tick

    def discard(self, tick: int, link: Link, call_id: int) -> None:
        with self._lock:
            due = self._ticks.get(tick)
            if due is not None:
                due.pop((link, call_id), None)

    def _run(self) -> None:
        set_callback_runner(self._run_callbacks)  # this thread only keeps time
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    if self._heap and self._heap[0] * _TICK <= now:
                        due = self._ticks.pop(heapq.heappop(self._heap))
                        break
                    self._wake.wait(self._heap[0] * _TICK - now if self._heap else None)
            for (link, call_id), timeout in due.items():
                with link.lock:
                    entry = link.pending.pop(call_id, None)
                if entry is not None:
                    future, what, _ = entry
                    error = TimeoutError(
                        f"the call of {what} to rpc peer {link.name!r} had no reply after "
                        f"{timeout:g} s (pass timeout= to the call, or rpc_timeout to "
                        f"init_rpc's options)"
                    )
                    fail(future, error)

    def close(self) -> threading.Thread | None:
        with self._lock:
            self._closed = True
            self._wake.notify()
            return self._thread


# A reply, read: (its value, the exception it carries, what unpickling it raised).
Reply = tuple[Any, BaseException | None, BaseException | None]


def read_reply(kind: int, frames: Any) -> Reply:
    """Unpickle a reply; never raises."""
    try:
        payload = _wire.loads(frames)
        if kind == _wire.VALUE:
            return payload, None, None
        return None, _errors.unpack(payload), None
    except BaseException as cause:  # SystemExit too: it came from the reply, not this process
        return None, None, cause


def settle_reply(future: aiopar.Future[Any], reply: Reply, what: str, peer: str) -> None:
    """Settle a call's future with its reply (see :func:`read_reply`)."""
    value, exc, cause = reply
    if cause is not None:
        exc = TypeError(
            f"the result of {what} came back from rpc peer {peer!r} but cannot be unpickled "
            f"here ({type(cause).__name__}: {cause}); is its class importable in this process?"
        )
        exc.__cause__ = cause
    elif exc is None:
        with contextlib.suppress(aiopar.InvalidStateError):  # cancelled meanwhile
            future.set_result(value)
        return
    else:
        exc.add_note(f"(raised by {what} on rpc peer {peer!r})")
    fail(future, exc)


def fail(future: aiopar.Future[Any], error: BaseException) -> None:
    with contextlib.suppress(aiopar.InvalidStateError):
        future.set_exception(error)
