"""The process backend's pool: its workers, its queue, and the manager thread
that runs it.

One :class:`Pool` holds all of the state, behind one lock: the jobs not yet
sent, the workers (each with the jobs sent to it, in the order it runs
them), the idle ones, and how stopping is going. A fork hands a job to
:meth:`Pool.submit`, which sends it to an idle worker at once, in the
forking thread. Everything else happens in the manager thread, one select
loop (:meth:`Pool._manage`): it starts workers, reads their frames, settles
the futures, accounts for a worker that dies, and stops the workers once
the pool is closed. A done-callback that blocks in that thread hands the
loop over to a new one (:meth:`Pool.blocked`).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import logging
import math
import os
import pickle
import selectors
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from typing import Any

from .. import _interrupt
from .._errors import BrokenWorkerError
from .._fresh import importable
from .._future import Future, cancel_claimed, renew_lock
from .._shm import SegmentPool
from .._waiter import set_waiter
from . import _process_wire as wire
from ._base import Task
from ._process_handle import INITIALIZER_FAILED, Job, Worker, describe_exit
from ._process_pickle import Packed, remote_exception, unpickling_failed
from ._process_results import Unpicklers, calls_no_code

__all__ = ["GRACE", "Pool"]

_logger = logging.getLogger("aiopar")

# Adaptive prefetch: about this much work queued on a worker, at most this
# many tasks, each at most this big, all of them at most this many bytes;
# none while the tasks take this long on average (a round trip is then
# under a percent of a task, and a task not sent ahead can be cancelled).
PREFETCH_BUDGET_NS = 1_000_000
PREFETCH_LONG_NS = 50_000_000
PREFETCH_MAX_TASKS = 16
PREFETCH_MAX_CALL = 16 * 1024
PREFETCH_MAX_BYTES = 64 * 1024

# How many workers in a row may die before they are ready until the queued
# tasks are failed instead of starting yet another one.
MAX_START_FAILURES = 3

#: the default grace period of a bounded shutdown (see ProcessBackend)
GRACE = 5.0
# How long stopping waits for an idle worker to exit before killing it.
STOP_TIMEOUT = 10.0
# How long a terminated worker has to exit before it is killed.
KILL_AFTER = 1.0

# How long the manager waits for the rest of a frame a worker began to send
# before it holds the worker broken (a sound worker sends a frame at once).
STALL_TIMEOUT = 30.0

# A future and its outcome, (result, exception), or None to cancel it.
Settle = tuple[Future[Any], "tuple[Any, BaseException | None] | None"]

_pool_ids = itertools.count(1)
#: every pool of this process, for interpreter exit and os.fork()
_live: weakref.WeakSet[Pool] = weakref.WeakSet()
# Handles on workers that a process inherited through os.fork(): they are
# the parent's children, never to be waited for here.
_inherited: list[subprocess.Popen[bytes]] = []


class Pool:
    """The workers, the queue and the manager thread of one process backend.

    ``label`` names the backend in messages and logs. A worker that has
    been handed ``max_tasks_per_child`` jobs exits once it has run them and
    a new one takes its place (None: workers live as long as the pool).
    ``worker_options`` go to each :class:`~._process_handle.Worker`.
    Thread-safe: any thread may submit, close and join.
    """

    def __init__(
        self,
        max_workers: int,
        prefetch: int | None,
        grace: float | None,
        label: str,
        max_tasks_per_child: int | None = None,
        **worker_options: Any,
    ) -> None:
        self.max_workers = max_workers
        self.prefetch = prefetch
        self.max_tasks_per_child = max_tasks_per_child
        self._worker_options = worker_options  # for each Worker (its initializer, say)
        self.grace = grace
        self.label = label
        self._name = f"aiopar-process-{next(_pool_ids)}"  # of its threads
        self._mean_run_ns: int | None = None  # recent task run time (moving average)
        self._worker_index = itertools.count()
        self._generation = 0  # of the manager thread in charge
        self._fresh_state()
        _live.add(self)

    def _fresh_state(self) -> None:
        """No workers, no queue, no manager: a new pool, or a child's after os.fork()."""
        self.closed = False
        self.broken: str | None = None  # why, once a worker's initializer raised
        self.pid = os.getpid()
        self.segments = SegmentPool()  # what calls are packed into
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified for drain()
        self._draining = 0  # threads in drain()
        self._rounds = 0  # rounds the manager has finished (see drain)
        self._pending: deque[Job] = deque()
        self._workers: list[PoolWorker] = []
        self._idle: list[PoolWorker] = []
        self._starting = 0  # workers started and not ready yet
        self._start_failures = 0
        self._results = Unpicklers(self._name, self._results_idle, self)  # see _on_outcome
        self._manager: threading.Thread | None = None
        self._dispatch_asked = False  # the manager has been woken to send what is queued
        self._unsure: tuple[PoolWorker, Job] | None = None  # see _send_now
        self._wake_lock = threading.RLock()  # RLock: finalizers may re-enter
        self._wake_r = self._wake_w = -1  # the manager's wake-up pipe, made with it
        self._unmapped: deque[tuple[Worker, int]] = deque()
        # Past this time.monotonic(), the workers still running a task are
        # terminated; with _renew, each task that finishes pushes it on.
        self._deadline: float | None = None
        self._renew = False
        self._why_terminated = ""
        # sys.path as last seen by a fork, what of it workers can use, and
        # how many times it changed (a worker with an older one gets it).
        self._sys_path = list(sys.path)
        self._path = importable(self._sys_path)
        self._path_version = 0

    def __repr__(self) -> str:
        return self.label

    @property
    def workers(self) -> list[Worker]:
        """The worker processes, starting or running (a copy)."""
        with self._lock:
            return list(self._workers)

    def running_tasks(self) -> list[str]:
        """Names of the tasks the workers are running now."""
        with self._lock:
            return [worker.inflight[0].name for worker in self._workers if worker.inflight]

    def prefetch_depth(self) -> int:
        """How many jobs beyond the running one a worker may hold now: by
        default about a millisecond of work at the tasks' recent pace, and
        none until a task has finished or while tasks take 50 ms or more."""
        if self.prefetch is not None:
            return self.prefetch
        mean = self._mean_run_ns
        if mean is None or mean >= PREFETCH_LONG_NS:
            return 0
        return max(1, min(PREFETCH_MAX_TASKS, PREFETCH_BUDGET_NS // (mean + 1)))

    # -- submitting ----------------------------------------------------------

    def check_open(self) -> None:
        """Raise RuntimeError unless the pool takes jobs from this process:
        :class:`~aiopar.BrokenWorkerError`, a ``BrokenProcessPool``, once a
        worker's initializer raised."""
        if self.closed:
            if self.broken is not None:
                raise BrokenWorkerError(self._broken_message())
            raise RuntimeError(f"cannot fork on {self.label}: it has been shut down")
        if os.getpid() != self.pid:  # forked by C code that ran no at-fork hooks
            raise RuntimeError(
                f"{self.label} belongs to process {self.pid}; a child made with fork() "
                f"must create its own backend"
            )

    def submit(self, job: Job) -> None:
        """Queue the job, or send it at once if a worker can take it; raises
        RuntimeError if the pool was closed meanwhile."""
        if sys.path != self._sys_path:  # cheap while it is the same: compared item by item
            with self._lock:
                self._sys_path = list(sys.path)
                self._path = importable(self._sys_path)
                self._path_version += 1
        with self._lock:
            if self.closed:
                job.packed.discard()
                self.check_open()
            if _interrupt.on_main_thread():
                self._submit_on_main_thread(job)
                return
            self._pending.append(job)
            self._dispatch()
            if self._pending:
                if self._manager is None:
                    self._start_manager()
                elif len(self._workers) < self.max_workers:
                    self._wake()  # the manager starts workers

    # The main thread runs the signal handlers, and there Ctrl-C raises a
    # KeyboardInterrupt as any call returns: handing a job to a worker takes
    # several calls (the job claimed, the worker off the idle list, the job
    # recorded in flight, its frames sent), and one interrupted half way
    # would leave the worker's stream out of step with what the pool
    # expects of it. So the main thread leaves the queue to the manager,
    # which no signal interrupts, and sends only its own small task to a
    # worker itself (the quick round trip of a script's fork and wait);
    # every hand-over notes itself first: see _send_now.

    def _submit_on_main_thread(self, job: Job) -> None:
        # Called with the lock held.
        self._finish_send()
        worker = self._worker_for_now(job)
        if worker is not None:
            self._send_now(worker, job)
            return
        self._pending.append(job)
        if self._manager is None:
            self._start_manager()
        elif not self._dispatch_asked:
            self._wake()
            self._dispatch_asked = True  # once woken: a Ctrl-C in _wake leaves it to the next fork

    def _worker_for_now(self, job: Job) -> PoolWorker | None:
        """The worker the main thread may send the job to itself: the one
        :meth:`_worker_for` picks, for a small task with nothing queued
        before it; None if the job is to be queued. Called with the lock held."""
        if self._pending or job.kind != wire.TASK or not _prefetchable(job):
            return None
        return self._worker_for(job)

    def _worker_for(self, job: Job) -> PoolWorker | None:
        """The worker to hand the job to now, or None to keep it queued.

        An idle worker first. A job goes ahead to a busy worker (prefetch)
        only when no worker is idle or starting and the pool has all its
        workers, so tasks forked at once run on as many workers as the pool
        may have, on a fresh pool too; and only a
        small call, within the prefetch depth, what the worker's socket
        buffers, and the worker's ``max_tasks_per_child``. Called with the
        lock held.
        """
        if self._idle:
            return self._idle[-1]
        if self._starting or len(self._workers) < self.max_workers or not _prefetchable(job):
            return None  # a worker is, or can be, on its way
        depth = self.prefetch_depth()
        size = len(job.packed.payload)
        for worker in self._workers:
            if (
                worker.ready
                and not worker.stopping
                and 0 < len(worker.inflight) <= depth
                and self._takes_more(worker)
                and worker.inflight.queued_bytes + size <= PREFETCH_MAX_BYTES
            ):
                return worker
        return None

    def _takes_more(self, worker: PoolWorker) -> bool:
        """Whether the worker may be handed another job (max_tasks_per_child)."""
        limit = self.max_tasks_per_child
        return limit is None or worker.handed < limit

    def _dispatch(self) -> None:
        """Hand the queued jobs, oldest first, to the workers that can take
        them (see :meth:`_worker_for`). Called with the lock held."""
        self._finish_send()
        pending = self._pending
        while pending:
            worker = self._worker_for(pending[0])
            if worker is None:
                return
            self._send_now(worker, pending.popleft())

    def _send_now(self, worker: PoolWorker, job: Job) -> None:
        """Hand the job to the worker, unless it was cancelled: the one way
        a job goes to a worker.

        On the main thread a signal handler's exception may end this after
        any call. The worker and job are noted first, by a plain store,
        which no signal handler interrupts, and the note is cleared last;
        whoever takes the lock next to send a job or to read a reply
        finishes the send first (:meth:`_finish_send`), so nothing that
        waits for the worker waits for this send. The main thread sends only
        small frames, which fit in the socket's buffer, so they go whole or
        not at all. Called with the lock held.
        """
        self._unsure = (worker, job)
        if job.claim():
            if worker in self._idle:
                self._idle.remove(worker)
            self._send(worker, job)
        self._unsure = None

    def _finish_send(self) -> None:
        """Finish the send that a signal handler's exception cut short in
        :meth:`_send_now`, if one was, doing each step again unless it was
        done. Its frame may have gone: a worker drops a task frame it got
        twice. Called with the lock held, before anything else looks at the
        workers' jobs; a signal that cuts this short too leaves the note
        for the next one."""
        if self._unsure is None:
            return
        worker, job = self._unsure
        if job.claim():
            if worker in self._idle:
                self._idle.remove(worker)
            if job in worker.inflight:
                self._transmit(worker, job)
            else:
                self._send(worker, job)
        else:  # its task never started: it is dropped
            if job in worker.inflight:
                worker.inflight.remove(job)
            if not (worker.inflight or worker.stopping or worker in self._idle):
                self._idle.append(worker)
        self._unsure = None

    def _send(self, worker: PoolWorker, job: Job) -> None:
        # Called with the lock held.
        worker.inflight.append(job)
        worker.handed += 1
        if self._renew:  # at exit: a job that starts after a quiet spell has its whole grace
            self._deadline = time.monotonic() + self.grace  # type: ignore[operator]
        self._transmit(worker, job)

    def _transmit(self, worker: Worker, job: Job) -> None:
        # The frames of the job, which is the last in flight on the worker.
        # Called with the lock held.
        try:
            if worker.path_version != self._path_version:
                # Before the task, so its function unpickles on the new path.
                path = Packed(pickle.dumps(self._path, protocol=5), [], None, None)
                worker.channel.send(wire.PATH, packed=path)
                worker.path_version = self._path_version
            if job.skip:
                skip = Packed(pickle.dumps(job.skip, protocol=5), [], None, None)
                worker.channel.send(wire.SKIP, job.id, skip)
            traced = job.record is not None  # the worker records its forks then
            worker.channel.send(job.kind, job.id, job.packed, owner=worker, t0=traced)
        except OSError:
            # The worker is dying; the manager notices through its pidfd and
            # requeues this job, which the worker never received.
            worker.inflight.remove(job)
            self._pending.appendleft(job)
            worker.stopping = True
            if worker in self._idle:
                self._idle.remove(worker)

    # -- the manager thread ---------------------------------------------------

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError):
                    os.write(self._wake_w, b"\0")

    def _results_idle(self) -> None:
        # The manager waits for the unpicklers only to stop, and drain() for
        # them to be done: each reads its flag after the work count went
        # down, and the manager and drain() read that count after the flag.
        if self.closed:
            self._wake()
        if self._draining:
            self._tell_drainers()

    def _tell_drainers(self) -> None:
        with self._lock:
            self._quiet.notify_all()

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

    # The waiter protocol of the manager and unpickler threads: Future.wait
    # calls these in one when a done-callback run there blocks (say, on
    # another process task). If it is the manager, a new one takes over, so
    # the results that callback waits for still arrive; the blocked thread
    # exits once its callback returns. An unpickler blocks no other result.
    def blocked(self) -> None:
        with self._lock:
            if self._manager is threading.current_thread():
                self._start_manager()

    def blocked_long(self) -> None:
        pass

    def resumed(self) -> None:
        pass

    def _manage(self, generation: int) -> None:
        """The manager thread, in phases as ``concurrent.futures``' is: hand
        out work (:meth:`_add_work`), wait for the workers
        (:meth:`_Watch.ready`), account for what each sent or how it exited
        (:meth:`_handle`), and settle the futures last."""
        set_waiter(self)
        watch = _Watch(self._wake_r)
        settles: list[Settle] = []
        handed_off = False
        try:
            while True:
                stop = self._add_work(watch, settles)
                # Settled last, right before select() lets go of the GIL, so
                # a waiter that wakes up finds it free.
                if settles and self._settle_all(settles, generation):
                    handed_off = True
                    return
                self._rounds += 1  # before reading _draining: see _results_idle
                if self._draining:
                    self._tell_drainers()
                if stop:
                    break
                for fileobj, worker in watch.ready():
                    self._handle(fileobj, worker, watch, settles)
            self._stop_workers()
        except BaseException:
            _logger.exception("the manager thread of %s failed; failing its tasks", self.label)
            for future, outcome in settles:
                settle(future, outcome)
            self._fail_everything()
            raise
        finally:
            watch.selector.close()
            if not handed_off:
                self._manager_done()

    def _add_work(self, watch: _Watch, settles: list[Settle]) -> bool:
        """Enforce the deadline, hand the queued jobs to the workers, start
        the workers they need and watch the new ones, adding the futures to
        settle to ``settles``. True once the pool is closed and has nothing
        left to do."""
        watch.timeout = None if self._deadline is None else self._enforce_deadline(settles)
        with self._lock:
            self._dispatch_asked = False
            self._dispatch()  # what the main thread queued
            if self._pending and len(self._workers) < self.max_workers:
                for job, error in self._start_workers():
                    job.packed.discard()
                    settles.append((job.future, (None, error)))
            # Workers are only ever added here, and dropped from both lists
            # once they are gone: the sizes tell whether one is new.
            if len(watch.workers) != len(self._workers):
                watch.add_new(self._workers)
            return self.closed and not self._pending and not self._busy() and not self._results.busy

    def _handle(
        self, fileobj: Any, worker: PoolWorker | None, watch: _Watch, settles: list[Settle]
    ) -> None:
        """Account for what ``fileobj`` has to say: the wake-up pipe (None
        for a worker), a worker's socket, or its pidfd (it exited)."""
        if worker is None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._wake_r, 4096)
            self._send_releases()
            return
        if worker not in watch.workers:
            return  # gone earlier in this round
        if fileobj is worker.channel:
            self._read(worker, watch, settles)
            if worker.eof and worker in self._workers:
                with contextlib.suppress(KeyError, ValueError):
                    watch.selector.unregister(worker.channel)
        else:
            self._worker_died(worker, watch, settles)
        if worker not in self._workers:
            watch.workers.discard(worker)

    def _manager_done(self) -> None:
        """Let go of what the last manager thread used, once the pool is done."""
        with self._wake_lock:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        self._results.stop()
        self._results.join()
        self._let_go()

    def _let_go(self) -> None:
        """Let go of what only a running pool needs, once it is closed and
        its manager is gone: no worker starts again, so the initializer and
        its ``initargs`` go, as concurrent.futures' executors let theirs go
        at shutdown (multiprocessing's queues and locks among them are
        freed with their semaphores while a future that refers to this pool
        lives on)."""
        self._worker_options = {}
        self.segments.close()

    def _settle_all(self, settles: list[Settle], generation: int) -> bool:
        """Settle the futures; True if a callback blocked and a new manager
        took over (this thread then only finishes its own list)."""
        for i, (future, outcome) in enumerate(settles):
            settle(future, outcome)
            if generation != self._generation:
                # The new manager never saw these, so they are settled here.
                for future, outcome in settles[i + 1 :]:
                    settle(future, outcome)
                return True
        settles.clear()
        return False

    def _start_workers(self) -> list[tuple[Job, BaseException]]:
        """Start one worker per queued job, up to max_workers.

        Called with the lock held; returns the jobs to fail (after the lock
        is released) if no worker could be started at all.
        """
        wanted = min(len(self._pending) - self._starting, self.max_workers - len(self._workers))
        for _ in range(max(wanted, 0)):
            try:
                self._workers.append(self._new_worker())
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
            self._starting += 1
        return []

    def _new_worker(self) -> PoolWorker:
        pool_ref = weakref.ref(self)

        def unmapped(worker: Worker, seg_id: int) -> None:
            # May run in any thread, from a garbage-collector finalizer: no
            # locks, and no reference that keeps the pool alive.
            pool = pool_ref()
            if pool is not None:
                pool._unmapped.append((worker, seg_id))
                pool._wake()

        index = next(self._worker_index)
        return PoolWorker(
            index, self._path, self._path_version, self.segments, unmapped, **self._worker_options
        )

    def _send_releases(self) -> None:
        """Tell the workers which of their segments this process no longer maps."""
        by_worker: dict[Worker, list[int]] = {}
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

    # -- frames and outcomes ---------------------------------------------------

    def _read(self, worker: PoolWorker, watch: _Watch, settles: list[Settle]) -> None:
        """Handle the frames waiting on the worker's socket, adding the futures
        to settle to ``settles``. A worker whose socket carries anything that
        is not a frame it owes is broken (:meth:`_break`)."""
        channel = worker.channel
        try:
            while True:
                frame = channel.recv()
                if frame is not None and (outcome := self._on_frame(worker, frame)):
                    settles.append(outcome)
                del frame
                if not channel.has_frame():
                    return
        except wire.BadFrame as exc:
            self._break(worker, str(exc), watch, settles)
        except (EOFError, OSError):
            with self._lock:
                worker.eof = True
                worker.stopping = True
                if worker in self._idle:
                    self._idle.remove(worker)
            if worker.pidfd is None:  # no pidfd to tell when it has exited
                self._worker_died(worker, watch, settles)

    def _on_frame(self, worker: PoolWorker, frame: wire.Frame) -> Settle | None:
        """Account for the frame; return the settling of its future, which the
        caller does last (a done-callback may block, see blocked). Raises
        :class:`~._process_wire.BadFrame` for a frame the worker does not owe."""
        kind = frame.kind
        if kind == wire.RESULT or kind == wire.ERROR:
            return self._on_outcome(worker, frame)
        if kind == wire.TRACE:  # about the running task; its result comes next
            with self._lock:
                self._finish_send()
                job = self._owed(worker, frame)
            job.forks = frame.loads()
        elif kind == wire.READY and not worker.ready:
            with self._lock:
                worker.ready = True
                self._starting -= 1
                self._start_failures = 0
                if not worker.stopping:
                    self._idle.append(worker)
                self._dispatch()
        else:
            raise wire.BadFrame(f"a frame of kind {kind}, which it never sends at this point")
        return None

    def _on_outcome(self, worker: PoolWorker, frame: wire.Frame) -> Settle | None:
        """Account for the outcome of the worker's running job; return the
        settling of its future if its pickle loads at once, else hand that
        to an unpickler thread and return None."""
        with self._lock:
            self._finish_send()
            job = self._owed(worker, frame)
            worker.inflight.popleft()
            if not worker.inflight and not worker.stopping:
                if self._takes_more(worker):
                    self._idle.append(worker)
                else:
                    self._retire(worker)
            self._dispatch()
        run = frame.t1 - frame.t0
        mean = self._mean_run_ns
        self._mean_run_ns = run if mean is None else mean + (run - mean) // 8
        if self._renew and self._deadline is not None:
            self._deadline = time.monotonic() + self.grace  # type: ignore[operator]
        record = job.record
        if record is not None:
            # Tasks run on the worker's main thread, whose tid is its pid.
            record.on_remote_run(
                frame.t0, frame.t1, worker.pid, worker.pid, f"process worker {worker.index}"
            )
            if job.forks is not None:
                record.on_remote_forks(job.forks)
        quick = frame.kind == wire.RESULT and not frame.buffers and calls_no_code(frame.payload)
        if quick or not self._results.run(functools.partial(_settle_from, job, frame)):
            return job.future, _outcome(job, frame)
        return None

    @staticmethod
    def _owed(worker: Worker, frame: wire.Frame) -> Job:
        """The job the worker is running, which the frame must be about."""
        if not worker.inflight or worker.inflight[0].id != frame.msg_id:
            running = f"job {worker.inflight[0].id}" if worker.inflight else "no job"
            raise wire.BadFrame(
                f"a frame of kind {frame.kind} about job {frame.msg_id}, where it runs {running}"
            )
        return worker.inflight[0]

    def _retire(self, worker: PoolWorker) -> None:
        """Let the worker go, its ``max_tasks_per_child`` jobs done: the end
        of its socket tells it to exit, as at shutdown, and a new worker
        takes its place when there is work. Called with the lock held."""
        worker.stopping = True
        with contextlib.suppress(OSError):
            worker.channel.sock.shutdown(socket.SHUT_WR)

    def _break(self, worker: PoolWorker, what: str, watch: _Watch, settles: list[Settle]) -> None:
        """The worker's socket carried ``what``, which is no frame it owes:
        nothing more it sends can be trusted, so it is killed and its jobs
        fail, as if it had died; the rest of the pool carries on."""
        _logger.warning("%s: killing %r, whose socket carried %s", self.label, worker, what)
        worker.broken = what
        with contextlib.suppress(OSError):
            worker.process.kill()
        self._worker_died(worker, watch, settles)

    def _worker_died(self, worker: PoolWorker, watch: _Watch, settles: list[Settle]) -> None:
        """Account for a worker's exit, adding the futures to settle to
        ``settles``: what it finished still counts, what it was running
        fails, what was queued on it runs elsewhere (or fails, if its
        socket broke: whether it ran is not known)."""
        if worker.broken is None:
            self._read_last_frames(worker, settles)
        returncode = worker.process.wait()
        with self._lock:
            losses = self._drop(worker, returncode)
        worker.unregister(watch.selector)  # before closing: the numbers may be reused
        worker.close()
        for job, message in losses:
            job.packed.discard()
            outcome = None if message is None else (None, BrokenWorkerError(message))
            settles.append((job.future, outcome))

    def _read_last_frames(self, worker: PoolWorker, settles: list[Settle]) -> None:
        """Handle what the worker sent before it exited."""
        with contextlib.suppress(OSError, EOFError):
            worker.channel.sock.setblocking(False)
            while True:
                try:
                    frame = worker.channel.recv()
                    if frame is not None and (outcome := self._on_frame(worker, frame)):
                        settles.append(outcome)
                except BlockingIOError:
                    return
                except wire.BadFrame as exc:
                    worker.broken = str(exc)
                    return

    def _drop(self, worker: PoolWorker, returncode: int) -> list[tuple[Job, str | None]]:
        """Take the worker, which exited with ``returncode``, off the pool;
        requeue what it had not started; return the jobs to fail, each with
        what to tell (None: to cancel, it never started). Called with the
        lock held."""
        cause = describe_exit(returncode)
        self._finish_send()
        self._workers.remove(worker)
        if worker in self._idle:
            self._idle.remove(worker)
        if not worker.ready:
            self._starting -= 1
        jobs = list(worker.inflight)
        worker.inflight.clear()
        if worker.terminated is None and worker.broken is None:  # run them elsewhere
            for job in reversed(jobs[1:]):
                self._pending.appendleft(job)
                if job.packed.segment is not None:
                    job.packed.segment.owner = None
            del jobs[1:]
        self.segments.release_owner(worker)
        losses = _losses(worker, cause, jobs)
        if not worker.ready and not self.closed and returncode == INITIALIZER_FAILED:
            losses += self._break_pool(f"the initializer of a worker process raised ({cause})")
        elif not worker.ready and not self.closed:
            self._start_failures += 1
            if self._start_failures >= MAX_START_FAILURES:
                losses += [(job, _never_run(job, cause)) for job in self._pending]
                self._pending.clear()
        self._dispatch()
        return losses

    def _break_pool(self, reason: str) -> list[tuple[Job, str | None]]:
        """Break the pool, as concurrent.futures breaks one whose initializer
        raised: it takes no more jobs (:meth:`check_open` says ``reason``),
        its queued jobs fail, and the jobs its workers run finish. Returns
        the queued jobs, each with what to tell. Called with the lock held."""
        self.broken = reason
        self.closed = True
        losses: list[tuple[Job, str | None]] = [
            (job, f"{job.name}() never ran: {self._broken_message()}") for job in self._pending
        ]
        self._pending.clear()
        return losses

    def _broken_message(self) -> str:
        return (
            f"{self.label} is broken: {self.broken}; its error output is above. Create a "
            f"new pool (and fix the initializer)"
        )

    # -- draining --------------------------------------------------------------

    def drain(self) -> bool:
        """Return once no job is queued, on a worker or being unpickled, and
        every future of one that was is settled; True if there was one to
        wait for. The pool stays open, so jobs submitted meanwhile are
        waited for too. Waits in slices of :data:`aiopar._interrupt.SLICE`,
        so that Ctrl-C ends it on the main thread."""
        waited = False
        with self._lock:
            self._draining += 1
            try:
                while True:
                    if not self._quiet_now():
                        waited = True
                        self._quiet.wait(_interrupt.SLICE)
                    elif self._round_passed():
                        return waited
            finally:
                self._draining -= 1

    def _quiet_now(self) -> bool:
        # Called with the lock held.
        return not self._pending and not self._busy() and not self._results.busy

    def _round_passed(self) -> bool:
        """Wait for the manager to end the round it is in, whose outcomes
        it settles last, after the jobs have left the workers; True if the
        pool was still quiet then. Called with the lock held."""
        manager = self._manager
        if manager is None or not manager.is_alive():
            return True
        seen = self._rounds
        self._wake()
        while self._rounds == seen and manager is self._manager and manager.is_alive():
            self._quiet.wait(_interrupt.SLICE)
        return self._quiet_now()

    # -- stopping --------------------------------------------------------------

    def close(self, cancel_pending: bool, why: str | None, *, renew: bool = False) -> None:
        """Take no more jobs; the manager stops the workers once the queue
        is done. With ``cancel_pending`` the queued jobs are cancelled; with
        ``why``, the workers still running a job ``grace`` seconds from now
        (``renew``: from the last job that finished) are terminated."""
        with self._lock:
            self.closed = True
            queued: list[Job] = []
            if cancel_pending:
                queued = list(self._pending)
                self._pending.clear()
            if why is not None:
                self._arm_deadline(why, renew)
            manager = self._manager
        for job in queued:  # none started, though one may have been sent to a worker that died
            job.packed.discard()
            settle(job.future, None)
        if manager is None:
            self._let_go()
        else:
            self._wake()

    def _arm_deadline(self, why: str, renew: bool) -> None:
        """Terminate the workers still running a job ``grace`` seconds from
        now (``renew``: from the last job that finished), telling their
        futures ``why``; unless a deadline is set already. Called with the
        lock held."""
        if self.grace is not None and self._deadline is None:
            self._deadline = time.monotonic() + self.grace
            self._renew = renew
            self._why_terminated = why

    def at_exit(self) -> None:
        """The interpreter begins to exit: what is queued still runs (exit
        drains the pool), but once ``grace`` seconds pass with no job
        finishing, the workers still running one are terminated and the
        rest of the queue is cancelled."""
        with self._lock:
            self._arm_deadline(_exiting_why(self.grace), renew=True)
        self._wake()  # the manager sleeps until the deadline at most

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the manager to finish; False if ``timeout`` passed first.

        In a thread the manager waits for (its own, or an unpickler's: a
        done-callback runs there) this returns at once.
        """
        if self._results.serving():
            return True
        end = None if timeout is None else time.monotonic() + timeout
        manager = self._manager
        # A blocked callback may hand the manager's job to a new thread.
        while manager is not None and manager is not threading.current_thread():
            _interrupt.join(manager, None if end is None else max(0.0, end - time.monotonic()))
            if manager.is_alive():
                return False
            if manager is self._manager:
                break
            manager = self._manager
        return True

    def _enforce_deadline(self, settles: list[Settle]) -> float | None:
        """Once the deadline has passed, terminate the workers still running a
        job (kill them a second later) and drop the queue, adding the futures
        to ``settles``; return how long the manager may sleep (None: until
        something happens)."""
        if self._deadline is None:
            return None
        now = time.monotonic()
        due = now >= self._deadline
        wake_at = math.inf if due else self._deadline
        why = self._why_terminated
        terminating = []
        with self._lock:
            if due:
                for job in self._pending:  # none started: each is cancelled
                    job.packed.discard()
                    settles.append((job.future, None))
                self._pending.clear()
            for worker in self._workers:
                if worker.terminated is None:
                    if not due or not worker.inflight:
                        continue
                    terminating.append((worker, worker.inflight[0].name))
                    worker.terminated = why
                    worker.kill_at = now + KILL_AFTER
                    worker.process.terminate()
                elif now >= worker.kill_at:
                    worker.kill_at = math.inf
                    worker.process.kill()
                wake_at = min(wake_at, worker.kill_at)
        for worker, name in terminating:
            _logger.warning(
                "%s: terminating %r, which is still running %s(): %s "
                "(ProcessBackend(grace=...) sets how long a shutdown waits)",
                self.label,
                worker,
                name,
                why,
            )
        return None if wake_at == math.inf else wake_at - now

    def _busy(self) -> bool:
        return any(worker.inflight for worker in self._workers)

    def _stop_workers(self) -> None:
        with self._lock:
            workers = list(self._workers)
            self._workers.clear()
            self._idle.clear()
        for worker in workers:
            worker.channel.close()  # EOF tells the worker to exit
        for worker in workers:
            try:
                worker.process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                _logger.warning(
                    "%r did not exit %s s after shutdown; killing it", worker, STOP_TIMEOUT
                )
                worker.process.kill()
                worker.process.wait()
            if worker.pidfd is not None:
                os.close(worker.pidfd)

    def _fail_everything(self) -> None:
        with self._lock:
            self.closed = True  # later forks raise instead of waiting for ever
            jobs = list(self._pending)
            self._pending.clear()
            for worker in self._workers:
                jobs.extend(worker.inflight)
                worker.inflight.clear()
        for job in jobs:
            error = BrokenWorkerError(f"{self.label} failed internally; see the 'aiopar' log")
            settle(job.future, (None, error))
        with contextlib.suppress(Exception):
            self._stop_workers()

    def _after_fork(self) -> None:
        """Start afresh in a child made by os.fork(): only the forking thread
        lives on, so the manager is gone, a lock may be held for ever, and
        the workers are the parent's (the child must not hold their sockets
        open, or they would not see the parent shut them down)."""
        parent = self.pid
        jobs = [*self._pending, *(job for worker in self._workers for job in worker.inflight)]
        for worker in self._workers:
            worker.close()
            _inherited.append(worker.process)
        if self._wake_r >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
        self.segments.close_after_fork()
        self._fresh_state()
        for job in jobs:
            renew_lock(job.future)
            error = BrokenWorkerError(
                f"{job.name}() was forked on {self.label} in process {parent}, which then "
                f"forked this process (os.fork); the task runs for the parent, so its "
                f"result never reaches this copy of the future"
            )
            settle(job.future, (None, error))


class PoolWorker(Worker):
    """A worker process as its pool accounts for it: how many jobs it was
    handed, and what its socket carried that broke it (None while sound)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed = 0
        self.broken: str | None = None
        self.channel.stall_timeout = STALL_TIMEOUT  # the manager reads it


