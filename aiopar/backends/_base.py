"""The Backend ABC: the one contract every backend, built-in or plugin, implements.

A backend decides where forked work runs. :meth:`Backend.fork` wraps the call
in a :class:`Task` whose future it returns at once and hands the task to
:meth:`Backend.enqueue`; the backend arranges for :meth:`Task.run` to be called
exactly once (in a worker thread, a worker process, or right away). Because
``Task.run`` claims the future first, a task cancelled or already run by a
waiter is skipped, so a backend needs no bookkeeping for either.
"""

from __future__ import annotations

import functools
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from contextvars import Context, copy_context
from types import BuiltinFunctionType, FunctionType, MethodType
from typing import Any, ClassVar, NoReturn, TypeVar

from .. import _loop, _trace
from .._checks import check_count, check_initializer
from .._errors import CancelledError
from .._future import Future, add_callback, claim, retrieve, settle
from .._interrupt import on_main_thread
from . import _exit

__all__ = ["Backend", "Task", "check_count", "check_initializer", "chunk_size"]

T = TypeVar("T")

_CO_COROUTINE = inspect.CO_COROUTINE
_NO_KWARGS: dict[str, Any] = {}  # never changed: Task.run only unpacks it


class Task:
    """One forked call: what to run, on which backend, and its profiler record.

    ``context`` is the :mod:`contextvars` context the call runs in, a copy
    of the forking thread's; None for a copy with no variable set, which
    the call gets as a fresh context made as it runs (see :meth:`call`).
    """

    __slots__ = ("args", "backend", "context", "fn", "future", "kwargs", "record")

    def __init__(
        self,
        future: Future[Any],
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        context: Context | None,
        backend: Backend,
    ) -> None:
        self.future: Future[Any] | None = future
        self.fn = fn
        self.args = args
        self.kwargs = kwargs
        self.context = context
        self.backend = backend
        self.record: Any = None

    @property
    def name(self) -> str:
        fn = self.fn
        return getattr(fn, "__qualname__", None) or type(fn).__qualname__

    @property
    def stealable(self) -> bool:
        """Whether a thread waiting on the future may run the task itself."""
        return self.backend.stealable

    def runs_on_this_thread(self) -> bool:
        """Whether only the calling thread could run the task, so waiting
        for it here would never end (a coroutine on this thread's loop)."""
        return False

    def run(
        self,
        context: Context | None = None,
        starting: Callable[[], Callable[[], object] | None] | None = None,
    ) -> None:
        """Run the call in this thread and settle the future, unless the task
        was cancelled or another thread claimed it first.

        Every thread that runs a task runs it here: a pool's worker, a
        thread that waits for it, the inline backend. The call runs in the
        task's context; a task forked with no context variable set runs in
        ``context`` if given (a pool's worker passes its own empty one, and
        must replace it once a call leaves a variable set in it), else in a
        fresh one. ``starting``, if given, is called once the task is
        claimed, before the call (the thread's accounting in the budget),
        and what it returns, if not None, once the call is over, whatever
        it raised. The profiler's record, if any, starts and ends around
        the call. Nothing the call raises escapes, but a Ctrl-C that
        interrupted the main thread running it (see :meth:`settle`).
        """
        # claim(), without its call: this is the one Python call a pool's
        # worker makes per task besides the task's function and its
        # future's (tests/test_overhead.py counts them);
        # tests/test_task.py checks that the two claim alike.
        future = self.future
        if future is None or not claim(future):
            return
        self.future = None
        args, kwargs, record = self.args, self.kwargs, self.record
        ended = None
        exception: BaseException | None
        try:
            # Inside the try: should the accounting or the profiler raise
            # (an error of aiopar's own), the future fails with it rather
            # than stay running for ever.
            if starting is not None:
                ended = starting()
            if record is not None:
                record.on_start()
            context = self.context or context  # an empty context is false
            if context is None:
                context = Context()
            # No "*" without arguments, no "**" without keywords: each
            # builds a tuple or a dict for the call.
            if kwargs:
                result = context.run(self.fn, *args, **kwargs)
            else:
                result = context.run(self.fn, *args) if args else context.run(self.fn)
        except BaseException as exc:
            result, exception = None, exc
        else:
            exception = None
        # Drop the call before settling: callbacks may run for a long time.
        self.fn = self.args = self.kwargs = None  # type: ignore[assignment]
        del args, kwargs
        if record is not None:
            record.on_end()
        if ended is not None:
            ended()
        if exception is None:
            settle(future, result, None)
        else:
            self.settle(future, (None, exception))
        del future, exception  # a failure's traceback holds this frame: no cycle (see Future)

    def claim(self) -> Future[Any] | None:
        """The future, now RUNNING, if this thread may run the task; else None.
        For a thread that runs the task elsewhere (a worker process): one
        that runs it here calls :meth:`run`, which claims it first."""
        future = self.future
        if future is None or not claim(future):
            return None
        # A queue may hold this task a while after a waiter ran it: it must
        # not hold the future, and with it the result, meanwhile.
        self.future = None
        return future

    @staticmethod
    def settle(future: Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
        """Settle ``future`` with ``outcome``, as :meth:`call` returns it."""
        result, exception = outcome
        if exception is not None and type(exception) is KeyboardInterrupt and on_main_thread():
            # Ctrl-C landed while the main thread ran the task itself (a
            # waiter's steal, or the inline backend): it is the user's
            # interrupt, not the task's result.
            error = CancelledError("interrupted by Ctrl-C while the main thread was running it")
            error.__cause__ = exception
            settle(future, None, error)
            retrieve(future)  # the interrupt itself goes on up: nothing is unread
            raise exception
        settle(future, result, exception)


def is_async_callable(fn: Callable[..., Any]) -> bool:
    """Whether calling ``fn`` gives a coroutine to await, not a value.

    Functions, bound methods, partials, builtins and classes are told apart
    by type first, so the common cases cost no ``inspect`` call.
    """
    kind = type(fn)
    if kind is FunctionType:
        return bool(fn.__code__.co_flags & _CO_COROUTINE)
    if kind is MethodType:
        return is_async_callable(fn.__func__)  # type: ignore[attr-defined]
    if kind is functools.partial:
        return is_async_callable(fn.func)  # type: ignore[attr-defined]
    if kind is BuiltinFunctionType or isinstance(fn, type):
        return False
    call = getattr(kind, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    if type(call) is FunctionType:
        return bool(call.__code__.co_flags & _CO_COROUTINE)
    return inspect.iscoroutinefunction(fn)


def chunk_size(items: int, workers: int) -> int:
    """The items per chunk that :meth:`Backend.map` picks: four chunks per
    worker, as :mod:`multiprocessing` picks them, so a slow chunk delays the
    end by a quarter of a worker's share at most."""
    return max(1, -(-items // (4 * workers)))


class _Chunk:
    """A chunk of :meth:`Backend.map`: calls ``fn`` on each item whose future
    it can claim, and settles that future; any future it leaves undone (a
    BaseException ended the chunk) is cancelled, so every future settles."""

    def __init__(
        self, fn: Callable[..., Any], items: list[tuple[Any, ...]], futures: list[Future[Any]]
    ) -> None:
        self.fn: Callable[..., Any] | None = fn
        self.items = items
        self.futures = futures
        # The profiler and exit reports name the chunk after the function.
        self.__qualname__ = getattr(fn, "__qualname__", None) or type(fn).__qualname__

    def cancel_if_cancelled(self, chunk_future: Future[None]) -> None:
        """The chunk's task was cancelled (a shutdown, Ctrl-C, os.fork()): so
        is every item's future."""
        if chunk_future.cancelled():
            for future in self.futures:
                future.cancel()

    def __call__(self) -> None:
        fn, items, futures = self.fn, self.items, self.futures
        # A failure's traceback holds this frame, and the frame its locals:
        # neither keeps a future (see Future), nor the chunk, which holds them all.
        self.fn, self.items, self.futures = None, [], []
        del self
        done = 0
        try:
            for args, future in zip(items, futures, strict=True):
                done += 1
                if not claim(future):
                    continue  # cancelled before the chunk reached it
                try:
                    result = fn(*args)  # type: ignore[misc]
                except BaseException as exc:
                    Task.settle(future, (None, exc))
                    del exc
                else:
                    settle(future, result, None)
                del future
        finally:
            for future in futures[done:]:
                future.cancel()
            del fn, items, futures


def raise_not_callable(fn: object, where: str) -> None:
    raise TypeError(
        f"{where} needs a callable as its first argument, got {type(fn).__name__} {fn!r:.60}; "
        f"pass the function and its arguments separately: fork(f, x), not fork(f(x))"
    )


class Backend(ABC):
    """Where forked tasks run.

    Subclasses set :attr:`name` and implement :meth:`enqueue`,
    :meth:`shutdown` and :attr:`max_workers`, and call ``super().__init__()``
    so the backend is shut down (running what was queued) at interpreter
    exit (see ``_exit``). A backend is also a context manager that shuts it down on exit.
    """

    #: the name it is registered under (``get_backend(name)``)
    name: ClassVar[str] = "?"
    #: whether a thread that waits on a not-yet-started task may run it
    #: itself; true for in-process backends, false where work must leave the
    #: process
    stealable: ClassVar[bool] = True
    #: what :meth:`fork` wraps each call in; a subclass of :class:`Task` may
    #: add work around :meth:`Task.run`
    task_class: ClassVar[type[Task]] = Task

    def __init__(self) -> None:
        self._closed = False
        _exit.track(self)

    @property
    def closed(self) -> bool:
        """True once :meth:`shutdown` has been called."""
        return self._closed

    def fork(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Start ``fn(*args, **kwargs)`` on this backend and return its future at once.

        A coroutine function runs on an event loop instead: the caller's
        running loop if there is one, else aiopar's own loop thread.
        """
        if not callable(fn):
            raise_not_callable(fn, f"{type(self).__name__}.fork()")
        future: Future[T] = Future()
        context = copy_context()
        if (
            fn.__code__.co_flags & _CO_COROUTINE
            if type(fn) is FunctionType  # the common case, checked cheaply
            else is_async_callable(fn)
        ):
            _loop.start_coroutine(future, fn, args, kwargs, context)
            return future
        # A call without keywords keeps the shared empty dict, not its own,
        # and one without context variables no context (it gets a fresh one
        # as it runs): objects fewer for the garbage collector to walk while
        # a batch of forks waits, with the forks' futures and tasks.
        task = self.task_class(future, fn, args, kwargs or _NO_KWARGS, context or None, self)
        profiler = _trace.active
        if profiler is not None:
            task.record = profiler.on_fork(task)
        # A store, not a call: see "the internal interface" in aiopar._future.
        future._task = task
        self.enqueue(task)
        return future

    def map(
        self, fn: Callable[..., T], /, *iterables: Iterable[Any], chunksize: int | None = None
    ) -> list[Future[T]]:
        """Start ``fn(*args)`` for each ``args`` of ``zip(*iterables)`` on this
        backend and return their futures at once, in order.

        The items run in chunks of ``chunksize`` (by default the item count
        over four times :attr:`max_workers`, as :mod:`multiprocessing` picks
        it): each chunk is one task with one :mod:`contextvars` context, so
        many small calls cost far less than a fork each. An item's failure
        fails its own future only; a future cancelled before its chunk
        reaches it is skipped; a thread that waits on an item of a chunk that
        has not started runs the whole chunk itself. A coroutine function
        gets a fork per item. Each chunk goes to :meth:`submit_chunk`.
        """
        if not callable(fn):
            raise_not_callable(fn, f"{type(self).__name__}.map()")
        if not iterables:
            raise TypeError(
                f"{type(self).__name__}.map() needs an iterable of arguments: map(fn, xs)"
            )
        check_count(chunksize, "map(chunksize=...)", none="picked from the items and workers")
        items = list(zip(*iterables, strict=False))  # as map(): to the shortest
        if is_async_callable(fn):
            return [self.fork(fn, *args) for args in items]
        size = chunksize or chunk_size(len(items), self.max_workers)
        futures: list[Future[T]] = []
        for start in range(0, len(items), size):
            futures += self.submit_chunk(fn, items[start : start + size], first=start)
        return futures

    def submit_chunk(
        self, fn: Callable[..., Any], items: list[tuple[Any, ...]], *, first: int = 0
    ) -> list[Future[Any]]:
        """Start ``fn(*args)`` for each ``args`` of ``items`` as one task of
        :attr:`task_class`, and return a future per item (see :meth:`map`);
        ``first`` is the index of ``items[0]`` in the map, for messages.

        A waiter on any of the futures may run the whole chunk. A backend
        that runs tasks out of process (not :attr:`stealable`) forks each
        item instead, unless it overrides this method to send chunks whole.
        """
        if not self.stealable or len(items) == 1:  # a chunk of one is a fork
            return [self.fork(fn, *args) for args in items]
        futures: list[Future[Any]] = [Future() for _ in items]
        chunk = _Chunk(fn, items, futures)
        chunk_future: Future[None] = Future()
        add_callback(chunk_future, chunk.cancel_if_cancelled)
        task = self.task_class(chunk_future, chunk, (), _NO_KWARGS, copy_context(), self)
        profiler = _trace.active
        if profiler is not None:
            task.record = profiler.on_fork(task)
        for future in futures:
            future._task = task  # see fork
        self.enqueue(task)
        return futures

    @abstractmethod
    def enqueue(self, task: Task) -> None:
        """Arrange for ``task.run()`` to be called once; never block on the task.

        Raises RuntimeError if the backend has been shut down.
        """

    def submit(self, fn: object, /, *args: Any, **kwargs: Any) -> NoReturn:
        """Refuse what code written for a ``concurrent.futures.Executor``
        (``loop.run_in_executor``, say) asks of one: a backend is not one."""
        raise TypeError(
            f"{type(self).__name__} is an aiopar Backend, not a concurrent.futures.Executor: "
            f"hand aiopar.Executor({self.name!r}) to loop.run_in_executor and other code that "
            f"takes an executor, or fork on the backend itself with backend.fork(fn, *args)"
        )

    @abstractmethod
    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Stop accepting work and release the workers.

        Queued tasks still run unless ``cancel_pending`` is true, in which
        case their futures are cancelled. With ``wait`` the call returns once
        every worker has stopped. Calling it again does nothing.
        """

    @property
    @abstractmethod
    def max_workers(self) -> int:
        """How many tasks may run at once."""

    def running_tasks(self) -> list[str]:
        """Names of the tasks running now (for what interpreter exit waits for)."""
        return []

    def drain(self) -> bool:
        """Return once nothing is queued or running on this backend, which
        stays open; True if there was something to wait for.

        Interpreter exit drains every backend, again and again until none
        had anything left, before any backend shuts down, so a queued task
        may still fork on any backend. The default returns False at once: a
        backend whose :meth:`shutdown` runs what is queued needs nothing more.
        """
        return False

    def __enter__(self) -> Backend:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown(wait=True)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} max_workers={self.max_workers}>"
