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
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import math
import os
import pickle
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

from .. import _budget, _config, _future
from .._errors import BrokenWorkerError
from .._future import Future
from . import _process_wire as wire
from ._base import Backend, Task, check_count

__all__ = ["ProcessBackend", "RemoteTraceback"]

T = TypeVar("T")

_logger = logging.getLogger("aiopar")

#: set in worker processes: a process backend there forks onto threads
_in_worker = False

# How many workers in a row may die before they are ready until the queued
# tasks are failed instead of starting yet another one.
_MAX_START_FAILURES = 3
# Adaptive prefetch: about this much work queued on a worker, at most this
# many tasks, each at most this big, all of them at most this many bytes.
_PREFETCH_BUDGET_NS = 1_000_000
_PREFETCH_MAX_TASKS = 16
_PREFETCH_MAX_CALL = 16 * 1024
_PREFETCH_MAX_BYTES = 64 * 1024
# How long shutdown waits for an idle worker to exit before killing it.
_STOP_TIMEOUT = 10.0
# The default grace period of a bounded shutdown (see ProcessBackend).
_GRACE = 5.0
# How long a terminated worker has to exit before it is killed.
_KILL_AFTER = 1.0

# Nothing is imported before sys.path is the parent's: ``python -c`` puts the
# working directory first, where a json.py or socket.py would shadow the
# standard library's module. argv: socket fd, parent pid, then sys.path.
_BOOT = (
    "import sys; sys.path[:] = sys.argv[3:]; "
    "from aiopar.backends._process_worker import main; main(int(sys.argv[1]), int(sys.argv[2]))"
)

_backend_ids = itertools.count(1)
_backends: weakref.WeakSet[ProcessBackend] = weakref.WeakSet()
# Handles on workers that a process inherited through os.fork(): they are
# the parent's children, never to be waited for here.
_inherited: list[subprocess.Popen[bytes]] = []


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text.

    Attached as the ``__cause__`` of the exception that ``wait`` raises, so
    a printed traceback shows where the task failed inside the worker.
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n\nTraceback in the worker process:\n"""\n{self.tb}"""'


class RemoteError(Exception):
    """Stands in for an exception raised in a worker that could not be pickled."""


# A future and its outcome, (result, exception), or None to cancel it.
_Settle = tuple[Future[Any], "tuple[Any, BaseException | None] | None"]


class _Job:
    __slots__ = ("forks", "future", "id", "name", "packed", "task")

    def __init__(self, task: Task, packed: wire.Packed, job_id: int) -> None:
        assert task.future is not None  # a task is submitted before it runs
        self.task = task
        self.future: Future[Any] = task.future
        self.name = task.name
        self.packed = packed
        self.id = job_id
        self.forks: Any = None  # for the profiler: what the task forked in its worker
        # The pickle is all that is needed now: let the arguments go even
        # while the future (which refers to the task) is kept, and break the
        # future <-> task cycle so a dropped result is freed at once (its
        # shared memory then goes back to the worker without waiting for gc).
        task.fn = task.args = task.kwargs = None  # type: ignore[assignment]
        task.future = None