class _Watch:
    """What one manager thread waits on: its wake-up pipe, and each worker's
    socket and pidfd (a selector key's data is its worker, None for the pipe)."""

    def __init__(self, wake_r: int) -> None:
        self.selector = selectors.DefaultSelector()
        self.selector.register(wake_r, selectors.EVENT_READ, None)
        self.workers: set[PoolWorker] = set()
        self.timeout: float | None = None  # how long ready() may wait: for ever
        self._resuming = True

    def add_new(self, workers: list[PoolWorker]) -> None:
        """Watch the workers not watched yet."""
        for worker in workers:
            if worker not in self.workers:
                self.workers.add(worker)
                if not worker.eof:
                    self.selector.register(worker.channel, selectors.EVENT_READ, worker)
                if worker.pidfd is not None:
                    self.selector.register(worker.pidfd, selectors.EVENT_READ, worker)

    def ready(self) -> list[tuple[Any, PoolWorker | None]]:
        """What there is to read, as (file, worker): at first the frames a
        previous manager read but left unhandled, then what select() finds."""
        if self._resuming:
            self._resuming = False
            buffered: list[tuple[Any, PoolWorker | None]] = [
                (w.channel, w) for w in self.workers if not w.eof and _buffered(w)
            ]
            if buffered:
                return buffered
        return [(key.fileobj, key.data) for key, _ in self.selector.select(self.timeout)]


