"""Executor: a concurrent.futures.Executor over any aiopar backend."""

from __future__ import annotations

import concurrent.futures
import inspect
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar

from ._blocking import cf_timeout
from ._checks import check_count
from ._config import get_backend
from ._future import Future, block_until_done
from .backends import Backend
from .backends import _factory as backend_factory

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
    :class:`Backend`. Such a backend is shared, as aiopar's backends are,
    by every Executor and fork on it: shutting an Executor down retires
    the Executor, never its backend, whose workers aiopar stops at
    interpreter exit (or whoever calls ``backend.shutdown()``).

    The keywords of :class:`~concurrent.futures.ThreadPoolExecutor` and
    :class:`~concurrent.futures.ProcessPoolExecutor` set its workers up, and
    then the Executor gets a pool of its own, which its :meth:`shutdown`
    (or its collection) stops: ``thread_name_prefix``, ``initializer`` and
    ``initargs`` on "thread"; ``mp_context``, ``initializer``, ``initargs``
    and ``max_tasks_per_child`` on "process". Each worker calls
    ``initializer(*initargs)`` before its first call; if that raises, the
    calls fail with a :class:`~concurrent.futures.BrokenExecutor`: a thread
    pool is broken, and its pending and later calls fail with
    ``BrokenThreadPool``; a process worker logs the error and exits, which
    breaks its pool: the pending and later calls fail with
    ``BrokenProcessPool``, and no worker starts after it.
    Process workers always start as fresh
    interpreters, as the "spawn" start method does; an ``mp_context`` of
    "fork" starts them so too (they do not inherit this process's memory).
    A backend that lacks an option raises TypeError naming it.
    """

    def __init__(
        self,
        backend: str | Backend = "thread",
        max_workers: int | None = None,
        *,
        thread_name_prefix: str | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        mp_context: Any = None,
        max_tasks_per_child: int | None = None,
    ) -> None:
        options = _worker_options(
            thread_name_prefix=thread_name_prefix or None,  # "": the default names, as cf's
            initializer=initializer,
            initargs=tuple(initargs),
            mp_context=mp_context,
            max_tasks_per_child=max_tasks_per_child,
        )
        self._own_backend = bool(options)
        if isinstance(backend, Backend):
            given = [*(["max_workers"] if max_workers is not None else []), *options]
            if given:
                raise TypeError(
                    f"Executor(backend, {'=..., '.join(given)}=...): {', '.join(given)} go "
                    f"with a backend name; {backend!r} has its workers already"
                )
            self._backend = backend
        elif isinstance(backend, str):
            check_count(max_workers, "max_workers", none="the backend's own default")
            self._backend = _named_backend(backend, max_workers, options)
        else:
            raise TypeError(
                f"Executor() takes a backend name or an aiopar Backend, "
                f"got {type(backend).__name__} {backend!r:.60}"
            )
        if self._own_backend:
            # Dropped without shutdown(), as concurrent.futures' executors
            # are: its workers run what was submitted, then stop.
            weakref.finalize(self, self._backend.shutdown, wait=False)
        # Reentrant: a task that the inline backend runs within submit() may submit.
        self._lock = threading.RLock()
        self._shut_down = False
        # Weakly: a future its caller dropped, done, goes (with its result).
        self._futures: weakref.WeakSet[Future[Any]] = weakref.WeakSet()

    @property
    def backend(self) -> Backend:
        """The backend the calls run on."""
        return self._backend

    @property
    def _max_workers(self) -> int:
        """How many calls may run at once: the name concurrent.futures'
        executors give it, which dask reads of any executor."""
        return self._backend.max_workers

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
        """Take no more calls; a shared backend goes on serving others.

        With ``cancel_futures``, calls of this Executor that have not
        started never do; a call a worker has begun runs to its end. With
        ``wait``, returns once every call of this Executor is done (the
        calling thread runs those still queued), and, if the Executor has
        a pool of its own, once its workers have stopped. Calling it again
        does no harm.
        """
        with self._lock:
            self._shut_down = True
            futures = [fut for fut in self._futures if not fut.done()]
        if cancel_futures:
            for fut in futures:
                fut.cancel()
        if self._own_backend:
            self._backend.shutdown(wait=wait)
        elif wait:
            for fut in futures:
                block_until_done(fut, None)

    def _check_open(self) -> None:
        if self._shut_down:
            raise RuntimeError(f"cannot schedule new futures after shutdown of {self!r}")
        # A pool of the Executor's own that is closed and not shut down is
        # broken (an initializer raised): its fork raises BrokenExecutor.
        if self._backend.closed and not self._own_backend:
            raise RuntimeError(
                f"cannot schedule new futures: the backend of {self!r} has been shut down "
                f"(at interpreter exit, or by its backend.shutdown())"
            )


def _worker_options(**given: Any) -> dict[str, Any]:
    """The worker options of concurrent.futures' executors given a value of their own."""
    return {name: value for name, value in given.items() if value is not None and value != ()}


def _named_backend(name: str, max_workers: int | None, options: dict[str, Any]) -> Backend:
    """The backend called ``name``: the one get_backend() shares, or with
    worker ``options`` a new one of the Executor's own."""
    sized = {} if max_workers is None else {"max_workers": max_workers}
    factory = backend_factory(name)
    try:
        inspect.signature(factory).bind(**sized, **options)
    except TypeError as exc:
        given = ", ".join(f"{key}={value!r:.40}" for key, value in {**sized, **options}.items())
        raise TypeError(
            f"Executor({name!r}, {given}): the {name!r} backend does not take it ({exc})"
        ) from None
    if options:
        # Workers set up in a way of their own serve their Executor only.
        return factory(**sized, **options)
    return get_backend(name, **sized)


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
