"""The "thread" backend (the default): a pool of interop worker threads.

Workers start lazily, up to ``max_workers``. A worker that blocks in
``wait`` on a task another thread is running is counted out of the pool
while it waits, and a compensating worker starts if work is queued, so
nested fork/wait never starves the pool; surplus workers retire once the
blocked ones come back. Each task counts against the intra-op thread budget
(see ``_config``) while it runs and its thread is not blocked in ``wait``, and
so does a thread outside the pools that computes beside its forks.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any

from .. import _config
from .._future import _local as _future_thread_state
from .._loop import on_event_loop
from ._base import Backend, Task, check_max_workers

__all__ = ["ThreadBackend"]

_backend_ids = itertools.count(1)

_enter_budget = _config.budget.enter
_leave_budget = _config.budget.leave
_block_budget = _config.budget.block


class _OutsideThread:
    """The budget's view of a thread outside the pools (the main thread, say).

    Such a thread counts as one running task while it is not blocked in
    ``wait`` and either runs another thread's task itself, or has unfinished
    forks of which a worker has started one: a thread that forks and goes on
    computing competes with its forks for the cores, as the tutorial's
    bidirectional LSTM does. Until a worker starts one of its forks it does
    not count, so a fork it runs itself (``wait(fork(f))``) costs the budget
    nothing. It stands in for a pool in ``Future.wait``'s blocked/resumed calls.
    """

    __slots__ = (
        "blocked",
        "counted",
        "forks_unfinished",
        "lock",
        "sharing",
        "tasks_running",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.forks_unfinished = 0  # its forks not finished (nor cancelled) yet
        self.sharing = False  # a worker started one of them since it had none
        self.tasks_running = 0  # tasks forked elsewhere that it runs itself
        self.blocked = False
        self.counted = False

    def _recount(self) -> None:
        # Called with self.lock held.
        counts = (self.sharing or bool(self.tasks_running)) and not self.blocked
        if counts != self.counted:
            self.counted = counts
            if counts:
                _enter_budget()
            elif self.blocked:
                _block_budget()
            else:
                _leave_budget()

    def forked(self) -> None:
        with self.lock:
            self.forks_unfinished += 1

    def fork_started_on_worker(self) -> None:
        with self.lock:
            if not self.sharing:
                self.sharing = True
                self._recount()

    def fork_finished(self) -> None:
        with self.lock:
            self.forks_unfinished -= 1
            if self.sharing and not self.forks_unfinished:
                self.sharing = False
                self._recount()

    def running_other_task(self, delta: int) -> None:
        with self.lock:
            self.tasks_running += delta
            self._recount()

    def worker_blocked(self) -> None:
        with self.lock:
            self.blocked = True
            self._recount()

    def worker_resumed(self) -> None:
        with self.lock:
            self.blocked = False
            self._recount()


def _this_thread() -> _OutsideThread | Backend | Any:
    """The pool this thread works for, else its outside-thread record (made on first use)."""
    state = _future_thread_state.__dict__
    worker = state.get("worker")
    if worker is None:
        worker = state["worker"] = _OutsideThread()
    return worker


class _BudgetedTask(Task):
    """A task of an in-process pool: it counts against the intra-op thread
    budget while it runs, in a worker or in a waiter that runs it itself,
    except while its thread is blocked in ``wait``. A thread counts once,
    however deeply its tasks nest. Until it finishes, the outside thread that
    forked it (``forker``) counts too."""

    __slots__ = ("forker",)

    def run(self) -> None:
        future = self.claim()
        if future is None:
            if self.future is not None:  # cancelled: it will never run
                self.release_forker()
            return
        forker, self.forker = self.forker, None
        worker = _this_thread()
        if type(worker) is _OutsideThread:
            # A fork run by the thread that forked it changes nothing: that
            # thread was going to compute anyway.
            counted_here = worker is not forker
            if counted_here:
                worker.running_other_task(1)
            try:
                outcome = self.call()
            finally:
                if counted_here:
                    worker.running_other_task(-1)
                if forker is not None:
                    forker.fork_finished()
        else:
            # A pool worker; "budgeted": a task of this thread counts already.
            state = _future_thread_state.__dict__
            nested = state.get("budgeted", False)
            if not nested:
                state["budgeted"] = True
                _enter_budget()
            if forker is not None:
                forker.fork_started_on_worker()
            try:
                outcome = self.call()
            finally:
                # Uncounted before the future settles, so the forker, which
                # may be waiting for exactly this, resumes with the right count.
                if forker is not None:
                    forker.fork_finished()
                if not nested:
                    state["budgeted"] = False
                    _leave_budget()
        self.settle(future, outcome)

    def release_forker(self) -> None:
        forker, self.forker = self.forker, None
        if forker is not None:
            forker.fork_finished()


class ThreadBackend(Backend):
    """Runs forked tasks on a pool of worker threads.

    ``max_workers`` defaults to :func:`aiopar.get_num_interop_threads` and
    follows it when it changes; a number given here is kept for this pool.
    """

    name = "thread"
    task_class = _BudgetedTask

    def __init__(self, max_workers: int | None = None) -> None:
        check_max_workers(max_workers)
        super().__init__()
        self._max_workers = max_workers
        self._tasks: collections.deque[Task] = collections.deque()
        # Each idle worker sleeps on a lock of its own, so a fork wakes exactly
        # one worker (a shared queue's lock wakes a second one that finds
        # nothing to do). The one idle longest goes first: waking the one that
        # has only just gone to sleep made a sequential `await fork(f)` twice
        # as slow on a 2-core VM.
        self._idle: collections.deque[threading.Lock] = collections.deque()
        self._waking = 0  # idle workers woken that have not looked at the queue yet
        self._lock = threading.Lock()
        self._threads: set[threading.Thread] = set()
        self._blocked = 0  # workers waiting in Future.wait
        self._closed = False
        self._thread_names = f"aiopar-{self.name}-{next(_backend_ids)}"
        self._thread_ids = itertools.count()  # names stay unique as workers come and go

    @property
    def max_workers(self) -> int:
        return self._max_workers or _config.interop_threads

    def submit(self, task: Task) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"cannot fork on {self!r}: it has been shut down")
            forker = _this_thread()
            # An event loop's thread awaits its forks rather than computing
            # beside them, so it does not count.
            if type(forker) is _OutsideThread and not on_event_loop():
                task.forker = forker  # type: ignore[attr-defined]
                forker.forked()
            else:
                task.forker = None  # type: ignore[attr-defined]
            self._tasks.append(task)
            if len(self._tasks) > self._waking:  # else a worker on its way takes it
                self._wake_worker()

    def _wake_worker(self) -> None:
        # Called with self._lock held.
        if self._idle:
            self._idle.popleft().release()
            self._waking += 1
        elif len(self._threads) - self._blocked < self.max_workers:
            thread = threading.Thread(
                target=self._work,
                name=f"{self._thread_names}-{next(self._thread_ids)}",
                daemon=True,
            )
            self._threads.add(thread)
            thread.start()

    def _work(self) -> None:
        _future_thread_state.worker = self
        tasks = self._tasks
        wake_up = threading.Lock()
        wake_up.acquire()
        while True:
            # Over the limit (it went down, or a blocked worker came back):
            # stop before taking another task.
            if len(self._threads) - self._blocked > self.max_workers and self._retire():
                return
            try:
                task = tasks.popleft()
            except IndexError:
                with self._lock:
                    if tasks:
                        continue
                    if self._closed:
                        self._threads.discard(threading.current_thread())
                        return
                    self._idle.append(wake_up)
                wake_up.acquire()  # released by the fork that has work for it
                with self._lock:
                    self._waking -= 1
                continue
            task.run()
            del task

    def _retire(self) -> bool:
        """Stop this worker if the pool has more than its limit; True if so."""
        with self._lock:
            if len(self._threads) - self._blocked <= self.max_workers:
                return False
            self._threads.discard(threading.current_thread())
            if self._tasks:
                self._wake_worker()  # the wake-up that came here was for a task
            return True

    # Called by Future.wait in a worker thread of this pool. A blocked worker
    # also leaves its share of the thread budget to the tasks still running.
    def worker_blocked(self) -> None:
        _block_budget()
        with self._lock:
            self._blocked += 1
            if self._tasks:
                self._wake_worker()

    def worker_resumed(self) -> None:
        with self._lock:
            self._blocked -= 1
        _enter_budget()

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        with self._lock:
            if cancel_pending:
                while self._tasks:
                    task = self._tasks.popleft()
                    if task.future is not None:
                        task.future.cancel()
                    task.release_forker()  # type: ignore[attr-defined]
            self._closed = True  # workers run what is queued, then stop
            while self._idle:
                self._idle.popleft().release()
                self._waking += 1
            threads = list(self._threads)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()
