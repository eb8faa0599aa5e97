"""fork/wait, the functions that combine futures, and drain."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Iterator
from types import TracebackType
from typing import Any, NoReturn, ParamSpec, TypeVar, overload

import anyio

from . import _loop, _waiter
from ._blocking import check_timeout
from ._config import current_backend
from ._future import (
    Future,
    add_callback,
    block_until_done,
    copy_outcome,
    failed,
    first_failed,
    retrieve,
    settle,
    until_done,
    values,
)
from ._interop import describe_type, has_future_protocol, not_a_future_message
from .backends import _exit

__all__ = [
    "TaskGroup",
    "as_completed",
    "collect_all",
    "drain",
    "fork",
    "map",
    "task_group",
    "wait",
    "wait_all",
    "wrap",
]

T = TypeVar("T")
P = ParamSpec("P")


@overload
def fork(
    fn: Callable[P, Coroutine[Any, Any, T]], /, *args: P.args, **kwargs: P.kwargs
) -> Future[T]: ...
@overload
def fork(fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]: ...
def fork(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
    """Start ``fn(*args, **kwargs)`` on the current backend and return its future at once.

    ``fn`` may be a function, a bound method or any callable object. A
    coroutine function runs on an event loop: the caller's running loop if
    there is one, else a loop thread owned by aiopar. Every keyword argument
    goes to ``fn``.
    """
    return current_backend().fork(fn, *args, **kwargs)


def map(
    fn: Callable[..., T], /, *iterables: Iterable[Any], chunksize: int | None = None
) -> list[Future[T]]:
    """Start ``fn(*args)`` for each ``args`` of ``zip(*iterables)`` on the
    current backend and return one future per item at once, in order.

    The cheap way to fork many small calls: items run in chunks, each one
    task with one context (see :meth:`aiopar.Backend.map`, which does the
    same on a named backend). An item's failure fails its own future only,
    and a future cancelled before its chunk reaches it is skipped.
    """
    return current_backend().map(fn, *iterables, chunksize=chunksize)


def wait(fut: Future[T], timeout: float | None = None) -> T:
    """``fut.wait(timeout)``: block until done, then return the value or raise."""
    if not isinstance(fut, Future):
        _refuse(fut, "wait()")
    return fut.wait(timeout)


def _refuse(obj: object, where: str) -> NoReturn:
    """Raise the TypeError of ``where`` given ``obj``, which is no aiopar
    Future. The callers test for one themselves: a batch of forks pays no
    call per future."""
    raise TypeError(not_a_future_message(obj, where))


def _future_list(futs: Iterable[Future[Any]], where: str) -> list[Future[Any]]:
    if isinstance(futs, Future):
        raise TypeError(f"{where} takes an iterable of futures, got a single Future")
    futures = list(futs)
    for fut in futures:
        if not isinstance(fut, Future):
            _refuse(fut, where)
    return futures


def collect_all(futs: Iterable[Future[T]]) -> Future[list[Future[T]]]:
    """A future that is done once every future in ``futs`` is done.

    Its value is the list of the futures themselves, in order; it never
    fails, whatever they did (``torch.futures.collect_all`` fails with the
    first error once all are done: see docs/then.md).
    """
    futures = _future_list(futs, "collect_all()")
    return _when_all(futures, futures)


def wait_all(futs: Iterable[Future[T]]) -> list[T]:
    """Wait for every future and return their values in order.

    Raises as soon as one fails: the exception of the first failed future
    in list order among those done by then (as ``torch.futures.wait_all``
    documents it; torch 2's waits for every future first). The calling
    thread runs a task that has not started only once its future is the
    last one not done, as a task it ran could not be stopped when another
    failed meanwhile (a pool's worker first runs the tasks it forked that
    are still queued, as it does before any wait).
    """
    futures = _future_list(futs, "wait_all()")
    del futs
    index = first_failed(futures)
    if index is not None:
        failure = futures[index]
        # A failure's traceback holds this frame: it keeps no future (see Future).
        futures.clear()
        try:
            failure.value()  # raises: it failed or was cancelled
        finally:
            del failure
    return values(futures)


def _when_all(futures: list[Future[Any]], value: T) -> Future[T]:
    """A future settled with ``value`` once all of ``futures`` are done."""
    outcome: Future[T] = Future()
    remaining = len(futures)
    lock = threading.Lock()

    def one_done(_: Future[Any]) -> None:
        nonlocal remaining
        with lock:
            remaining -= 1
            last = remaining == 0
        if last:
            settle(outcome, value, None)

    if not futures:
        settle(outcome, value, None)
    for fut in futures:
        add_callback(fut, one_done)
    return outcome


class _AsCompleted(Iterator[Future[T]], AsyncIterator[Future[T]]):
    """Yields futures as they finish, with ``for`` and with ``async for``."""

    def __init__(self, futs: Iterable[Future[T]], timeout: float | None) -> None:
        futures = list(dict.fromkeys(_future_list(futs, "as_completed()")))
        timeout = check_timeout(timeout)  # None for "for ever", also when huge
        self._total = self._remaining = len(futures)
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.Lock()
        self._finished: deque[Future[T]] = deque()
        self._signal: Future[None] | None = None
        for fut in futures:
            fut.add_done_callback(self._on_done)

    def _on_done(self, fut: Future[T]) -> None:
        with self._lock:
            self._finished.append(fut)
            signal, self._signal = self._signal, None
        if signal is not None:
            settle(signal, None, None)

    def _next_or_signal(self) -> tuple[Future[T] | None, Future[None]]:
        if self._remaining == 0:
            raise StopIteration
        with self._lock:
            if self._finished:
                self._remaining -= 1
                return self._finished.popleft(), None  # type: ignore[return-value]
            self._signal = Future()
            return None, self._signal

    def _time_left(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def _timed_out(self) -> TimeoutError:
        return TimeoutError(
            f"{self._remaining} of {self._total} futures are still not done after {self._timeout} s"
        )

    def __iter__(self) -> _AsCompleted[T]:
        return self

    def __next__(self) -> Future[T]:
        while True:
            fut, signal = self._next_or_signal()
            if fut is not None:
                return fut
            if not block_until_done(signal, self._time_left()):
                raise self._timed_out()

    def __aiter__(self) -> _AsCompleted[T]:
        return self

    async def __anext__(self) -> Future[T]:
        while True:
            try:
                fut, signal = self._next_or_signal()
            except StopIteration:
                raise StopAsyncIteration from None
            if fut is not None:
                return fut
            with anyio.move_on_after(self._time_left()):
                await until_done(signal)
            if not signal.done():
                raise self._timed_out()


def as_completed(futs: Iterable[Future[T]], timeout: float | None = None) -> _AsCompleted[T]:
    """Yield each future once it is done, in the order they finish.

    Works with ``for`` and ``async for``. Duplicates are yielded once. If
    ``timeout`` seconds pass (counted from this call) before all are done,
    the iteration raises TimeoutError.
    """
    return _AsCompleted(futs, timeout)


def wrap(obj: Any) -> Future[Any]:
    """Adopt a ``concurrent.futures.Future``, an asyncio future, anything
    with the ``concurrent.futures`` callback protocol (a ``dask.distributed``
    Future), a ``torch.futures.Future``, or any awaitable.

    The returned future settles when the original does. Cancelling it
    cancels the original (a torch future has no cancel: it runs on). An
    awaitable that is not a future runs on the caller's event loop if one
    is running, else on aiopar's loop thread.
    """
    if isinstance(obj, Future):
        return obj
    adopted: Future[Any] = Future()
    if asyncio.isfuture(obj):
        obj.add_done_callback(lambda src: copy_outcome(src, adopted))
        loop = obj.get_loop()
        adopted.add_done_callback(
            lambda fut: fut.cancelled() and loop.call_soon_threadsafe(obj.cancel)
        )
    elif has_future_protocol(obj):
        # Before the awaitable case: a dask Future of a synchronous client
        # is awaitable only on that client's own loop.
        obj.add_done_callback(lambda src: copy_outcome(src, adopted))
        adopted.add_done_callback(lambda fut: fut.cancelled() and obj.cancel())
    elif inspect.isawaitable(obj):

        async def await_it() -> Any:
            return await obj

        _loop.start_coroutine(adopted, await_it, (), {}, contextvars.copy_context())
    elif all(callable(getattr(obj, name, None)) for name in ("add_done_callback", "wait", "then")):
        # torch's protocol (torch.futures.Future): wait() returns the value or raises
        obj.add_done_callback(lambda src: _copy_waited(src, adopted))
    else:
        raise TypeError(
            "wrap() takes a concurrent.futures.Future (or an object with its add_done_callback, "
            "result, exception, cancelled and cancel), an asyncio future, a torch future or an "
            f"awaitable, got {describe_type(obj)}; to run a function, use aiopar.fork(fn, *args)"
        )
    return adopted


def _copy_waited(source: Any, target: Future[Any]) -> None:
    """Settle ``target`` as ``source``, a done torch future, was settled."""
    try:
        settle(target, source.wait(), None)
    except BaseException as error:
        settle(target, None, error)
        del source, target  # the error's traceback holds this frame: no cycle (see Future)


def drain() -> Future[None]:
    """Run what is queued on aiopar's backends: a future that is done once
    every live backend of this process has run what was queued when this
    was called, and what those tasks forked.

    For an application that stops where interpreter exit cannot drain for
    it: a process ended by a signal's default action runs no exit hook, and
    uvicorn ends its graceful shutdown so, by raising SIGTERM again. Write
    ``await aiopar.drain()`` in the application's shutdown (a lifespan's
    end), or ``aiopar.drain().wait()`` in a script.

    - Every backend is drained as its :meth:`Backend.drain` drains it, round
      after round, as interpreter exit does, until none had anything left, so
      a task may fork on any backend (coroutine forks on aiopar's own loop
      included). The backends stay open: a fork made meanwhile runs too,
      and a steady stream of them delays the end.
    - The draining runs on a thread of its own, never on a pool it drains
      nor on the caller's event loop: awaiting the future suspends only
      the awaiting coroutine. Cancelling the future (a cancelled ``await``)
      ends the waiting, not the draining.
    - Tasks that are running are waited for: one that waits for something
      the caller does after the drain keeps it from ending.

    Raises RuntimeError in a thread that runs aiopar tasks (a pool's
    worker, a done-callback it runs, aiopar's own event loop): the drain
    would wait for the very task that waits for it.
    """
    if _waiter.get_waiter() is not None or _loop.on_owned_loop():
        raise RuntimeError(
            f"aiopar.drain() was called in {threading.current_thread().name!r}, a thread "
            f"that runs aiopar tasks: it waits until every task has run, the one running "
            f"here included, so it would never end. Call it where the application stops "
            f"(a lifespan's shutdown, the end of a script), outside any forked task and "
            f"its callbacks"
        )
    drained: Future[None] = Future()
    threading.Thread(target=_drain_into, args=(drained,), name="aiopar-drain", daemon=True).start()
    return drained


def _drain_into(drained: Future[None]) -> None:
    """Drain every live backend (see :func:`drain`), then settle ``drained``."""
    try:
        _exit.drain_every_backend()
    except BaseException as exc:
        settle(drained, None, exc)
        del drained  # the exception's traceback holds this frame: no cycle (see Future)
    else:
        settle(drained, None, None)


class TaskGroup:
    """Structured fork-join: every task forked through the group is waited for
    when the ``with`` or ``async with`` block ends.

    The first task to fail cancels the group's tasks that have not started;
    on exit the failure is raised, or an ExceptionGroup when several tasks
    (or the block and a task) failed (a BaseExceptionGroup if one of them
    raised a BaseException such as SystemExit). If the block itself raises, tasks not
    yet started are cancelled and the running ones are waited for.
    """

    def __init__(self) -> None:
        self._futures: list[Future[Any]] = []
        self._lock = threading.Lock()
        self._exited = False

    @overload
    def fork(
        self, fn: Callable[P, Coroutine[Any, Any, T]], /, *args: P.args, **kwargs: P.kwargs
    ) -> Future[T]: ...
    @overload
    def fork(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]: ...
    def fork(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """Like :func:`aiopar.fork`, for a task the group waits for."""
        if self._exited:
            raise RuntimeError("this task group has exited; fork inside its 'with' block")
        fut = fork(fn, *args, **kwargs)
        with self._lock:
            self._futures.append(fut)
        fut.add_done_callback(self._on_done)
        return fut

    def _on_done(self, fut: Future[Any]) -> None:
        if failed(fut):
            self._cancel_pending()

    def _cancel_pending(self) -> None:
        with self._lock:
            futures = list(self._futures)
        for fut in futures:
            fut.cancel()

    def __enter__(self) -> TaskGroup:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is not None:
            self._cancel_pending()
        for fut in self._futures:
            block_until_done(fut, None)
            # The thread that settled a failure runs this too, but only after
            # it has woken this one, which would otherwise run the next
            # unstarted task itself meanwhile.
            self._on_done(fut)
        return self._finish(exc)

    async def __aenter__(self) -> TaskGroup:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is not None:
            self._cancel_pending()
        try:
            for fut in self._futures:
                await until_done(fut)
        except BaseException:
            self._cancel_pending()
            raise
        return self._finish(exc)

    def _finish(self, exc: BaseException | None) -> bool:
        self._exited = True
        failures = [
            error
            for fut in self._futures
            if not fut.cancelled() and (error := retrieve(fut)) is not None
        ]
        if not failures:
            return False  # the block's own exception, if any, propagates
        if exc is not None and not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, cancellation and the like win
        errors = [exc, *failures] if exc is not None else failures
        if len(errors) == 1:
            raise errors[0]
        # An ExceptionGroup when every error is an Exception, else (a task
        # raised SystemExit, say) a BaseExceptionGroup, which may hold any.
        raise BaseExceptionGroup(f"{len(errors)} errors in a task group", errors)


def task_group() -> TaskGroup:
    """A :class:`TaskGroup` for ``with`` or ``async with``."""
    return TaskGroup()