class _Worker:
    """The parent's handle on one worker process."""

    def __init__(self, backend: ProcessBackend, index: int) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            command = [
                sys.executable,
                # The flags this interpreter runs with (-X, -W...), as multiprocessing passes them.
                *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
                "-c",
                _BOOT,
                str(child_end.fileno()),
                str(os.getpid()),
                *backend._path,
            ]
            self.process = subprocess.Popen(
                command, pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.index = index
        self.pid = self.process.pid
        self.ready = False
        self.stopping = False
        self.eof = False  # its socket has been read to the end
        self.inflight: deque[_Job] = deque()  # sent, in the order the worker runs them
        self.path_version = backend._path_version  # of the sys.path it has
        self.terminated: str | None = None  # why shutdown terminated it
        self.kill_at = math.inf  # when to kill it if it has not exited by then
        backend_ref = weakref.ref(backend)

        def unmapped(seg_id: int) -> None:
            # May run in any thread, from a garbage-collector finalizer: no locks.
            backend = backend_ref()
            if backend is not None:
                backend._segment_unmapped(self, seg_id)

        self.channel = wire.Channel(parent_end, backend._segments.release, unmapped)
        self.pidfd = _pidfd_open(self.pid)

    def __repr__(self) -> str:
        return f"<worker {self.index} pid {self.pid}>"


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: the socket's EOF tells instead
        return None


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
        grace: float | None = _GRACE,
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
        self._mean_run_ns = _PREFETCH_BUDGET_NS  # recent task run time (moving average)
        self._worker_index = itertools.count()
        self._job_ids = itertools.count(1)
        self._generation = 0  # of the manager thread in charge
        self._name = f"aiopar-process-{next(_backend_ids)}"
        self._fresh_state()
        _backends.add(self)

    def _fresh_state(self) -> None:
        """No workers, no queue, no manager: a new backend, or a child's after os.fork()."""
        self._lock = threading.Lock()
        self._pending: deque[_Job] = deque()
        self._workers: list[_Worker] = []
        self._idle: list[_Worker] = []
        self._start_failures = 0
        self._segments = wire.SegmentPool()
        self._manager: threading.Thread | None = None
        self._wake_lock = threading.RLock()  # RLock: finalizers may re-enter
        self._wake_r = self._wake_w = -1  # the manager's wake-up pipe, made with it
        self._unmapped: deque[tuple[_Worker, int]] = deque()
        self._pid = os.getpid()
        # Past this time.monotonic(), shutdown terminates the workers still
        # running a task; with _renew, each task that finishes pushes it on.
        self._deadline: float | None = None
        self._renew = False
        self._why_terminated = ""
        # sys.path as last seen by a fork, what of it workers can use, and
        # how many times it changed (a worker with an older one gets it).
        self._sys_path = list(sys.path)
        self._path = _importable(self._sys_path)
        self._path_version = 0

    @property
    def max_workers(self) -> int:
        return self._max_workers

    def fork(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        if _in_worker:
            # Inside a worker process: never start processes from processes.
            return _config.get_backend("thread").fork(fn, *args, **kwargs)
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
                self._path = _importable(self._sys_path)
                self._path_version += 1
        job = _Job(task, self._pack_call(task), next(self._job_ids))
        with self._lock:
            if self._closed:
                job.packed.discard()
                raise RuntimeError(f"cannot fork on {self!r}: it has been shut down")
            self._pending.append(job)
            self._dispatch()
            if self._pending:
                if self._manager is None:
                    self._start_manager()
                elif len(self._workers) < self._max_workers:
                    self._wake()  # the manager starts workers

    def _pack_call(self, task: Task) -> wire.Packed:
        try:
            return wire.pack_call(task.fn, task.args, task.kwargs, self._segments)
        except Exception as exc:
            culprit = _find_unpicklable(task)
            raise TypeError(
                f"cannot send {task.name}() to a worker process: {culprit} cannot be pickled "
                f"({type(exc).__name__}: {exc}). A process task's function and arguments "
                f"must be picklable (cloudpickle): pass the data a lock, file, socket or "
                f"generator was made from, or use the thread backend"
            ) from exc

    def _dispatch(self) -> None:
        """Send queued jobs to idle workers, then prefetch onto busy ones.

        Called with the lock held.
        """
        pending = self._pending
        while pending and self._idle:
            job = pending.popleft()
            if job.future._claim():
                self._send(self._idle.pop(), job)
            elif job.future.running():
                self._send(self._idle.pop(), job)  # resent after its first worker died
            else:
                job.packed.discard()  # cancelled
        depth = self._prefetch_depth()
        if not pending or not depth:
            return
        for worker in self._workers:
            if not pending:
                break
            if not worker.ready or not worker.inflight:
                continue
            # What the worker has not read yet must fit in the socket's
            # buffer: a send here must never wait for a busy worker.
            queued = sum(len(j.packed.payload) for j in itertools.islice(worker.inflight, 1, None))
            while pending and not worker.stopping and len(worker.inflight) <= depth:
                job = pending[0]
                size = len(job.packed.payload)
                if job.packed.segment is not None or size > _PREFETCH_MAX_CALL:
                    return  # big calls only go to a worker that is reading
                if queued + size > _PREFETCH_MAX_BYTES:
                    break
                pending.popleft()
                if job.future._claim() or job.future.running():
                    queued += size
                    self._send(worker, job)
                else:
                    job.packed.discard()

    def _prefetch_depth(self) -> int:
        if self._prefetch is not None:
            return self._prefetch
        return max(1, min(_PREFETCH_MAX_TASKS, _PREFETCH_BUDGET_NS // (self._mean_run_ns + 1)))

    def _send(self, worker: _Worker, job: _Job) -> None:
        # Called with the lock held.
        worker.inflight.append(job)
        try:
            if worker.path_version != self._path_version:
                # Before the task, so its function unpickles on the new path.
                path = wire.Packed(pickle.dumps(self._path, protocol=5), [], None, None)
                worker.channel.send(wire.PATH, packed=path)
                worker.path_version = self._path_version
            traced = job.task.record is not None  # the worker records its forks then
            worker.channel.send(wire.TASK, job.id, job.packed, owner=worker, t0=traced)
        except OSError:
            # The worker is dying; the manager notices through its pidfd and
            # requeues this job, which the worker never received.
            worker.inflight.pop()
            self._pending.appendleft(job)
            worker.stopping = True
            if worker in self._idle:
                self._idle.remove(worker)

    # -- the manager thread --------------------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")

    def _segment_unmapped(self, worker: _Worker, seg_id: int) -> None:
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
            target=self._manage,
            args=(self._generation,),
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

    def _manage(self, generation: int) -> None:
        _future.set_waiter(self)
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        watched: set[_Worker] = set()
        settles: list[_Settle] = []
        handed_off = False
        try:
            while True:
                timeout = self._enforce_deadline(settles)
                with self._lock:
                    for job, error in self._start_workers():
                        job.packed.discard()
                        settles.append((job.future, (None, error)))
                    for worker in self._workers:
                        if worker not in watched:
                            watched.add(worker)
                            if not worker.eof:
                                selector.register(worker.channel, selectors.EVENT_READ, worker)
                            if worker.pidfd is not None:
                                selector.register(worker.pidfd, selectors.EVENT_READ, worker)
                    stop = self._closed and not self._pending and not self._busy()
                # Settled last, right before select() lets go of the GIL, so
                # a waiter that wakes up finds it free.
                if self._settle_all(settles, generation):
                    handed_off = True
                    return
                if stop:
                    break
                # Frames a previous manager read but left unhandled.
                ready = [
                    (selector.get_key(w.channel), None)
                    for w in watched
                    if not w.eof and w.channel.has_frame()
                ]
                for key, _ in ready or selector.select(timeout):
                    worker = key.data
                    if worker is None:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        self._send_releases()
                    elif worker in watched:
                        if key.fileobj is worker.channel:
                            self._read(worker, selector, settles)
                            if worker.eof and worker in self._workers:
                                with contextlib.suppress(KeyError, ValueError):
                                    selector.unregister(worker.channel)
                        else:
                            self._worker_died(worker, selector, settles)
                        if worker not in self._workers:
                            watched.discard(worker)
            self._stop_workers()
        except BaseException:
            _logger.exception("the manager thread of %r failed; failing its tasks", self)
            for future, outcome in settles:
                _settle(future, outcome)
            self._fail_everything()
            raise
        finally:
            selector.close()
            if not handed_off:
                with self._wake_lock:
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    self._wake_r = self._wake_w = -1
                self._segments.close()

    def _settle_all(self, settles: list[_Settle], generation: int) -> bool:
        """Settle the futures; True if a callback blocked and a new manager
        took over (this thread then only finishes its own list)."""
        for i, (future, outcome) in enumerate(settles):
            _settle(future, outcome)
            if generation != self._generation:
                # The new manager never saw these, so they are settled here.
                for future, outcome in settles[i + 1 :]:
                    _settle(future, outcome)
                return True
        settles.clear()
        return False

    def _enforce_deadline(self, settles: list[_Settle]) -> float | None:
        """Once shutdown's deadline has passed, terminate the workers still
        running a task (kill them a second later) and drop the queue, adding
        the futures to ``settles``; return how long the manager may sleep
        (None: until something happens)."""
        if self._deadline is None:
            return None
        now = time.monotonic()
        due = now >= self._deadline
        wake_at = math.inf if due else self._deadline
        why = self._why_terminated
        terminating = []
        with self._lock:
            if due:
                for job in self._pending:
                    job.packed.discard()
                    if job.future.running():  # resent after its worker died: too late to cancel
                        message = f"{job.name}() never ran: the pool was stopped ({why})"
                        settles.append((job.future, (None, BrokenWorkerError(message))))
                    else:
                        settles.append((job.future, None))
                self._pending.clear()
            for worker in self._workers:
                if worker.terminated is None:
                    if not due or not worker.inflight:
                        continue
                    terminating.append((worker, worker.inflight[0].name))
                    worker.terminated = why
                    worker.kill_at = now + _KILL_AFTER
                    worker.process.terminate()
                elif now >= worker.kill_at:
                    worker.kill_at = math.inf
                    worker.process.kill()
                wake_at = min(wake_at, worker.kill_at)
        for worker, name in terminating:
            _logger.warning(
                "%r: terminating %r, which is still running %s(): %s "
                "(ProcessBackend(grace=...) sets how long a shutdown waits)",
                self,
                worker,
                name,
                why,
            )
        return None if wake_at == math.inf else wake_at - now

    def _busy(self) -> bool:
        return any(worker.inflight for worker in self._workers)

    def _start_workers(self) -> list[tuple[_Job, BaseException]]:
        """Start one worker per queued job, up to max_workers.

        Called with the lock held; returns the jobs to fail (after the lock
        is released) if no worker could be started at all.
        """
        starting = sum(1 for worker in self._workers if not worker.ready)
        wanted = min(len(self._pending) - starting, self._max_workers - len(self._workers))
        for _ in range(max(wanted, 0)):
            try:
                self._workers.append(_Worker(self, next(self._worker_index)))
            except OSError as exc:
                if self._workers:
                    break  # the running workers carry on
                doomed = list(self._pending)
                self._pending.clear()
                return [
                    (
                        job,
                        BrokenWorkerError(
                            f"could not start a worker process for {job.name}() "
                            f"({type(exc).__name__}: {exc})"
                        ),
                    )
                    for job in doomed
                ]
        return []

    def _read(
        self, worker: _Worker, selector: selectors.BaseSelector, settles: list[_Settle]
    ) -> None:
        """Handle the frames waiting on the worker's socket, adding the futures
        to settle to ``settles``."""
        channel = worker.channel
        while True:
            try:
                frame = channel.recv()
            except (EOFError, OSError):
                with self._lock:
                    worker.eof = True
                    worker.stopping = True
                    if worker in self._idle:
                        self._idle.remove(worker)
                if worker.pidfd is None:  # no pidfd to tell when it has exited
                    self._worker_died(worker, selector, settles)
                return
            if frame is not None and (settle := self._on_frame(worker, frame)):
                settles.append(settle)
            del frame
            if not channel.has_frame():
                return

    def _on_frame(self, worker: _Worker, frame: wire.Frame) -> _Settle | None:
        """Account for the frame; return the settling of its future, which the
        caller does last (a done-callback may block, see blocked)."""
        if frame.kind == wire.READY:
            with self._lock:
                worker.ready = True
                self._start_failures = 0
                if not worker.stopping:
                    self._idle.append(worker)
                self._dispatch()
            return None
        if frame.kind == wire.TRACE:  # about the running task; its result comes next
            with self._lock:
                job = worker.inflight[0]
            assert job.id == frame.msg_id, (job.id, frame.msg_id)
            job.forks = frame.loads()
            return None
        with self._lock:
            job = worker.inflight.popleft()
            assert job.id == frame.msg_id, (job.id, frame.msg_id)
            if not worker.inflight and not worker.stopping:
                self._idle.append(worker)
            self._dispatch()
        self._mean_run_ns += (frame.t1 - frame.t0 - self._mean_run_ns) // 8
        if self._renew and self._deadline is not None:
            self._deadline = time.monotonic() + self._grace  # type: ignore[operator]
        task = job.task
        if task.record is not None:
            # Tasks run on the worker's main thread, whose tid is its pid.
            task.record.on_remote_run(
                frame.t0, frame.t1, worker.pid, worker.pid, f"process worker {worker.index}"
            )
            if job.forks is not None:
                task.record.on_remote_forks(job.forks)
        future = job.future
        try:
            if frame.kind == wire.RESULT:
                outcome: tuple[Any, BaseException | None] = (frame.loads(), None)
            else:
                outcome = (None, _remote_exception(frame.loads(), job.name))
        except BaseException as exc:
            outcome = (None, _unpickling_failed(exc, job.name))
        return future, outcome

    def _send_releases(self) -> None:
        by_worker: dict[_Worker, list[int]] = {}
        while self._unmapped:
            worker, seg_id = self._unmapped.popleft()
            by_worker.setdefault(worker, []).append(seg_id)
        if not by_worker:
            return
        with self._lock:
            for worker, ids in by_worker.items():
                if worker in self._workers and not worker.stopping:
                    with contextlib.suppress(OSError):
                        worker.channel.send(wire.RELEASE, released=ids)

    def _worker_died(
        self, worker: _Worker, selector: selectors.BaseSelector, settles: list[_Settle]
    ) -> None:
        """Account for a worker's exit, adding the futures to settle to ``settles``."""
        # Results it sent before it died still count.
        with contextlib.suppress(OSError, EOFError):
            worker.channel.sock.setblocking(False)
            while True:
                try:
                    frame = worker.channel.recv()
                except BlockingIOError:
                    break
                if frame is not None and (settle := self._on_frame(worker, frame)):
                    settles.append(settle)
        returncode = worker.process.wait()
        with self._lock:
            self._workers.remove(worker)
            if worker in self._idle:
                self._idle.remove(worker)
            inflight = list(worker.inflight)
            worker.inflight.clear()
            running = inflight[0] if inflight else None
            stranded = inflight[1:]  # sent but not started
            if worker.terminated is None:  # run them elsewhere
                for job in reversed(stranded):
                    self._pending.appendleft(job)
                    if job.packed.segment is not None:
                        job.packed.segment.owner = None
                stranded = []
            self._segments.release_owner(worker)
            failed_to_start = not worker.ready and not self._closed
            doomed: list[_Job] = []
            if failed_to_start:
                self._start_failures += 1
                if self._start_failures >= _MAX_START_FAILURES:
                    doomed = list(self._pending)
                    self._pending.clear()
            self._dispatch()
        _unregister(selector, worker)  # before closing: the numbers may be reused
        worker.channel.close()
        if worker.pidfd is not None:
            os.close(worker.pidfd)
        cause = _describe_exit(returncode)

        def lost(job: _Job, message: str) -> None:
            job.packed.discard()
            settles.append((job.future, (None, BrokenWorkerError(message))))

        if worker.terminated is not None:
            if running is not None:
                lost(
                    running,
                    f"the worker process (pid {worker.pid}) running {running.name}() was "
                    f"terminated at shutdown: {worker.terminated}. The task's work is lost",
                )
            for job in stranded:
                lost(
                    job,
                    f"{job.name}() never ran: it was queued on the worker process "
                    f"(pid {worker.pid}) that shutdown terminated ({worker.terminated})",
                )
        elif running is not None:
            lost(
                running,
                f"the worker process (pid {worker.pid}) running {running.name}() died: "
                f"{cause}. The task's work is lost; other tasks are unaffected and a new "
                f"worker replaces it",
            )
        for job in doomed:
            lost(
                job,
                f"{_MAX_START_FAILURES} worker processes in a row died before they were "
                f"ready (the last one {cause}); their error output is above. "
                f"{job.name}() was never run",
            )

    def _stop_workers(self) -> None:
        with self._lock:
            workers = list(self._workers)
            self._workers.clear()
            self._idle.clear()
        for worker in workers:
            worker.channel.close()  # EOF tells the worker to exit
        for worker in workers:
            try:
                worker.process.wait(_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                _logger.warning(
                    "%r did not exit %s s after shutdown; killing it", worker, _STOP_TIMEOUT
                )
                worker.process.kill()
                worker.process.wait()
            if worker.pidfd is not None:
                os.close(worker.pidfd)

    def _fail_everything(self) -> None:
        with self._lock:
            self._closed = True  # later forks raise instead of waiting for ever
            jobs = list(self._pending)
            self._pending.clear()
            for worker in self._workers:
                jobs.extend(worker.inflight)
                worker.inflight.clear()
        for job in jobs:
            error = BrokenWorkerError(f"{self!r} failed internally; see the 'aiopar' log")
            _settle(job.future, (None, error))
        with contextlib.suppress(Exception):
            self._stop_workers()

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
        self._stop(cancel_pending, why)
        if wait:
            self._join()

    def _stop(self, cancel_pending: bool, why: str | None, *, renew: bool = False) -> None:
        """Close; with ``why``, terminate what still runs ``grace`` seconds
        from now (``renew``: from the last task that finished)."""
        with self._lock:
            self._closed = True
            queued: list[_Job] = []
            if cancel_pending:
                queued = list(self._pending)
                self._pending.clear()
            if why is not None and self._grace is not None and self._deadline is None:
                self._deadline = time.monotonic() + self._grace
                self._renew = renew
                self._why_terminated = why
            manager = self._manager
        started = []
        for job in queued:
            if job.future.cancel():
                job.packed.discard()
            else:
                started.append(job)  # resent after its worker died: it runs
        if started:
            with self._lock:
                self._pending.extendleft(reversed(started))
        if manager is None:
            self._segments.close()
        else:
            self._wake()

    def _join(self, timeout: float | None = None) -> bool:
        """Wait for the manager to finish; False if ``timeout`` passed first."""
        end = None if timeout is None else time.monotonic() + timeout
        manager = self._manager
        # A blocked callback may hand the manager's job to a new thread.
        while manager is not None and manager is not threading.current_thread():
            manager.join(None if end is None else max(0.0, end - time.monotonic()))
            if manager.is_alive():
                return False
            if manager is self._manager:
                break
            manager = self._manager
        return True

    def _after_fork(self) -> None:
        """Start afresh in a child made by os.fork(): only the forking thread
        lives on, so the manager is gone, a lock may be held for ever, and
        the workers are the parent's (the child must not hold their sockets
        open, or they would not see the parent shut them down)."""
        parent = self._pid
        jobs = [*self._pending, *(job for worker in self._workers for job in worker.inflight)]
        for worker in self._workers:
            worker.channel.close()
            if worker.pidfd is not None:
                os.close(worker.pidfd)
            _inherited.append(worker.process)
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
        self._segments.close_after_fork()
        self._fresh_state()
        for job in jobs:
            job.future._lock = threading.Lock()  # its holder may be a thread that is gone
            error = BrokenWorkerError(
                f"{job.name}() was forked on {self!r} in process {parent}, which then "
                f"forked this process (os.fork); the task runs for the parent, so its "
                f"result never reaches this copy of the future"
            )
            _settle(job.future, (None, error))


def _importable(path: list[Any]) -> list[str]:
    """The entries of ``sys.path`` a worker can use (strings and path objects)."""
    return [os.fspath(p) for p in path if isinstance(p, str | os.PathLike)]


def _settle(future: Future[Any], outcome: tuple[Any, BaseException | None] | None) -> None:
    """Settle ``future`` with ``outcome``, or cancel it if that is None.

    A done-callback runs here; whatever it raises (SystemExit and
    KeyboardInterrupt included) is the callback's business, not the
    pool's: it is logged, and the manager carries on.
    """
    try:
        if outcome is None:
            future.cancel()
        else:
            future._settle(*outcome)
    except BaseException as exc:
        _logger.error(
            "a done-callback of %r raised %s; the process backend logged and ignored it",
            future,
            type(exc).__name__,
            exc_info=exc,
        )


@atexit.register
def _shutdown_at_exit() -> None:
    # Registered after the Backend base class's own exit hook, so it runs
    # first (atexit runs in reverse) and that one finds these shut down.
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    backends = list(_backends)
    for backend in backends:
        grace = backend._grace
        if interrupted:
            why = f"still running {grace} s after an uncaught KeyboardInterrupt"
            backend._stop(True, why)
        else:
            why = f"the interpreter is exiting and no task finished for {grace} s"
            backend._stop(False, why, renew=True)
    for backend in backends:
        if not backend._join(timeout=1.0):
            _logger.warning(
                "%r: waiting for its running tasks before the interpreter exits "
                "(a worker is terminated once no task has finished for %s s)",
                backend,
                backend._grace,
            )
            backend._join()


def _after_fork_in_child() -> None:
    for backend in list(_backends):
        try:
            backend._after_fork()
        except Exception:
            _logger.exception("could not reset %r after os.fork()", backend)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _unregister(selector: selectors.BaseSelector, worker: _Worker) -> None:
    for fileobj in (worker.channel, worker.pidfd):
        if fileobj is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                selector.unregister(fileobj)


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = {
            "SIGKILL": " (the out-of-memory killer, or someone, killed it)",
            "SIGSEGV": " (a segmentation fault, usually in a C extension)",
        }.get(name, "")
        return f"it was killed by {name}{hint}"
    return f"it exited with code {returncode}"


def _remote_exception(info: tuple[bytes | None, str, str, str], task_name: str) -> BaseException:
    exc_bytes, kind, message, tb_text = info
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:
            exc = None
    if exc is None:
        exc = RemoteError(
            f"{kind}: {message} (raised by {task_name}() in a worker process; the exception "
            f"itself could not be pickled, so this stands in for it)"
        )
    exc.__cause__ = RemoteTraceback(tb_text)
    return exc


def _unpickling_failed(exc: BaseException, task_name: str) -> BaseException:
    error = TypeError(
        f"the result of {task_name}() came back from the worker process but could not be "
        f"unpickled here ({type(exc).__name__}: {exc}); is its class importable in this process?"
    )
    error.__cause__ = exc
    return error


def _find_unpicklable(task: Task) -> str:
    """Name the first part of the call that does not pickle, for the error message."""
    import cloudpickle

    parts: list[tuple[str, Any]] = [("the function", task.fn)]
    parts += [(f"argument {i}", arg) for i, arg in enumerate(task.args)]
    parts += [(f"keyword argument {key!r}", value) for key, value in task.kwargs.items()]
    for label, value in parts:
        try:
            cloudpickle.dumps(value, protocol=5, buffer_callback=lambda _: False)
        except Exception:
            return f"{label} (a {type(value).__module__}.{type(value).__qualname__})"
    return "part of the call"