def _buffered(worker: Worker) -> bool:
    """Whether a whole frame, or something that is not one, waits in the
    worker's channel's buffer."""
    try:
        return worker.channel.has_frame()
    except wire.BadFrame:
        return True  # for _read to find


def _outcome(job: Job, frame: wire.Frame) -> tuple[Any, BaseException | None]:
    """The outcome the job's RESULT or ERROR frame carries."""
    try:
        if frame.kind == wire.RESULT:
            return frame.loads(), None
        return None, remote_exception(frame.loads(), job.name)
    except BaseException as exc:
        return None, unpickling_failed(exc, job.name)


def _settle_from(job: Job, frame: wire.Frame) -> None:
    """Settle the job's future with the outcome its frame carries."""
    settle(job.future, _outcome(job, frame))


def _losses(worker: PoolWorker, cause: str, jobs: list[Job]) -> list[tuple[Job, str | None]]:
    """What to tell the futures of the jobs a gone worker still had: the
    first it was running, the others it had been sent (``cause``: how it
    exited); None for one that is cancelled, as it surely never started."""
    pid = worker.pid
    if worker.broken is not None:
        return [
            (
                job,
                f"the worker process (pid {pid}) {'running' if i == 0 else 'sent'} "
                f"{job.name}() was killed: its socket carried {worker.broken}. Whether the "
                f"task ran is unknown; other tasks are unaffected and a new worker replaces it",
            )
            for i, job in enumerate(jobs)
        ]
    if worker.terminated is not None:  # the jobs behind the running one are cancelled
        return [
            (
                job,
                f"the worker process (pid {pid}) running {job.name}() was terminated at "
                f"shutdown: {worker.terminated}. The task's work is lost"
                if i == 0
                else None,
            )
            for i, job in enumerate(jobs)
        ]
    return [
        (
            job,
            f"the worker process (pid {pid}) running {job.name}() died: {cause}. The task's "
            f"work is lost; other tasks are unaffected and a new worker replaces it",
        )
        for job in jobs
    ]


