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
import time
from typing import Any

from .. import _config, _future
from .._future import _local as _future_thread_state
from .._loop import on_event_loop
from ._base import Backend, Task, check_max_workers

__all__ = ["ThreadBackend"]

_backend_ids = itertools.count(1)

_enter_budget = _config.budget.enter
_leave_budget = _config.budget.leave
_drop_budget = _config.budget.drop
_follow_budget = _config.budget.follow
_adopt_budget = _config.budget.apply_here


class _OutsideThread:
    """The budget's view of a thread outside the pools (the main thread, say).

    Such a thread counts as one running task while it is not blocked in
    ``wait`` and either runs another thread's task itself, or has unfinished
    forks of which a worker has taken (or been woken for) one: a thread that
    forks and goes on computing competes with its forks for the cores, as the
    tutorial's bidirectional LSTM does. Forks that wait in the queue for a
    busy pool do not make it count. It stands in for a pool in
    ``Future.wait``'s blocked/resumed calls.
    """

    __slots__ = (
        "is_blocked",
        "counted",
        "counted_since",
        "forks_unfinished",
        "lock",
        "sharing",
        "tasks_running",
    )

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.forks_unfinished = 0  # its forks not finished (nor cancelled) yet
        self.sharing = False  # a worker took one of them since it had none
        self.tasks_running = 0  # tasks forked elsewhere that it runs itself
        self.is_blocked = False
        self.counted = False
        self.counted_since = 0.0

    def _recount(self) -> None:
        # Called with self.lock held.
        counts = (self.sharing or bool(self.tasks_running)) and not self.is_blocked
        if counts != self.counted:
            self.counted = counts
            if counts:
                self.counted_since = time.monotonic()
                _enter_budget()
            else:
                _leave_budget()

    def forked(self) -> None:
        with self.lock:
            self.forks_unfinished += 1

    def fork_on_worker(self) -> None:
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

    def blocked(self) -> None:
        with self.lock:
            was_counted = self.counted
            self.is_blocked = True
            self._recount()
            if was_counted:
                _give_cores_back(self.counted_since)

    def blocked_long(self) -> None:
        _follow_budget()

    def resumed(self) -> None:
        with self.lock:
            self.is_blocked = False
            self._recount()


def _give_cores_back(counted_since: float) -> None:
    """A thread that counted since ``counted_since`` blocks in ``wait`` (its
    count is gone already): the tasks still running get its cores at once if
    it computed for less than ``_BLOCKED_LONG`` seconds, so a task waited for
    at once runs with every core; else once the wait has lasted that long
    (``blocked_long``), so the short tail of a fork its forker waits
    for leaves no spinning BLAS threads behind."""
    if time.monotonic() - counted_since < _future._BLOCKED_LONG:
        _follow_budget()


def _this_thread() -> _OutsideThread | Backend | Any:
    """The pool this thread works for, else its outside-thread record (made on first use)."""
    state = _future_thread_state.__dict__
    worker = state.get("waiter")
    if worker is None:
        worker = state["waiter"] = _OutsideThread()
    return worker


class _BudgetedTask(Task):
    """A task of an in-process pool: it counts against the intra-op thread
    budget while it runs, in a worker or in a waiter that runs it itself,
    except while its thread is blocked in ``wait``. A thread counts once,
    however deeply its tasks nest. Until it finishes, the outside thread that
    forked it (``forker``) counts too.

    A task forked while a worker is idle counts from the fork on (it holds a
    budget token, ``reserved``): the forker's own next BLAS call then already
    leaves the cores it will need, instead of starting with all of them a few
    tens of microseconds before the worker wakes."""

    __slots__ = ("forker", "reserved")

    def run(self) -> None:
        future = self.claim()
        if future is None:
            if self.future is not None:  # cancelled: it will never run
                self.release_budget()
            return
        forker, self.forker = self.forker, None
        reserved, self.reserved = self.reserved, False
        worker = _this_thread()
        if type(worker) is _OutsideThread:
            if reserved:
                _drop_budget()  # not a worker's after all: this thread runs it
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
                state["counted_since"] = time.monotonic()
                if reserved:
                    _adopt_budget()  # the token is this thread's now
                else:
                    _enter_budget()
            elif reserved:
                _drop_budget()
            if forker is not None:
                forker.fork_on_worker()
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

    def release_budget(self) -> None:
        """Give back what a task that will never run holds in the budget."""
        forker, self.forker = self.forker, None
        if forker is not None:
            forker.fork_finished()
        if self.reserved:
            self.reserved = False
            _drop_budget()


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
            if type(forker) is not _OutsideThread or on_event_loop():
                forker = None
            # Workers take queued tasks without the lock, so everything about
            # the task is settled before it is queued.
            reserved = len(self._tasks) >= self._waking and self._wake_worker()
            if forker is not None:
                forker.forked()
                if reserved:
                    forker.fork_on_worker()
            if reserved:
                _enter_budget()
            task.forker, task.reserved = forker, reserved  # type: ignore[attr-defined]
            self._tasks.append(task)

    def _wake_worker(self) -> bool:
        """Wake an idle worker, or start one if the pool is below its limit;
        False if neither can be done. Called with self._lock held."""
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
        else:
            return False
        return True

    def _work(self) -> None:
        _future.set_waiter(self)
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
    # stops counting against the thread budget, and leaves its cores to the
    # tasks still running if the wait goes on (blocked_long).
    def blocked(self) -> None:
        _leave_budget()
        _give_cores_back(getattr(_future_thread_state, "counted_since", 0.0))
        with self._lock:
            self._blocked += 1
            if self._tasks:
                self._wake_worker()

    def blocked_long(self) -> None:
        _follow_budget()

    def resumed(self) -> None:
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
                    task.release_budget()  # type: ignore[attr-defined]
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
