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
  behind it run on a replacement. A worker exits at once when this process
  dies, however it dies (SIGKILL included) and whatever it is doing.
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
- Done-callbacks of process futures run in the backend's manager thread;
  one that blocks (waiting on another process task, say) hands the
  manager's job to a new thread, so it cannot stall the pool, and any
  exception one raises (``SystemExit`` and ``KeyboardInterrupt`` included)
  is logged and harms nothing else.

Workers are started with ``subprocess`` (``python -c``, the parent's
``sys.path``), so the parent's ``__main__`` is never re-imported. Each talks
to the parent over a Unix socket (see ``_process_wire``); a pidfd tells the
manager thread at once when a worker dies. POSIX only; the shared-memory
path needs Linux (elsewhere large buffers go through the socket).

This module holds the backend's public face (options, fork, submit,
shutdown); each other part has a module of its own: ``_process_handle``
(a job, a worker process), ``_process_dispatch`` (jobs to workers,
prefetch), ``_process_manager`` (the select loop), ``_process_outcomes``
(frames to settled futures), ``_process_deaths`` (a worker's exit),
``_process_shutdown`` (stopping, exit, os.fork()), ``_process_errors``,
``_process_wire`` (what travels) and ``_process_worker`` (the worker's loop).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _budget
from .._fresh import importable
from .._future import Future
from . import _process_wire as wire
from ._base import Backend, Task, check_count
from ._process_dispatch import PREFETCH_BUDGET_NS, dispatch
from ._process_errors import RemoteError, RemoteTraceback, unpicklable_part
from ._process_handle import Job, Worker
from ._process_manager import manage
from ._process_shutdown import GRACE, join, live, stop

__all__ = ["ProcessBackend", "RemoteError", "RemoteTraceback"]

T = TypeVar("T")

#: set in worker processes: the backend that forks made there go to (threads:
#: never start processes from processes)
in_worker_backend: Backend | None = None

_backend_ids = itertools.count(1)


class ProcessBackend(Backend):
    """Runs forked tasks in a pool of worker processes.

    ``max_workers`` defaults to the number of cores. ``prefetch`` is how many
    queued tasks beyond the running one a worker may hold, so it goes from
    one task to the next without a round trip to this process; a prefetched
    task can no longer be cancelled and waits for the tasks before it on
    that worker. By default it adapts: about a millisecond of work at the
    tasks' recent pace (between 1 and 16 tasks). Only small calls (under
    16 KiB pickled, no shared-memory arrays) are prefetched.

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
    ) -> None:
        check_count(max_workers, "max_workers", none="the default")
        check_count(prefetch, "prefetch", minimum=0, none="adaptive")
        if grace is not None and (
            not isinstance(grace, int | float) or isinstance(grace, bool) or not grace >= 0
        ):
            raise ValueError(
                f"grace must be None (wait for ever) or a number of seconds >= 0, got {grace!r}"
            )
        super().__init__()
        self._max_workers = max_workers or _budget.cores()
        self._prefetch = prefetch
        self._grace = grace
        self._mean_run_ns = PREFETCH_BUDGET_NS  # recent task run time (moving average)
        self._worker_index = itertools.count()
        self._job_ids = itertools.count(1)
        self._generation = 0  # of the manager thread in charge
        self._name = f"aiopar-process-{next(_backend_ids)}"
        self._fresh_state()
        live.add(self)

    def _fresh_state(self) -> None:
        """No workers, no queue, no manager: a new backend, or a child's after os.fork()."""
        self._lock = threading.Lock()
        self._pending: deque[Job] = deque()
        self._workers: list[Worker] = []
        self._idle: list[Worker] = []
        self._start_failures = 0
        self._segments = wire.SegmentPool()
        self._manager: threading.Thread | None = None
        self._wake_lock = threading.RLock()  # RLock: finalizers may re-enter
        self._wake_r = self._wake_w = -1  # the manager's wake-up pipe, made with it
        self._unmapped: deque[tuple[Worker, int]] = deque()
        self._pid = os.getpid()
        # Past this time.monotonic(), shutdown terminates the workers still
        # running a task; with _renew, each task that finishes pushes it on.
        self._deadline: float | None = None
        self._renew = False
        self._why_terminated = ""
        # sys.path as last seen by a fork, what of it workers can use, and
        # how many times it changed (a worker with an older one gets it).
        self._sys_path = list(sys.path)
        self._path = importable(self._sys_path)
        self._path_version = 0

    @property
    def max_workers(self) -> int:
        return self._max_workers

    def fork(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if in_worker_backend is not None:
            return in_worker_backend.fork(fn, *args, **kwargs)
        return super().fork(fn, *args, **kwargs)

    # -- submitting ----------------------------------------------------------

    def submit(self, task: Task) -> None:
        if self._closed:
            raise RuntimeError(f"cannot fork on {self!r}: it has been shut down")
        if os.getpid() != self._pid:  # forked by C code that ran no at-fork hooks
            raise RuntimeError(
                f"{self!r} belongs to process {self._pid}; a child made with fork() "
                f"must create its own backend"
            )
        if sys.path != self._sys_path:  # cheap while it is the same: compared item by item
            with self._lock:
                self._sys_path = list(sys.path)
                self._path = importable(self._sys_path)
                self._path_version += 1
        job = Job(task, self._pack_call(task), next(self._job_ids))
        with self._lock:
            if self._closed:
                job.packed.discard()
                raise RuntimeError(f"cannot fork on {self!r}: it has been shut down")
            self._pending.append(job)
            dispatch(self)
            if self._pending:
                if self._manager is None:
                    self._start_manager()
                elif len(self._workers) < self._max_workers:
                    self._wake()  # the manager starts workers

    def _pack_call(self, task: Task) -> wire.Packed:
        try:
            return wire.pack_call(task.fn, task.args, task.kwargs, self._segments)
        except Exception as exc:
            culprit = unpicklable_part(task)
            raise TypeError(
                f"cannot send {task.name}() to a worker process: {culprit} cannot be pickled "
                f"({type(exc).__name__}: {exc}). A process task's function and arguments "
                f"must be picklable (cloudpickle): pass the data a lock, file, socket or "
                f"generator was made from, or use the thread backend"
            ) from exc

    # -- the manager thread's wake-up pipe -------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")

    def _segment_unmapped(self, worker: Worker, seg_id: int) -> None:
        self._unmapped.append((worker, seg_id))
        self._wake()

    def _start_manager(self) -> None:
        # Called with the lock held.
        with self._wake_lock:
            if self._wake_r < 0:
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
        self._generation += 1
        self._manager = threading.Thread(
            target=manage,
            args=(self, self._generation),
            name=f"{self._name}-manager-{self._generation}",
            daemon=True,
        )
        self._manager.start()

    # Future.wait calls these in the manager thread when a done-callback run
    # there blocks (say, on another process task): a new manager takes over,
    # so the results that callback waits for still arrive. The blocked
    # thread exits once its callback returns.
    def blocked(self) -> None:
        with self._lock:
            if self._manager is threading.current_thread():
                self._start_manager()

    def blocked_long(self) -> None:
        pass

    def resumed(self) -> None:
        pass

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
        why = None
        if cancel_pending:
            why = f"still running {self._grace} s after shutdown(cancel_pending=True)"
        stop(self, cancel_pending, why)
        if wait:
            join(self)