def _never_run(job: Job, cause: str) -> str:
    return (
        f"{MAX_START_FAILURES} worker processes in a row died before they were "
        f"ready (the last one {cause}); their error output is above. "
        f"{job.name}() was never run"
    )


def _prefetchable(job: Job) -> bool:
    """Whether the job is small enough to go to a worker that is busy."""
    return job.packed.segment is None and len(job.packed.payload) <= PREFETCH_MAX_CALL


def settle(future: Future[Any], outcome: tuple[Any, BaseException | None] | None) -> None:
    """Settle ``future`` with ``outcome``, or cancel it if that is None (the
    pool cancels only a task it knows never started, sent to a worker or
    not).

    A done-callback runs here; whatever it raises (SystemExit and
    KeyboardInterrupt included) is the callback's business, not the
    pool's: it is logged, and the manager carries on.
    """
    try:
        if outcome is None:
            if not future.cancel():
                cancel_claimed(future)  # sent to a worker that never got to it
        else:
            Task.settle(future, outcome)
    except BaseException as exc:
        _logger.error(
            "a done-callback of %r raised %s; the process backend logged and ignored it",
            future,
            type(exc).__name__,
            exc_info=exc,
        )


def _interrupted() -> bool:
    return isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)


def _exiting_why(grace: float | None) -> str:
    return f"the interpreter is exiting and no task finished for {grace} s"


def _bound_exit_drain() -> None:
    # Exit's first stage drains every backend (backends._exit): bounded by
    # each pool's grace from its start, so a task that never returns does
    # not hold exit for ever.
    if not _interrupted():
        for pool in list(_live):
            pool.at_exit()


# Registered after exit's own hooks (``._base`` imports ``._exit`` first),
# so each runs first (both kinds run in reverse): the drain starts with
# the deadline set, and exit's shutdown finds these pools stopped. While
# they wait, exit names the running tasks, once (backends._exit).
with contextlib.suppress(RuntimeError):  # imported as threads are joined: no drain follows
    threading._register_atexit(_bound_exit_drain)  # type: ignore[attr-defined]


@atexit.register
def _stop_at_exit() -> None:
    interrupted = _interrupted()
    pools = list(_live)
    for pool in pools:
        if interrupted:
            why = f"still running {pool.grace} s after an uncaught KeyboardInterrupt"
            pool.close(True, why)
        else:
            pool.close(False, _exiting_why(pool.grace), renew=True)
    for pool in pools:
        pool.join()


def _after_fork_in_child() -> None:
    for pool in list(_live):
        try:
            pool._after_fork()
        except Exception:
            _logger.exception("could not reset %s after os.fork()", pool.label)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
