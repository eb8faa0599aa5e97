"""The "thread" backend (the default): a pool of interop worker threads.

Workers start lazily, up to ``max_workers``. A worker that blocks in
``wait`` is counted out of the pool while it waits, and a compensating worker
starts if work is queued, so nested fork/wait never starves the pool; surplus
workers retire once the blocked ones come back. At most
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

from .. import _budget, _future
from .._loop import on_event_loop
from ._base import Backend, Task, check_count

__all__ = ["COMPENSATION_LIMIT", "ThreadBackend"]

#: workers a pool may add beyond ``max_workers`` while others are blocked in ``wait``
COMPENSATION_LIMIT = 64

_backend_ids = itertools.count(1)
_this_slot = _budget.this_thread
_budget_give_back = _budget.budget.give_back
_budget_take = _budget.budget.take


class _BudgetedTask(Task):
    """A task of an in-process pool: its thread's budget slot counts it while
    it runs. ``forker`` is the slot of the thread outside the pools that
    forked it (it counts beside the task), ``reserved`` is true if the task
    holds a budget token from its fork (an idle worker was woken for it)."""

    __slots__ = ("forker", "reserved")
    forker: _budget.Slot | None
    reserved: bool

    def run(self) -> None:
        future = self.claim()
        if future is None:
            self.release_budget()  # if it was cancelled
            return
        forker, self.forker = self.forker, None
        reserved, self.reserved = self.reserved, False
        slot = _this_slot()
        # This task may still be in the queue, the one a waiter took out of turn.
        slot.task_started(reserved, forker, queued=reserved and len(self.backend._tasks) > 1)  # type: ignore[attr-defined]
        try:
            outcome = self.call()
        finally:
            # Uncounted before the future settles, so a waiter resumes with
            # the right count, unless a worker goes on to a queued task.
            slot.task_ended(forker, linger=bool(self.backend._tasks))  # type: ignore[attr-defined]
        self.settle(future, outcome)

    def release_budget(self) -> None:
        """If the task was cancelled, give back what it holds in the budget;
        once, of all the threads that find it so (its worker, a waiter, shutdown)."""
        future = self.future
        if future is None or not future.cancelled():  # it runs, or ran, elsewhere
            return
        with future._lock:
            forker, self.forker = self.forker, None
            reserved, self.reserved = self.reserved, False
        if forker is not None:
            forker.fork_finished()
        if reserved:
            _budget_give_back(now=True)


class _Worker:
    """One worker thread: the waiter its pool registers in it, and what it runs."""

    __slots__ = ("pool", "slot", "task", "thread")

    def __init__(self, pool: ThreadBackend, thread: threading.Thread) -> None:
        self.pool = pool
        self.thread = thread
        self.slot: _budget.Slot | None = None
        self.task: Task | None = None  # the task it runs now, for exit reports

    def blocked(self) -> None:
        self.slot.blocked()  # type: ignore[union-attr]
        self.pool._worker_blocked()

    def blocked_long(self) -> None:
        self.slot.blocked_long()  # type: ignore[union-attr]

    def resumed(self) -> None:
        self.pool._worker_resumed()
        self.slot.resumed()  # type: ignore[union-attr]


class ThreadBackend(Backend):
    """Runs forked tasks on a pool of worker threads.

    ``max_workers`` defaults to :func:`aiopar.get_num_interop_threads` and
    follows it when it changes; a number given here is kept for this pool.
    """

    name = "thread"
    task_class = _BudgetedTask

    def __init__(self, max_workers: int | None = None) -> None:
        check_count(max_workers, "max_workers", none="the default")
        super().__init__()
        self._max_workers = max_workers
        self._thread_names = f"aiopar-{self.name}-{next(_backend_ids)}"
        self._reset()
        _live_pools.add(self)

    def _reset(self) -> None:
        """The state of a pool with no worker (also a fresh start in a forked child)."""
        self._tasks: collections.deque[Task] = collections.deque()
        # Each idle worker sleeps on a lock of its own, so a fork wakes exactly
        # one worker (a shared queue's lock wakes a second one that finds
        # nothing to do). The one idle longest goes first: waking the one that
        # has only just gone to sleep made a sequential `await fork(f)` twice
        # as slow on a 2-core VM.
        self._idle: collections.deque[threading.Lock] = collections.deque()
        self._waking = 0  # idle workers woken that have not looked at the queue yet
        self._lock = threading.Lock()
        self._workers: set[_Worker] = set()
        self._blocked = 0  # workers waiting in Future.wait
        self._thread_ids = itertools.count()  # names stay unique as workers come and go

    @property
    def max_workers(self) -> int:
        return self._max_workers or _budget.interop_threads

    def submit(self, task: Task) -> None:
        slot = _this_slot()
        # A worker counts already, and an event loop's thread awaits its
        # forks rather than computing beside them: neither counts for a fork.
        forker = None if slot.is_worker or on_event_loop() else slot
        lock = self._lock
        lock.acquire()  # not "with": it would cost as much as the lock, once per fork
        try:
            if self._closed:
                raise RuntimeError(f"cannot fork on {self!r}: it has been shut down")
            # Workers take queued tasks without the lock, so everything about
            # the task is settled before it is queued.
            reserved = (
                len(self._tasks) >= self._waking
                # _wake_worker's own test, first: a busy pool's forks skip the call.
                and (self._idle or len(self._workers) - self._blocked < self.max_workers)
                and self._wake_worker()
            )
            if reserved:
                _budget_take()
            if forker is not None:  # before a worker can finish the task
                forker.forked(woken=reserved)
            task.forker, task.reserved = forker, reserved  # type: ignore[attr-defined]
            self._tasks.append(task)
        finally:
            lock.release()

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
        thread = threading.Thread(
            target=self._work,
            name=f"{self._thread_names}-{next(self._thread_ids)}",
            daemon=True,
        )
        worker = _Worker(self, thread)
        thread._aiopar_worker = worker  # type: ignore[attr-defined]
        self._workers.add(worker)
        try:
            thread.start()
        except RuntimeError:  # "can't start new thread": the limit of this system
            self._workers.discard(worker)
            if not self._workers:
                raise
            return False  # the workers there are will take the task
        return True

    def _work(self) -> None:
        worker: _Worker = threading.current_thread()._aiopar_worker  # type: ignore[attr-defined]
        worker.slot = _budget.worker_slot()
        _future.set_waiter(worker)
        try:
            self._run_tasks(worker)
        finally:
            worker.slot.went_idle()  # a worker that lingered stops counting as it stops

    def _run_tasks(self, worker: _Worker) -> None:
        tasks = self._tasks
        slot = worker.slot
        wake_up = threading.Lock()
        wake_up.acquire()
        while True:
            # Over the limit (it went down, or a blocked worker came back):
            # stop before taking another task.
            if len(self._workers) - self._blocked > self.max_workers and self._retire(worker):
                return
            try:
                task = tasks.popleft()
            except IndexError:
                slot.went_idle()  # type: ignore[union-attr]
                with self._lock:
                    if tasks:
                        continue
                    if self._closed:
                        self._workers.discard(worker)
                        return
                    self._idle.append(wake_up)
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
            if len(self._workers) - self._blocked <= self.max_workers:
                return False
            self._workers.discard(worker)
            if self._tasks:
                self._wake_worker()  # the wake-up that came here was for a task
            return True

    # A blocked worker is counted out of the pool, so queued work gets a
    # worker of its own (a compensating one, if none is idle).
    def _worker_blocked(self) -> None:
        with self._lock:
            self._blocked += 1
            if self._tasks:
                self._wake_worker()

    def _worker_resumed(self) -> None:
        with self._lock:
            self._blocked -= 1

    def running_tasks(self) -> list[str]:
        return [task.name for w in list(self._workers) if (task := w.task) is not None]

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        with self._lock:
            if cancel_pending:
                while self._tasks:
                    task = self._tasks.popleft()
                    if task.future is not None:
                        task.future.cancel()
                    task.release_budget()  # type: ignore[attr-defined]
            self._closed = True  # workers run what is queued, then stop
            while self._idle:
                self._idle.popleft().release()
                self._waking += 1
            threads = [worker.thread for worker in self._workers]
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()


_live_pools: weakref.WeakSet[ThreadBackend] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # Only the forking thread lives on in a child: every pool starts afresh.
    # Queued tasks are the parent's to run; here their futures are cancelled,
    # so nothing in the child waits for them for ever.
    for pool in list(_live_pools):
        queued = pool._tasks
        pool._reset()
        for task in queued:
            if task.future is not None:
                task.future.cancel()


os.register_at_fork(after_in_child=_after_fork_in_child)
