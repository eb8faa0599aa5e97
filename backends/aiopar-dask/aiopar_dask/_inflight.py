"""A backend's tasks in flight: sent to the cluster in batches, settled as they complete.

A task sent while no other of the backend is in flight (a fork waited for
at once) goes to dask at once, from the sending thread: the quickest way.
Tasks sent while others are in flight go out together on the client's loop,
one ``client.map`` per batch: one graph and one ``update-graph`` message
for all of them, where dask's ``submit`` costs one each (a fifth of a no-op
task's cost on a 2-core machine). Their results come back in groups
(``_results``), and their futures settle on the client's loop as each group
arrives, so a thread waiting for one wakes from there, as from dask's own
``result()``; their done-callbacks run in a settler thread, never on dask's
loop (``set_callback_runner``).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import distributed
from distributed import KilledWorker
from distributed.client import FutureCancelledError

import aiopar
from aiopar.backends import Task
from aiopar.lowlevel import set_callback_runner

from ._errors import RemoteFailure, unpack
from ._results import Done, Results
from ._settle import Settler

__all__ = ["Chunk", "Fork", "InFlight"]

# What a task runs: a function of _worker, then its arguments (the nested
# backend's factory, the user's function and arguments as an Opaque, ...).
Call = tuple[Any, ...]


class Fork:
    """A fork: one task, one future (and its profiler record, if one is on)."""

    __slots__ = ("cancel", "future", "key", "record")

    def __init__(self, key: str, future: aiopar.Future[Any], record: Any) -> None:
        self.key, self.future, self.record = key, future, record
        # the future's done-callback that cancels the dask task, once it is sent
        self.cancel: Callable[[aiopar.Future[Any]], None] | None = None

    @property
    def futures(self) -> list[aiopar.Future[Any]]:
        return [self.future]

    def settle(self, value: Any, exc: BaseException | None) -> None:
        """Settle the future with what the task gave: its value (with the
        worker's times, when timed), a :class:`RemoteFailure`, or ``exc``."""
        if exc is not None:
            outcome: tuple[Any, BaseException | None] = (None, translate(exc, self.key))
        elif type(value) is RemoteFailure:  # the task's own exception (see run_task)
            outcome = (None, unpack(value.packed))
        else:
            if self.record is not None:
                value, t0, t1, pid, tid, worker = value
                offset = time.time_ns() - time.perf_counter_ns()
                where = f"dask worker {worker}"
                self.record.on_remote_run(t0 - offset, t1 - offset, pid, tid, where)
            outcome = (value, None)
        if self.cancel is not None:
            # The task is over: its cancel hook has nothing left to do, and
            # kept, it would be a callback to hand to a settler thread.
            self.future.remove_done_callback(self.cancel)
        Task.settle(self.future, outcome)


class Chunk:
    """A chunk of ``map``: one task, a future per item."""

    __slots__ = ("futures", "key")

    def __init__(self, key: str, futures: list[aiopar.Future[Any]]) -> None:
        self.key, self.futures = key, futures

    def settle(self, values: Any, exc: BaseException | None) -> None:
        """Settle each item's future with its value or its own failure
        (``exc`` fails them all); an item the chunk did not reach, as a
        ``BaseException`` ended it there, is cancelled."""
        if exc is not None:
            error = translate(exc, self.key)
            for future in self.futures:
                Task.settle(future, (None, error))
            return
        for future, value in zip(self.futures, values, strict=False):
            if type(value) is RemoteFailure:
                Task.settle(future, (None, unpack(value.packed)))
            else:
                Task.settle(future, (value, None))
        for future in self.futures[len(values) :]:
            future.cancel()


Sent = Fork | Chunk


class InFlight:
    """What a backend has sent and not settled yet, by dask key."""

    def __init__(self, settler: Settler) -> None:
        self._settler = settler
        self._lock = threading.Lock()
        self._sent: dict[object, Sent] = {}
        self._outbox: list[tuple[Sent, Call]] = []  # not handed to dask yet
        self._results: Results | None = None

    def send(self, client: distributed.Client, sent: Sent, call: Call) -> None:
        """Have dask run ``call[0](*call[1:])`` under ``sent.key``; settle
        ``sent`` with what it gives. Returns at once; any thread."""
        with self._lock:
            alone = not self._sent  # nothing else in flight: no batch to wait for
            self._sent[sent.key] = sent
            if not alone:
                self._outbox.append((sent, call))
                if len(self._outbox) > 1:  # a flush is on its way
                    return
        if alone:
            future = self._submit_alone(client, sent, call)
            if future is not None:
                self._expect(client, [(sent, future)])
            return
        loop = client.loop
        assert loop is not None  # (a client that has started)
        loop.add_callback(self._flush, client)

    def _flush(self, client: distributed.Client) -> None:
        """On the client's loop: hand what was sent since the last flush to
        dask, a ``client.map`` per function; what was cancelled meanwhile is
        not sent."""
        with self._lock:
            outbox, self._outbox = self._outbox, []
        batches: dict[Callable[..., Any], list[tuple[Sent, Call]]] = {}
        for sent, call in outbox:
            if all(future.cancelled() for future in sent.futures):
                self._forget([sent.key])
            else:
                batches.setdefault(call[0], []).append((sent, call))
        for runner, batch in batches.items():
            columns = [
                list(column) for column in zip(*(call[1:] for _, call in batch), strict=True)
            ]
            keys = [sent.key for sent, _ in batch]
            futures: Sequence[distributed.Future[Any] | None]
            try:
                futures = client.map(runner, *columns, key=keys, pure=False)
            except Exception:  # one call does not pickle, say: each alone, so it fails alone
                futures = [self._submit_again(client, sent, call) for sent, call in batch]
            handed = [(s, f) for (s, _), f in zip(batch, futures, strict=True) if f is not None]
            self._expect(client, handed)

    def _submit_alone(
        self, client: distributed.Client, sent: Sent, call: Call
    ) -> distributed.Future[Any] | None:
        """Submit one call; None if dask refuses it (its futures fail with why)."""
        try:
            future: distributed.Future[Any] = client.submit(*call, key=sent.key, pure=False)
        except Exception as exc:
            self._forget([sent.key])
            fn = call[2].value[0]
            what = getattr(fn, "__qualname__", None) or type(fn).__qualname__
            error = TypeError(
                f"{what}() cannot be sent to the cluster ({type(exc).__name__}: {exc}); "
                f"its function and arguments must pickle"
            )
            error.__cause__ = exc
            self._settler.call(sent.settle, None, error)
            return None
        return future

    def _submit_again(
        self, client: distributed.Client, sent: Sent, call: Call
    ) -> distributed.Future[Any] | None:
        """Submit alone one call of a batch that dask refused."""
        # A key of its own: the failed batch's futures may hold the old one a while.
        with self._lock:
            del self._sent[sent.key]
            sent.key = f"{sent.key}-alone"
            self._sent[sent.key] = sent
        return self._submit_alone(client, sent, call)

    def _expect(
        self, client: distributed.Client, sent: list[tuple[Sent, distributed.Future[Any]]]
    ) -> None:
        with self._lock:  # (sends from several threads, and flushes)
            if self._results is None:
                self._results = Results(client, self._settle)
            results = self._results
        for entry, future in sent:
            if isinstance(entry, Fork):  # cancelling a fork cancels its task
                entry.cancel = functools.partial(_cancel_if_cancelled, client, future)
                entry.future.add_done_callback(entry.cancel)
        results.expect([future for _, future in sent])

    def _settle(self, done: Done) -> None:
        """On the client's loop: settle what a group of completed tasks gave.
        The futures' callbacks run in a settler thread, each future's as a
        settler call of its own, so one that blocks holds up neither dask's
        loop nor another future of the group."""
        sent = self._forget([future.key for future, _, _ in done])
        set_callback_runner(self._settler.call)
        try:
            for entry, (_, value, exc) in zip(sent, done, strict=True):
                if entry is not None:
                    entry.settle(value, exc)
        finally:
            set_callback_runner(None)

    def _forget(self, keys: list[object]) -> list[Sent | None]:
        with self._lock:
            return [self._sent.pop(key, None) for key in keys]

    def futures(self) -> list[aiopar.Future[Any]]:
        """The futures not settled yet."""
        with self._lock:
            return [future for sent in self._sent.values() for future in sent.futures]

    def fail_all(self, error: BaseException) -> None:
        """The client is gone: every future not settled yet fails with ``error``."""
        with self._lock:
            sent, self._sent = list(self._sent.values()), {}
        for entry in sent:
            for future in entry.futures:
                Task.settle(future, (None, error))


def _cancel_if_cancelled(
    client: distributed.Client, dask_future: distributed.Future[Any], future: aiopar.Future[Any]
) -> None:
    if future.cancelled():
        loop = client.loop
        assert loop is not None
        loop.add_callback(client.cancel, [dask_future], asynchronous=True)


def translate(exc: BaseException, key: object) -> BaseException:
    """dask's exception for a task, as aiopar raises it."""
    error: BaseException
    if isinstance(exc, KilledWorker):
        error = aiopar.BrokenWorkerError(
            f"the dask workers that ran task {key!r} died each time (dask gave up: {exc})"
        )
        error.__cause__ = exc
        return error
    if isinstance(exc, FutureCancelledError):
        error = aiopar.CancelledError(f"dask cancelled task {key!r}: {exc}")
        error.__cause__ = exc
        return error
    return exc
