"""Executor: a concurrent.futures.Executor over any aiopar backend."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar

from ._blocking import cf_timeout
from ._checks import check_count
from ._config import get_backend
from ._future import Future
from .backends import Backend

__all__ = ["Executor"]

T = TypeVar("T")
P = ParamSpec("P")


class Executor(concurrent.futures.Executor):
    """A :class:`concurrent.futures.Executor` whose futures are aiopar Futures.

    What ``loop.run_in_executor`` and other code written for executors take:
    :meth:`submit` forks on the backend and returns an aiopar :class:`Future`
    (which ``wait``, ``await`` and ``then`` take too), and :meth:`map` runs
    the calls in chunks and yields their results in order.

    ``backend`` is a backend's name, with ``max_workers`` as
    ``aiopar.get_backend(name, max_workers=...)`` takes it, or a
    :class:`Backend`. Either way the backend is shared, as aiopar's backends
    are, by every Executor and fork on it: shutting an Executor down retires
    the Executor, never its backend, whose workers aiopar stops at
    interpreter exit (or whoever calls ``backend.shutdown()``).
    """

    def __init__(self, backend: str | Backend = "thread", max_workers: int | None = None) -> None:
        if isinstance(backend, Backend):
            if max_workers is not None:
                raise TypeError(
                    f"Executor(backend, max_workers=...) takes max_workers with a backend name; "
                    f"{backend!r} has its workers already"
                )
            self._backend = backend
        elif isinstance(backend, str):
            check_count(max_workers, "max_workers", none="the backend's own default")
            self._backend = _named_backend(backend, max_workers)
        else:
            raise TypeError(
                f"Executor() takes a backend name or an aiopar Backend, "
                f"got {type(backend).__name__} {backend!r:.60}"
            )
        # Reentrant: a task that the inline backend runs within submit() may submit.
        self._lock = threading.RLock()
        self._shut_down = False
        # Weakly: a future its caller dropped, done, goes (with its result).
        self._futures: weakref.WeakSet[Future[Any]] = weakref.WeakSet()

    @property
    def backend(self) -> Backend:
        """The backend the calls run on."""
        return self._backend

    def __repr__(self) -> str:
        state = "shut down" if self._shut_down else "running"
        return f"<aiopar.Executor {state} on {self._backend!r}>"

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """Start ``fn(*args, **kwargs)`` on the backend and return its future at once.

        Raises RuntimeError once the Executor, or its backend, is shut down.
        """
        with self._lock:
            self._check_open()
            fut = self._backend.fork(fn, *args, **kwargs)
            self._futures.add(fut)
        return fut

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int | None = 1,
    ) -> Iterator[T]:
        """``map(fn, *iterables)`` with every call started at once; the
        results come in order.

        Calls run in chunks of ``chunksize`` items, one task each (None: the
        backend picks, as :func:`aiopar.map` does). Reading a result raises
        what its call raised, or TimeoutError once ``timeout`` seconds have
        passed since this call; the calls not done then are cancelled if they
        have not started, as they are when the iterator is closed early.
        """
        wait_for = cf_timeout(timeout)  # None: for ever
        deadline = None if wait_for is None else time.monotonic() + wait_for
        with self._lock:
            self._check_open()
            futures = self._backend.map(fn, *iterables, chunksize=chunksize)
            self._futures.update(futures)
        return _results_in_order(futures, deadline)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; the backend goes on serving others.

        With ``cancel_futures``, calls of this Executor that have not
        started never do. With ``wait``, returns once every call of this
        Executor is done (the calling thread runs those still queued).
        Calling it again does no harm.
        """
        with self._lock:
            self._shut_down = True
            futures = [fut for fut in self._futures if not fut.done()]
        if cancel_futures:
            for fut in futures:
                fut.cancel()
        if wait:
            for fut in futures:
                fut._block(None)

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError(f"cannot schedule new futures after shutdown of {self!r}")
        if self._backend.closed:
            raise RuntimeError(
                f"cannot schedule new futures: the backend of {self!r} has been shut down "
                f"(at interpreter exit, or by its backend.shutdown())"
            )


def _named_backend(name: str, max_workers: int | None) -> Backend:
    if max_workers is None:
        return get_backend(name)
    try:
        return get_backend(name, max_workers=max_workers)
    except TypeError as exc:
        raise TypeError(
            f"Executor({name!r}, max_workers={max_workers}): the {name!r} backend takes "
            f"no max_workers ({exc})"
        ) from exc


def _results_in_order(futures: list[Future[T]], deadline: float | None) -> Iterator[T]:
    """The value of each of ``futures`` in turn, holding none it has
    yielded; those not read when it ends are cancelled (unless started)."""
    futures.reverse()
    try:
        while futures:
            yield _result_or_cancel(futures.pop(), deadline)
    finally:
        for fut in futures:
            fut.cancel()


def _result_or_cancel(fut: Future[T], deadline: float | None) -> T:
    try:
        return fut.result(None if deadline is None else deadline - time.monotonic())
    except BaseException:
        fut.cancel()  # it timed out: unless it has started, it never will
        raise
    finally:
        del fut  # the exception's traceback holds this frame: no cycle (see Future)
