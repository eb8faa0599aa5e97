"""The "thread" backend (the default): a work-first pool of interop worker threads.

Scheduling follows Java's ForkJoinPool, TBB and rayon. A task forked inside
one of the pool's tasks goes to its worker's own deque; every other fork
goes to the pool's shared queue. A worker takes its own deque newest first,
then steals oldest first from the other workers' deques, then takes the
shared queue oldest first: work already started is finished before new work
begins, so the tasks a blocked task waits for are never stuck behind
unrelated ones. A worker that waits first runs the queued tasks it forked
itself, newest first (see :meth:`_Worker.run_own_forks`).

Workers start lazily, up to ``max_workers``. A worker that blocks in
``wait`` is counted out of the pool while it waits, and a compensating
worker starts if work is queued, so nested fork/wait never starves the pool;
surplus workers retire once the blocked ones come back. At most
``COMPENSATION_LIMIT`` workers are added that way: past it, queued tasks wait
for a worker to come back, as in a fixed-size pool. Each task counts against
the intra-op thread budget (``aiopar._budget``) through its thread's slot.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import weakref
from typing import Any, ClassVar

from .. import _budget, _budget_slots, _interrupt
from .._budget_slots import Slot, probe, use_slot
from .._future import CANCELLED, Future
from .._waiter import set_waiter
from ._base import Backend, Task, check_count

__all__ = ["COMPENSATION_LIMIT", "ThreadBackend"]

#: workers a pool may add beyond ``max_workers`` while others are blocked in ``wait``
COMPENSATION_LIMIT = 64

_backend_ids = itertools.count(1)

# .worker: the _Worker running in this thread, if it is a pool's worker
_current = threading.local()


class _BudgetedTask(Task):
    """A task of an in-process pool, which reports to the budget's occupancy
    hook while it has one: its thread's slot counts it while it runs.
    ``forker`` is the slot of the thread outside the pools that forked it
    (it counts beside the task), ``reserved`` is true if the task holds a
    budget token from its fork (an idle worker was woken for it)."""

    __slots__ = ("forker", "reserved")
    backend: ThreadBackend
    forker: Slot | None
    reserved: bool
    stealable = True  # in-process: a waiter may run it

    def run(self) -> None:
        future = self.claim()
        if future is None:
            self.release_budget()  # if it was cancelled
            return
        occupancy = _budget_slots.hook
        if occupancy is None:  # no BLAS or OpenMP library: nothing to count
            self.settle(future, self.call())
            del future  # no cycle, as below
            return
        forker, self.forker = self.forker, None
        reserved, self.reserved = self.reserved, False
        pool = self.backend
        # This task may still be in a queue, the one a waiter took out of turn.
        slot = occupancy.busy(reserved, forker, queued=reserved and pool._backlog() > 1)
        try:
            outcome = self.call()
        finally:
            # Uncounted before the future settles, so a waiter resumes with
            # the right count, unless a worker goes on to a queued task.
            slot.task_ended(forker, linger=bool(pool._tasks) or any(pool._queues))
        self.settle(future, outcome)
        del future, outcome  # a failure's traceback holds this frame: no cycle (see Future)

    def release_budget(self) -> None:
        """If the task was cancelled, give back what it holds in the budget;
        once, of all the threads that find it so (its worker, a waiter, shutdown)."""
        future = self.future
        if future is None or not future.cancelled():  # it runs, or ran, elsewhere
            return
        with future._lock:
            forker, self.forker = self.forker, None
            reserved, self.reserved = self.reserved, False
        occupancy = _budget_slots.hook
        if occupancy is not None:  # it is, if the fork took anything
            occupancy.cancelled(forker, reserved)


class _Worker:
    """One worker thread: its deque of forks, the waiter its pool registers
    in it, and what it runs."""

    __slots__ = ("forks", "pool", "slot", "task", "thread")

    def __init__(self, pool: ThreadBackend) -> None:
        self.pool = pool
        # Tasks forked in this thread: it pops the newest, thieves the oldest.
        self.forks: collections.deque[_BudgetedTask] = collections.deque()
        self.slot = Slot(is_worker=True)
        self.task: Task | None = None  # the task it runs now, for exit reports
        self.thread = threading.Thread(
            target=pool._work,
            args=(self,),
            name=f"{pool._thread_names}-{next(pool._thread_ids)}",
            daemon=True,
        )

    def run_own_forks(self, fut: Future[Any]) -> None:
        """Before this thread blocks on ``fut``: run the tasks it forked that
        are still queued, newest first, until ``fut`` is done or none is left.
        What it waits for is among them unless another worker stole it."""
        forks = self.forks
        while forks and fut._state < CANCELLED:
            try:
                task = forks.pop()
            except IndexError:  # a thief took the last one
                return
            task.run()

    def blocked(self) -> None:
        probe()
        if _budget_slots.hook is not None:
            self.slot.blocked()
        self.pool._worker_blocked()

    def blocked_long(self) -> None:
        if self.slot.is_blocked:
            self.slot.blocked_long()

    def resumed(self) -> None:
        self.pool._worker_resumed()
        if self.slot.is_blocked:  # the hook was there when it blocked
            self.slot.resumed()


class ThreadBackend(Backend):
    """Runs forked tasks on a work-first pool of worker threads.

    ``max_workers`` defaults to :func:`aiopar.get_num_interop_threads` and
    follows it when it changes; a number given here is kept for this pool.
    """

    name = "thread"
    task_class = _BudgetedTask
    #: whether a thread outside the pools counts beside its forks while it
    #: does not wait (rule 3 of ``aiopar._budget``)
    forker_counts: ClassVar[bool] = True

    def __init__(self, max_workers: int | None = None) -> None:
        check_count(max_workers, "max_workers", none="the default")
        super().__init__()
        self._max_workers = max_workers
        self._thread_names = f"aiopar-{self.name}-{next(_backend_ids)}"
        self._reset()
        _live_pools.add(self)
        probe()  # the budget listens from the first fork if BLAS is loaded already

    def _reset(self) -> None:
        """The state of a pool with no worker (also a fresh start in a forked child)."""
        self._tasks: collections.deque[_BudgetedTask] = collections.deque()  # the shared queue
        # The workers' own deques, for thieves; replaced, never changed, so
        # it is read without the lock.
        self._queues: tuple[collections.deque[_BudgetedTask], ...] = ()
        # Each idle worker sleeps on a lock of its own, so a fork wakes exactly
        # one worker (a shared queue's lock wakes a second one that finds
        # nothing to do). The one idle longest goes first: waking the one that
        # has only just gone to sleep made a sequential `await fork(f)` twice
        # as slow on a 2-core VM.
        self._idle: collections.deque[threading.Lock] = collections.deque()
        self._waking = 0  # idle workers woken that have not looked at the queues yet
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified for drain()
        self._draining = 0  # threads in drain()
        self._workers: set[_Worker] = set()
        self._blocked = 0  # workers waiting in Future.wait
        self._thread_ids = itertools.count()  # names stay unique as workers come and go

    @property
    def max_workers(self) -> int:
        return self._max_workers or _budget.interop_threads

    def _backlog(self) -> int:
        """Tasks queued, in the shared queue and the workers' deques (some
        may have been run out of turn by a waiter already)."""
        return len(self._tasks) + sum(map(len, self._queues))

    def submit(self, task: Task) -> None:
        if not isinstance(task, _BudgetedTask):
            raise TypeError(f"{type(self).__name__} runs {_BudgetedTask.__name__}s only")
        # Not getattr(_current, "worker", None): on a thread-local, a missing
        # attribute costs an AttributeError raised and caught, ten times this.
        worker: _Worker | None = _current.__dict__.get("worker")
        # Work-first: a task of this pool forks into its worker's own deque.
        queue = worker.forks if worker is not None and worker.pool is self else self._tasks
        # "with", not acquire() then try as Future._claim has it: CPython
        # raises a Ctrl-C as a call returns, so one raised as acquire()
        # returned would leave the pool's lock held, and exit, which needs
        # it, would hang; a with statement holds it only inside its block.
        with self._lock:
            # A task of this pool may fork on it while it drains after shutdown.
            if self._closed and queue is self._tasks:
                raise RuntimeError(f"cannot fork on {self!r}: it has been shut down")
            # Workers take queued tasks without the lock, so everything about
            # the task is settled before it is queued.
            woken = (
                # _wake_worker's own test, first: a busy pool's forks skip the call.
                (
                    self._idle
                    or len(self._workers) - self._blocked
                    < (self._max_workers or _budget.interop_threads)  # max_workers, inline
                )
                # No more wake-ups than queued tasks.
                and (not self._waking or self._backlog() >= self._waking)
                and self._wake_worker()
            )
            occupancy = _budget_slots.hook
            if occupancy is None:
                task.forker, task.reserved = None, False
            else:  # before a worker can finish the task
                # A worker counts already, and so does not count for a fork.
                counts = worker is None and self.forker_counts
                task.forker, task.reserved = occupancy.forked(woken, counts), woken
            queue.append(task)

    def _wake_worker(self) -> bool:
        """Wake an idle worker, or start one if the pool is below its limit;
        False if neither can be done. Called with self._lock held."""
        if self._idle:
            self._idle.popleft().release()
            self._waking += 1
            return True
        running = len(self._workers) - self._blocked
        if running >= self.max_workers or len(self._workers) >= (
            self.max_workers + COMPENSATION_LIMIT
        ):
            return False
        worker = _Worker(self)
        self._workers.add(worker)
        self._queues = (*self._queues, worker.forks)
        try:
            worker.thread.start()
        except RuntimeError:  # "can't start new thread": the limit of this system
            self._remove(worker)
            if not self._workers:
                raise
            return False  # the workers there are will take the task
        return True

    def _remove(self, worker: _Worker) -> None:
        # Called with self._lock held, for a worker whose deque is empty.
        self._workers.discard(worker)
        self._queues = tuple(q for q in self._queues if q is not worker.forks)
        if self._draining:
            self._quiet.notify_all()

    def _work(self, worker: _Worker) -> None:
        _current.worker = worker
        use_slot(worker.slot)
        set_waiter(worker)
        probe()
        try:
            self._run_tasks(worker)
        finally:
            if _budget_slots.hook is not None:
                worker.slot.went_idle()  # a worker that lingered stops counting as it stops

    def _next_task(self, forks: collections.deque[_BudgetedTask]) -> _BudgetedTask | None:
        """Its own newest fork, else the oldest task stolen from another
        worker, else the oldest in the shared queue; None if all are empty."""
        # Each deque is looked at before it is popped: an empty one's
        # IndexError costs more than the look. The pop may still find it
        # empty: its owner, or another thief, took the last task meanwhile.
        if forks:
            try:
                return forks.pop()
            except IndexError:
                pass
        for queue in (*self._queues, self._tasks):
            if queue:
                try:
                    return queue.popleft()
                except IndexError:
                    pass
        return None

    def _run_tasks(self, worker: _Worker) -> None:
        slot = worker.slot
        wake_up = threading.Lock()
        wake_up.acquire()
        while True:
            # Over the limit (it went down, or a blocked worker came back):
            # stop before taking another task.
            if (
                len(self._workers) - self._blocked
                > (self._max_workers or _budget.interop_threads)  # max_workers, inline
                and self._retire(worker)
            ):
                return
            task = self._next_task(worker.forks)
            if task is None:
                probe()
                if _budget_slots.hook is not None:
                    slot.went_idle()
                with self._lock:
                    if self._backlog():
                        continue
                    if self._closed:
                        self._remove(worker)
                        return
                    self._idle.append(wake_up)
                    if self._draining and self._is_quiet():
                        self._quiet.notify_all()
                wake_up.acquire()  # released by the fork that has work for it
                with self._lock:
                    self._waking -= 1
                continue
            worker.task = task
            task.run()
            worker.task = None
            del task  # the worker keeps no reference while it waits for the next

    def _retire(self, worker: _Worker) -> bool:
        """Stop this worker if the pool has more than its limit; True if so."""
        with self._lock:
            if len(self._workers) - self._blocked <= self.max_workers or worker.forks:
                return False
            self._remove(worker)
            if self._backlog():
                self._wake_worker()  # the wake-up that came here was for a task
            return True

    # A blocked worker is counted out of the pool, so queued work gets a
    # worker of its own (a compensating one, if none is idle).
    def _worker_blocked(self) -> None:
        with self._lock:
            self._blocked += 1
            if self._backlog():
                self._wake_worker()

    def _worker_resumed(self) -> None:
        with self._lock:
            self._blocked -= 1

    def _is_quiet(self) -> bool:
        # Called with self._lock held: nothing queued, every worker asleep.
        return not self._backlog() and len(self._idle) == len(self._workers)

    def drain(self) -> bool:
        with self._lock:
            if self._is_quiet():
                return False
            self._draining += 1
            try:
                while not self._is_quiet():
                    self._quiet.wait(_interrupt.SLICE)  # so that Ctrl-C ends it: see _interrupt
            finally:
                self._draining -= 1
        return True

    def running_tasks(self) -> list[str]:
        return [task.name for w in list(self._workers) if (task := w.task) is not None]

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Stop accepting forks from outside the pool and release the workers.

        Queued tasks still run (and may fork on this pool meanwhile) unless
        ``cancel_pending`` is true; then their futures are cancelled, outside
        the pool's lock, so a cancel callback may fork or wait anywhere.
        """
        with self._lock:
            queued: list[_BudgetedTask] = []
            if cancel_pending:
                for queue in (self._tasks, *self._queues):
                    while queue:
                        try:
                            queued.append(queue.popleft())
                        except IndexError:
                            break
            self._closed = True  # workers run what is queued, then stop
            while self._idle:
                self._idle.popleft().release()
                self._waking += 1
            threads = [worker.thread for worker in self._workers]
        _cancel(queued)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    _interrupt.join(thread)


def _cancel(tasks: list[_BudgetedTask]) -> None:
    """Cancel the futures of tasks taken off the queues (unless they started)."""
    for task in tasks:
        future = task.future
        if future is not None:
            future.cancel()
        task.release_budget()


_live_pools: weakref.WeakSet[ThreadBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Only the forking thread lives on in a child: every pool starts afresh.
    # Queued tasks are the parent's to run; here their futures are cancelled,
    # so nothing in the child waits for them for ever.
    _current.__dict__.pop("worker", None)
    for pool in list(_live_pools):
        queued = [task for queue in (pool._tasks, *pool._queues) for task in queue]
        pool._reset()
        for task in queued:
            if task.future is not None:
                task.future.cancel()


os.register_at_fork(after_in_child=_after_fork_in_child)
