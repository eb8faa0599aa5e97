"""The "process" backend: a pool of worker processes, for CPU-bound Python.

Guarantees:

- Any callable cloudpickle can carry runs in a worker: lambdas, closures,
  functions and classes from ``__main__``, bound methods, callable objects.
  The call is pickled in the thread that forks, so an argument that cannot
  be pickled raises ``TypeError`` at ``fork``; a result that cannot be
  pickled raises ``TypeError`` at ``wait``.
- A worker works on a copy of the arguments: changing an argument in place
  (an array, a list) changes nothing in this process.
- numpy arrays of 64 KiB or more, wherever they sit in the arguments, the
  function's closure or the result, travel through shared memory with one
  copy on the sending side and none on the receiving side (a strided array
  is made contiguous in that copy). The segments are anonymous, so nothing
  is ever left in ``/dev/shm``, even when a process is killed. Everything
  else travels in the pickle, at a cost in proportion to its size.
- Workers are fresh interpreters (never ``fork()``-ed from this process),
  started when work first arrives, reused, and stopped by ``shutdown()`` or
  at interpreter exit. Nothing runs in a worker before its ``sys.path`` is
  this process's, and a task carries this process's ``sys.path`` to its
  worker when it has changed since. A ``fork`` inside a task runs in that
  worker on the thread backend.
- A worker that dies (killed, segfault, ``os._exit``) fails only the task it
  was running, with :class:`~aiopar.BrokenWorkerError`; the tasks queued
  behind it run on a replacement. A worker whose socket carries anything
  but the frames it owes (a task that wrote to it, a frame cut short) is
  killed and counts as dead; its tasks fail with the error saying what it
  sent. A worker exits at once when this process dies, however it dies
  (SIGKILL included) and whatever it is doing.
- Shutdown is bounded for tasks that never return (see ``grace``).
- After ``os.fork()`` (or a multiprocessing "fork" Process) the child starts
  with an empty pool of its own; the futures of tasks pending at the fork
  fail there with :class:`~aiopar.BrokenWorkerError` (their results go to
  the parent).
- A task's exception arrives with its type and, as ``__cause__``, the text
  of the traceback in the worker.
- ``cancel()`` succeeds until the task is sent to a worker (see
  ``prefetch``). A waiting thread never runs a process task itself
  (``stealable`` is false): it blocks until a worker has run it.
- Done-callbacks of process futures run in the backend's manager thread,
  or in the thread that unpickled the result when that may run code
  (anything but a small value of plain data): a result slow to unpickle
  holds up its own future only. One that blocks in the manager thread
  (waiting on another process task, say) hands the manager's job to a new
  thread, so it cannot stall the pool, and any exception one raises
  (``SystemExit`` and ``KeyboardInterrupt`` included) is logged and harms
  nothing else.

Workers are started with ``subprocess`` (``python -c``, the parent's
``sys.path``), so the parent's ``__main__`` is never re-imported. Each talks
to the parent over a Unix socket; a pidfd tells the manager thread at once
when a worker dies. POSIX only; the shared-memory path needs Linux
(elsewhere large buffers go through the socket).

This module is the backend's public face (options, fork, map, enqueue,
shutdown). The rest has a module per part: ``_process_pool`` (the pool's
state and its manager thread, one class), ``_process_handle`` (a job, a
worker process), ``_process_wire`` (framing) and ``_process_pickle`` (what
travels, errors included), and ``_process_worker`` (the worker's loop).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _budget, _trace
from .._future import Future, settle
from ._base import Backend, Task, check_count, check_initializer
from ._process_handle import Job, check_setup
from ._process_pickle import (
    Packed,
    RemoteError,
    RemoteTraceback,
    pack_call,
    remote_exception,
    unpicklable_part,
)
from ._process_pool import GRACE, Pool

__all__ = ["ProcessBackend", "RemoteError", "RemoteTraceback", "redirect_forks"]

T = TypeVar("T")

_NO_KWARGS: dict[str, Any] = {}


class _Outcomes:
    """Settles the futures of a chunk's items once the chunk's own future is
    done: each with its call's outcome, or all of them as the chunk was
    (cancelled, or failed as a whole: its worker died, say)."""

    __slots__ = ("futures", "name")

    def __init__(self, futures: list[Future[Any]], name: str) -> None:
        self.futures = futures
        self.name = name

    def __call__(self, chunk: Future[list[Any]]) -> None:
        futures, self.futures = self.futures, []
        if chunk.cancelled():
            for future in futures:
                future.cancel()
            return
        error = chunk.exception()
        if error is not None:
            for future in futures:
                Task.settle(future, (None, error))
            return
        for future, outcome in zip(futures, chunk.result(), strict=True):
            if outcome is None:
                continue  # cancelled before the chunk was sent
            ok, value = outcome
            if ok:
                settle(future, value, None)
            else:
                Task.settle(future, (None, remote_exception(value, self.name)))


# Set in worker processes: where the forks made there go instead.
_redirected_to: Backend | None = None


def redirect_forks(backend: Backend) -> None:
    """Make every process backend of this process fork on ``backend`` instead.

    A worker process calls it with the backend its parent chose for it, so
    a task's forks run in that worker and never start processes of their own.
    """
    global _redirected_to
    _redirected_to = backend


def _check_start_method(mp_context: Any) -> None:
    """Refuse anything but None or a multiprocessing context."""
    if mp_context is None:
        return
    method = getattr(mp_context, "get_start_method", lambda: None)()
    if method not in ("spawn", "forkserver", "fork"):
        raise ValueError(
            f"mp_context must be None or a multiprocessing context "
            f"(multiprocessing.get_context('spawn')), got {mp_context!r:.60}"
        )


class ProcessBackend(Backend):
    """Runs forked tasks in a pool of worker processes.

    ``max_workers`` defaults to the number of cores. ``prefetch`` is how many
    queued tasks beyond the running one a worker may hold, so it goes from
    one task to the next without a round trip to this process. A task sent
    ahead counts as started, as a call in ProcessPoolExecutor's call queue
    does: ``cancel()`` refuses it, as do ``cancel_futures`` and the
    cancelling of a shutdown or a Ctrl-C, and it waits for the tasks before
    it on that worker; if a shutdown terminates the worker before it gets
    to the task, the task ends cancelled. No task goes ahead while a worker is idle or
    starting, or while the pool has fewer workers than it may have, so
    tasks forked at once run on as many workers. By default it adapts:
    about a millisecond of work at the tasks' recent pace (between 1 and 16
    tasks), and none until a task has finished or while tasks take 50 ms
    or more on average. Only small calls (under 16 KiB pickled, no
    shared-memory arrays) are prefetched.

    ``initializer(*initargs)`` runs in each worker before its first task, as
    in :class:`concurrent.futures.ProcessPoolExecutor`; ``initargs`` may hold
    what multiprocessing lets a starting child have, the locks, queues and
    ``Manager()`` proxies of a "spawn" or "forkserver" context (workers
    share this process's authkey). A worker whose initializer raises logs
    the error on the ``concurrent.futures`` logger and exits, and the pool
    is broken, as ProcessPoolExecutor's is: no worker starts after it, and
    the queued tasks and every later fork fail with
    :class:`~aiopar.BrokenWorkerError`, a ``BrokenProcessPool``; tasks
    already running on other workers finish.
    ``mp_context`` is accepted for ProcessPoolExecutor's sake: whatever its
    start method, workers are fresh interpreters, as "spawn" starts them, so
    under "fork" too they do not inherit this process's memory.

    ``max_tasks_per_child``, as in ProcessPoolExecutor: a worker that has
    been handed that many tasks exits once it has run them, and a new one
    takes its place (a retirement, not a failure); None keeps workers for
    the backend's life.

    ``grace`` (seconds, default 5) bounds how long stopping waits for tasks
    that do not return. ``shutdown(cancel_pending=True)`` cancels the queued
    tasks and gives the running ones ``grace`` seconds; a worker still
    running a task then is terminated (SIGTERM, then SIGKILL a second
    later) and the task's future fails with
    :class:`~aiopar.BrokenWorkerError`. At interpreter exit the queued
    tasks still run, but once ``grace`` seconds pass with no task
    finishing, the same happens to the running ones and the rest are
    cancelled; after an uncaught KeyboardInterrupt the queued tasks are
    cancelled at once. ``grace=None`` waits for ever. A plain
    ``shutdown()`` runs every queued task and waits for all of them,
    however long they take.
    """

    name = "process"
    stealable = False

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        prefetch: int | None = None,
        grace: float | None = GRACE,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
        mp_context: Any = None,
        max_tasks_per_child: int | None = None,
    ) -> None:
        check_count(max_workers, "max_workers", none="the default")
        check_count(prefetch, "prefetch", minimum=0, none="adaptive")
        check_count(max_tasks_per_child, "max_tasks_per_child", none="no limit")
        if grace is not None and (
            not isinstance(grace, int | float) or isinstance(grace, bool) or not grace >= 0
        ):
            raise ValueError(
                f"grace must be None (wait for ever) or a number of seconds >= 0, got {grace!r}"
            )
        check_initializer(initializer)
        if initializer is not None:
            check_setup(initializer, initargs)
        _check_start_method(mp_context)
        super().__init__()
        self._max_workers = max_workers or _budget.cores()
        setup = {} if initializer is None else {"initializer": initializer, "initargs": initargs}
        self._pool = Pool(
            self._max_workers, prefetch, grace, repr(self), max_tasks_per_child, **setup
        )

    @property
    def max_workers(self) -> int:
        return self._max_workers

    @property
    def closed(self) -> bool:
        return self._closed or self._pool.closed

    def fork(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if _redirected_to is not None:
            return _redirected_to.fork(fn, *args, **kwargs)
        return super().fork(fn, *args, **kwargs)

    def submit_chunk(
        self, fn: Callable[..., Any], items: list[tuple[Any, ...]], *, first: int = 0
    ) -> list[Future[Any]]:
        """As :meth:`Backend.submit_chunk`; a chunk travels to its worker as
        one message (the function and the arguments of its calls) and comes
        back as one (an outcome per call). An item cancelled before its
        chunk is sent is skipped; an item's failure fails its future only,
        with its type and traceback text; a worker that dies fails every
        item of the chunk it was running."""
        if _redirected_to is not None:
            return _redirected_to.submit_chunk(fn, items, first=first)
        futures: list[Future[Any]] = [Future() for _ in items]
        pool = self._pool
        pool.check_open()
        chunk: Future[list[Any]] = Future()
        context = contextvars.copy_context()
        task = self.task_class(chunk, fn, tuple(items), _NO_KWARGS, context, self)
        chunk.add_done_callback(_Outcomes(futures, task.name))
        profiler = _trace.active
        if profiler is not None:
            task.record = profiler.on_fork(task)
        packed = self._pack_call(task, "the arguments of item", first)
        pool.submit(Job(task, packed, futures))
        return futures

    def enqueue(self, task: Task) -> None:
        self._pool.check_open()
        self._pool.submit(Job(task, self._pack_call(task)))

    def _pack_call(self, task: Task, arg: str = "argument", first: int = 0) -> Packed:
        try:
            return pack_call(task.fn, task.args, task.kwargs, self._pool.segments)
        except Exception as exc:
            culprit = unpicklable_part(task.fn, task.args, task.kwargs, arg, first)
            raise TypeError(
                f"cannot send {task.name}() to a worker process: {culprit} cannot be pickled "
                f"({type(exc).__name__}: {exc}). A process task's function and arguments "
                f"must be picklable (cloudpickle): pass the data a lock, file, socket or "
                f"generator was made from, or use the thread backend"
            ) from exc

    def running_tasks(self) -> list[str]:
        return self._pool.running_tasks()

    def drain(self) -> bool:
        """Return once no task of this backend is queued, running on a
        worker or having its result unpickled, and every one that was is
        done; True if there was one to wait for. The backend stays open:
        tasks forked meanwhile are waited for too. At interpreter exit, once
        ``grace`` seconds pass with no task finishing, the workers still
        running one are terminated and the rest is cancelled (see the class)."""
        return self._pool.drain()

    # -- shutting down -------------------------------------------------------

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Stop accepting work and stop the workers once they are done.

        Queued tasks still run, and ``wait`` waits for them however long
        they take. With ``cancel_pending`` the queued tasks are cancelled
        instead, and the running ones get the backend's ``grace`` seconds:
        then their workers are terminated and their futures fail with
        :class:`~aiopar.BrokenWorkerError`, so the call returns in bounded
        time even if a task never returns.
        """
        self._closed = True
        why = None
        if cancel_pending:
            why = f"still running {self._pool.grace} s after shutdown(cancel_pending=True)"
        self._pool.close(cancel_pending, why)
        if wait:
            self._pool.join()
