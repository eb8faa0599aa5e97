"""The "thread" backend (the default): a work-first pool of interop worker threads.

Scheduling follows Java's ForkJoinPool, TBB and rayon. A task forked inside
one of the pool's tasks goes to its worker's own deque; every other fork
goes to the pool's shared queue. A worker takes its own deque newest first,
then steals oldest first from the other workers' deques, then takes the
shared queue oldest first: work already started is finished before new work
begins, so the tasks a blocked task waits for are never stuck behind
unrelated ones. A worker that waits first runs the queued tasks it forked
itself, newest first (see :meth:`_Worker.run_own_forks`).

Workers start lazily, as forks need them, up to ``max_workers``; a fork
wakes an idle worker only once they have all started, the one idle longest
first. A worker that blocks in
``wait`` is counted out of the pool while it waits, and so is one that
blocks anywhere else (a sleep, a socket, a lock), which the pool's stall
watcher finds by its thread's CPU clock (:mod:`aiopar.backends._stall`); a
compensating worker starts if work is queued, so neither nested fork/wait
nor blocking calls starve the pool, while workers that compute are never
more than ``max_workers``. Surplus workers retire once the blocked ones come
back, or after ``idle_retire`` seconds idle. At most ``COMPENSATION_LIMIT``
workers are added that way: past it, queued tasks wait for a worker to come
back, as in a fixed-size pool. Each task counts against the intra-op thread
budget (``aiopar._budget``) through its thread's slot.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import weakref
from asyncio import _get_running_loop
from collections.abc import Callable
from concurrent.futures._base import LOGGER as cf_logger
from concurrent.futures.thread import BrokenThreadPool
from contextvars import Context
from threading import get_ident
from typing import Any, ClassVar

import sniffio

from .. import _budget, _budget_slots, _interrupt
from .._bridge import hold_wakes, send_wakes
from .._budget_slots import Occupancy, Slot, probe, use_slot
from .._future import Future
from .._waiter import set_waiter
from . import _stall
from ._base import Backend, Task, check_count, check_initializer
from ._stall import OUTSIDE, WAITING, blocking_keys, presumed

__all__ = ["COMPENSATION_LIMIT", "PoolTask", "ThreadBackend"]

#: workers a pool may add beyond ``max_workers`` while others are blocked
COMPENSATION_LIMIT = 64

_backend_ids = itertools.count(1)

_sniffio_thread = sniffio.thread_local

# .worker: the _Worker running in this thread, if it is a pool's worker
_current = threading.local()


class PoolTask(Task):
    """A task of an in-process pool. ``forker`` is the id of the thread that
    forked it, ``reserved`` the worker its fork woke, if any: a thread that
    runs it in ``wait`` tells the budget's occupancy hook what that means
    (rule 2 and 3 of ``aiopar._budget``). A pool's worker accounts for its
    whole spell of tasks instead: its spell begins with the first task it
    runs, not with one it only took."""

    __slots__ = ("forker", "reserved")
    backend: ThreadBackend
    forker: int
    reserved: _Worker | None
    stealable = True  # in-process: a waiter may run it

    def run(
        self,
        context: Context | None = None,
        starting: Callable[[], Callable[[], object] | None] | None = None,
    ) -> None:
        """Run the task in a thread that waits for it (see :meth:`Task.run`),
        telling the budget what that means. A pool's worker runs its tasks
        with :meth:`Task.run` itself, accounting for its whole spell."""
        if starting is None and _budget_slots.hook is not None:
            starting = self._waiter_runs
        Task.run(self, context, starting)  # not super(): it builds an object per call

    def _waiter_runs(self) -> Callable[[], object] | None:
        """The task is claimed by a thread that waits for it: tell the
        budget's occupancy hook; what to call once the task's call is over,
        or None."""
        occupancy = _budget_slots.hook
        if occupancy is None or _current.__dict__.get("worker") is not None:
            return None  # a pool's worker that waits: its spell accounts for it
        ident = get_ident()
        if self.forker != ident:
            return occupancy.runs_other_task().task_ended
        sharer = self.backend._sharers.get(ident)
        woken = self.reserved
        if woken is not None or sharer is None or not sharer.sharing:
            self.backend._runs_own_fork(occupancy, woken, ident)
        return None


class _InitializedPoolTask(PoolTask):
    """A task of a pool whose workers run an initializer: only they may run
    it, never a thread that waits for it."""

    __slots__ = ()
    stealable = False


class _Worker:
    """One worker thread: its deque of forks, the lock it sleeps on while
    idle, its standing in the budget, and what it runs."""

    __slots__ = ("context", "forks", "held", "pool", "slot", "task", "thread", "wake_up")

    def __init__(self, pool: ThreadBackend) -> None:
        self.pool = pool
        # Tasks forked in this thread: it pops the newest, thieves the oldest.
        self.forks: collections.deque[PoolTask] = collections.deque()
        self.slot = Slot(is_worker=True)
        self.task: PoolTask | None = None  # the task it runs now, for exit reports
        # Why the pool counts it out, if it does: WAITING in aiopar's wait,
        # or blocked OUTSIDE aiopar (see _stall). Changed under the pool's lock.
        self.held: str | None = None
        self.context = Context()
        # Held while it runs; it sleeps on it while idle, released by the
        # thread that wakes it. One lock per worker wakes exactly one.
        self.wake_up = threading.Lock()
        self.wake_up.acquire()
        self.thread = threading.Thread(
            target=pool._work,
            args=(self,),
            name=f"{pool._thread_name_prefix}{next(pool._thread_ids)}",
            daemon=True,
        )

    def run_own_forks(self, fut: Future[Any]) -> None:
        """Before this thread blocks on ``fut``: run the tasks it forked that
        are still queued, newest first, until ``fut`` is done or none is left.
        What it waits for is among them unless another worker stole it."""
        forks = self.forks
        while forks and not fut.done():
            try:
                task = forks.pop()
            except IndexError:  # a thief took the last one
                return
            task.run()

    def blocked(self) -> None:
        probe()
        if self.slot.counted:
            self.slot.blocked()
        self.pool._worker_blocked(self)

    def blocked_long(self) -> None:
        if self.slot.is_blocked:
            self.slot.blocked_long()

    def resumed(self) -> None:
        self.pool._worker_resumed(self)
        if self.slot.is_blocked:  # it counted when it blocked
            self.slot.resumed()


class ThreadBackend(Backend):
    """Runs forked tasks on a work-first pool of worker threads.

    ``max_workers`` defaults to :func:`aiopar.get_num_interop_threads` and
    follows it when it changes; a number given here is kept for this pool.
    It bounds the workers that compute: workers blocked in ``wait`` or
    outside aiopar are compensated, up to ``COMPENSATION_LIMIT`` more.

    As :class:`concurrent.futures.ThreadPoolExecutor`'s: workers are named
    ``f"{thread_name_prefix}_{n}"`` if a prefix is given, and each worker
    calls ``initializer(*initargs)`` before its first task; if that raises,
    the pool is broken: its queued tasks and every later fork fail with
    :class:`concurrent.futures.thread.BrokenThreadPool`.
    """

    name = "thread"
    task_class = PoolTask
    #: whether a thread outside the pools counts beside its forks while it
    #: does not wait (rule 3 of ``aiopar._budget``)
    forker_counts: ClassVar[bool] = True
    #: seconds after which an idle worker beyond ``max_workers`` retires
    idle_retire: float = 10.0

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        thread_name_prefix: str | None = None,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        check_count(max_workers, "max_workers", none="the default")
        check_initializer(initializer)
        if thread_name_prefix is not None and not isinstance(thread_name_prefix, str):
            raise TypeError(
                f"thread_name_prefix must be a str or None, got {type(thread_name_prefix).__name__}"
            )
        super().__init__()
        self._max_workers = max_workers
        self._thread_names = f"aiopar-{self.name}-{next(_backend_ids)}"
        self._thread_name_prefix = (
            f"{self._thread_names}-" if thread_name_prefix is None else f"{thread_name_prefix}_"
        )
        self._initializer = initializer
        self._initargs = tuple(initargs)
        with _limits_lock:  # a set_num_interop_threads() meanwhile is not missed
            _live_pools.add(self)
            # max_workers: read on every fork, and by every worker between tasks.
            self._limit = max_workers or _budget.interop_threads
        if initializer is not None:
            # This pool's own task class; Backend.fork reads it off the instance.
            self.task_class = _InitializedPoolTask  # type: ignore[misc]
        self._reset()
        probe()  # the budget listens from the first fork if BLAS is loaded already

    def _reset(self) -> None:
        """The state of a pool with no worker (also a fresh start in a forked child)."""
        self._tasks: collections.deque[PoolTask] = collections.deque()  # the shared queue
        # The workers' own deques, for thieves; replaced, never changed, so
        # it is read without the lock.
        self._queues: tuple[collections.deque[PoolTask], ...] = ()
        # Each idle worker sleeps on a lock of its own, so a fork wakes exactly
        # one worker (a shared queue's lock wakes a second one that finds
        # nothing to do). The one idle longest goes first: waking the one that
        # has only just gone to sleep made a sequential `await fork(f)` twice
        # as slow on a 2-core VM (there, two threads handing a lock back and
        # forth take 1.4 times as long as three where two of them take turns),
        # which is also why the pool starts all its workers before it wakes
        # an idle one (_wake_worker).
        self._idle: collections.deque[_Worker] = collections.deque()
        # Workers on their way to the queues: woken from idle (by the thread
        # that wakes them, under the lock), or having woken event loops whose
        # next forks they may take, until they take a task or go idle. A
        # fork meanwhile need not wake another worker for its task. A set,
        # whose add and discard are atomic: a worker counts itself in and
        # out without taking the lock.
        self._waking: set[_Worker] = set()
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)  # notified for drain()
        self._draining = 0  # threads in drain()
        self._workers: set[_Worker] = set()
        self._worker_in: dict[int, _Worker] = {}  # by thread id: the thread's worker, if any
        self._blocked = 0  # workers waiting in Future.wait
        # Threads outside the pools that count beside their forks on this pool
        # (rule 3 of aiopar._budget), by thread id: they stop once no worker is busy.
        self._sharers: dict[int, Slot] = {}
        self._thread_ids = itertools.count()  # names stay unique as workers come and go
        self._watcher: _stall.StallWatcher | None = None  # started with the first worker
        self._broken: str | None = None  # why, once a worker's initializer failed

    @property
    def max_workers(self) -> int:
        return self._limit

    def _backlog(self) -> int:
        """Tasks queued, in the shared queue and the workers' deques (some
        may have been run out of turn by a waiter already)."""
        return len(self._tasks) + sum(map(len, self._queues))

    def enqueue(self, task: Task) -> None:
        if not isinstance(task, PoolTask):
            raise TypeError(f"{type(self).__name__} runs {PoolTask.__name__}s only")
        ident = get_ident()
        worker = self._worker_in.get(ident)
        # Work-first: a task of this pool forks into its worker's own deque.
        queue = self._tasks if worker is None else worker.forks
        # Workers take queued tasks without the lock, so everything about
        # the task is settled before it is queued.
        task.forker = ident
        limit = self._limit
        if not (self._idle or self._closed or len(self._workers) - self._blocked < limit):
            # Every worker is busy and the pool is full, the common case of
            # a batch of forks: no worker to wake, so the task is queued
            # without the pool's lock (taking it cost 6% of a fork, its run
            # and its wait). A worker that went idle or blocked, or a
            # shutdown, since the look above is seen by the same look after:
            # each writes before it reads, as this fork does (see _run_tasks).
            task.reserved = None
            queue.append(task)
            if self._idle or self._closed or len(self._workers) - self._blocked < limit:
                self._queued_without_lock(task, queue, worker is None)
            return
        # "with", not acquire() then try as Future._claim has it: CPython
        # raises a Ctrl-C as a call returns, so one raised as acquire()
        # returned would leave the pool's lock held, and exit, which needs
        # it, would hang; a with statement holds it only inside its block.
        with self._lock:
            # A task of this pool may fork on it while it drains after shutdown.
            if self._closed and queue is self._tasks:
                self._refuse_fork()
            woken = (
                # _wake_worker's own test, first: a busy pool's forks skip the call.
                (self._idle or len(self._workers) - self._blocked < limit)
                # No more wake-ups than queued tasks.
                and (not self._waking or self._backlog() >= len(self._waking))
                and self._wake_worker(by_outsider=worker is None)
            )
            task.reserved = woken or None
            queue.append(task)

    def _queued_without_lock(
        self, task: PoolTask, queue: collections.deque[PoolTask], by_outsider: bool
    ) -> None:
        """``task`` was queued without the lock while a worker went idle or
        blocked, or the pool shut down: wake a worker for it, or take it back
        and refuse the fork if the pool no longer takes forks from outside."""
        with self._lock:
            if self._closed and queue is self._tasks:
                try:
                    queue.remove(task)
                except ValueError:
                    return  # a worker took it already: it runs
                self._refuse_fork()
            self._wake_for_queued(by_outsider)

    def _refuse_fork(self) -> None:
        if self._broken is not None:
            raise self._broken_error()
        raise RuntimeError(f"cannot fork on {self!r}: it has been shut down")

    def _wake_for_queued(self, by_outsider: bool = False) -> None:
        """Wake a worker for queued tasks that no woken worker is on its way
        to yet, if the pool has one to wake or room for one. Called with
        self._lock held."""
        if self._backlog() > len(self._waking):
            self._wake_worker(by_outsider)  # which wakes none if it can't

    def _wake_worker(self, by_outsider: bool = False, start: bool = True) -> _Worker | None:
        """Start or wake a worker for queued work, and return it; None if
        neither can be done. Until the pool has ``max_workers`` workers it
        starts one, even if another is idle (as Java's ThreadPoolExecutor
        starts its core threads); then it wakes the one idle longest, or
        starts one to stand in for a blocked worker if none is idle. So a
        sequence of awaits takes the workers in turn, and none is woken just
        as it fell asleep (see ``_idle``). ``by_outsider``: the calling
        thread, no worker of this pool, forked that work; ``start``: False
        to wake an idle worker only. Called with self._lock held."""
        workers, limit = len(self._workers), self._limit  # max_workers, without its call
        asleep = bool(self._idle) and (workers >= limit or not start)
        if asleep:
            worker = self._idle.popleft()
        elif not start or workers - self._blocked >= limit or workers >= limit + COMPENSATION_LIMIT:
            return None
        else:
            worker = _Worker(self)
            self._workers.add(worker)
            self._queues = (*self._queues, worker.forks)
        occupancy = _budget_slots.hook
        if occupancy is not None:
            # Its spell of work begins, before it can run; the thread that
            # forked the work may count beside it (rule 3 of aiopar._budget)
            # if it is outside every pool, unless an event loop runs there
            # (it awaits its forks) or this pool runs tasks on their own.
            sharer = occupancy.woke(
                worker.slot,
                by_outsider
                and self.forker_counts
                and _current.__dict__.get("worker") is None
                # No event loop runs here: _bridge.running_async_library() is
                # None, inline: once per fork that wakes a worker, whose calls
                # tests/test_overhead.py counts.
                and _get_running_loop() is None
                and _sniffio_thread.name is None,
            )
            if sharer is not None:
                self._sharers[get_ident()] = sharer
        watcher = self._watcher
        if watcher is not None and watcher.parked:
            watcher.wake()
        if asleep:
            self._waking.add(worker)
            worker.wake_up.release()
            return worker
        try:
            worker.thread.start()
        except RuntimeError:  # "can't start new thread": the limit of this system
            self._remove(worker)
            worker.slot.end_spell()
            if not self._workers:
                raise
            # The workers there are will take the task: an idle one now.
            return self._wake_worker(by_outsider, start=False)
        if watcher is None and _stall.SUPPORTED:
            self._watcher = _stall.StallWatcher(
                self._thread_names, self._lock, self._workers, self._stall, self._unstall
            )
            self._watcher.start()
        return worker

    def _runs_own_fork(self, occupancy: Occupancy, woken: _Worker | None, ident: int) -> None:
        """Tell the budget that a thread outside the pools runs one of its own
        forks in ``wait`` (one for which ``woken`` was woken, if not None)."""
        sharer = occupancy.runs_own_fork(None if woken is None else woken.slot, self._runs_a_task)
        if sharer is not None:
            with self._lock:
                self._sharers[ident] = sharer

    def _runs_a_task(self) -> bool:
        """Whether a worker runs a task now."""
        return any(worker.task is not None for worker in list(self._workers))

    def _remove(self, worker: _Worker) -> None:
        # Called with self._lock held, for a worker whose deque is empty.
        self._workers.discard(worker)
        ident = worker.thread.ident  # None if it never started
        if ident is not None:
            self._worker_in.pop(ident, None)
        self._queues = tuple(q for q in self._queues if q is not worker.forks)
        if self._draining:
            self._quiet.notify_all()

    def _work(self, worker: _Worker) -> None:
        _current.worker = worker
        self._worker_in[get_ident()] = worker
        use_slot(worker.slot)
        set_waiter(worker)
        probe()
        state, wakes = hold_wakes()
        try:
            if self._initializer is None or self._initialize():
                self._run_tasks(worker, state, wakes)
        finally:
            send_wakes(wakes)
            state["finishing"] = None
            with self._lock:
                worker.slot.end_spell()
                self._waking.discard(worker)
                if worker in self._workers:
                    # It stops on an error of aiopar's own (a task's never
                    # reaches here), which threading's excepthook reports:
                    # the pool goes on without it, and its queued forks are
                    # another worker's to run.
                    task = worker.task
                    if task is not None and task.future is not None:  # not claimed
                        self._tasks.appendleft(task)
                    self._tasks.extend(worker.forks)
                    worker.forks.clear()
                    self._remove(worker)
                    if self._backlog():
                        self._wake_worker()

    def _initialize(self) -> bool:
        """Call the initializer in this new worker; True if it returned. If it
        raised, the pool is broken: its queued tasks fail and it takes no
        more forks, as concurrent.futures' pools do."""
        try:
            self._initializer(*self._initargs)  # type: ignore[misc]
        except BaseException as exc:
            # Where concurrent.futures' pools report it, for those who listen there.
            cf_logger.critical("Exception in initializer:", exc_info=True)
            self._break(f"a worker's initializer {self._initializer!r} raised {exc!r}")
            return False
        return True

    def _break(self, reason: str) -> None:
        with self._lock:
            if self._broken is None:
                self._broken = reason
            self._closed = True
            queued = self._take_queued()
        for task in queued:
            future = task.claim()
            if future is not None:
                task.settle(future, (None, self._broken_error()))
                del future  # a failure's traceback holds this frame: no cycle (see Future)

    def _broken_error(self) -> BrokenThreadPool:
        return BrokenThreadPool(
            f"{self!r} is broken: {self._broken}; create a new pool (and fix the initializer)"
        )

    def _run_tasks(
        self, worker: _Worker, state: dict[str, Any], wakes: list[Callable[[], Any]]
    ) -> None:
        """Run tasks until the worker retires or the pool stops. ``state``
        and ``wakes``: the thread's, from _bridge.hold_wakes, whose wake-ups
        of event loops go as each task's run ends."""
        slot, forks, shared, waking = worker.slot, worker.forks, self._tasks, self._waking
        while True:
            # Over the limit (it went down, or a blocked worker came back):
            # stop before taking another task.
            if len(self._workers) - self._blocked > self._limit and self._retire(worker):
                return
            # The next task: its own newest fork, else the oldest stolen from
            # another worker, else the oldest in the shared queue. Each deque
            # is looked at before it is popped: an empty one's IndexError
            # costs more than the look. The pop may still find it empty: its
            # owner, or another thief, took the last task meanwhile.
            task = None
            try:
                if forks:
                    task = forks.pop()
                elif any(self._queues):  # one look in C, not a loop, while all are empty
                    for queue in self._queues:
                        if queue:
                            task = queue.popleft()
                            break
                elif shared:
                    task = shared.popleft()
            except IndexError:
                continue  # look again
            if task is None:
                if _budget_slots.hook is None:
                    probe()
                with self._lock:
                    waking.discard(worker)  # it has arrived
                    if self._tasks or any(self._queues):  # self._backlog(), inline
                        continue
                    if self._closed:
                        self._remove(worker)
                        return
                    slot.end_spell()
                    self._idle.append(worker)
                    sharers = None
                    if len(self._idle) == len(self._workers):  # the pool is quiet
                        if self._sharers:
                            sharers, self._sharers = list(self._sharers.values()), {}
                        if self._draining:
                            self._quiet.notify_all()
                if sharers:
                    _budget_slots.hook.pool_quiet(sharers)  # type: ignore[union-attr] # they share
                # A fork that found every worker busy queued its task without
                # the lock, maybe after the look above and before this worker
                # went idle: the fork looks for an idle worker after queuing,
                # this worker at the queues after going idle, so one of the
                # two sees the other.
                if self._tasks or any(self._queues):  # self._backlog(), inline
                    with self._lock:
                        self._wake_for_queued()
                state["finishing"] = None
                # Released by the fork that has work for it, which counts it
                # as on its way to the queues.
                while not worker.wake_up.acquire(timeout=self.idle_retire):
                    if self._retire_idle(worker):
                        return
                continue
            if waking:
                waking.discard(worker)  # it has arrived, if it was on its way
            state["finishing"] = id(task.future)
            worker.task = task
            if blocking_keys and presumed(task.fn):
                self._stall(worker, task)  # it blocked last time: counted out from the start
            # As any task runs (not PoolTask.run, a waiting thread's): its
            # spell of work begins with the first task it runs, not with one
            # it only took.
            Task.run(task, worker.context, None if slot.ran else slot.first_task)
            if worker.context:  # a task left a variable set in it: the next gets a fresh one
                worker.context = Context()
            worker.task = None
            # Counted out as blocked outside aiopar (a wait has resumed by
            # now): it is back. The watcher sets ``held`` before it looks at
            # ``task`` again, this worker clears ``task`` before it looks at
            # ``held``, so one of the two sees the other (see _stall).
            if worker.held is not None:
                self._unstall(worker)
            del task  # the worker keeps no reference while it waits for the next
            if wakes:
                # The loops whose awaits its task completed wake now (see
                # _bridge.hold_wakes), this worker counted as on its way to
                # the queues as a woken worker is: a fork that a loop makes
                # meanwhile wakes no other worker, and this one takes it.
                waking.add(worker)
                send_wakes(wakes)

    def _retire(self, worker: _Worker) -> bool:
        """Stop this worker if the pool has more than its limit; True if so.
        Only for queued work, which the pool's other workers are enough
        for, and not while the next queued task is a call that blocked last
        time: that task will be counted out as it starts, so this worker may
        take it instead of a new one starting. Without queued work, it goes
        idle and retires after ``idle_retire`` seconds if nothing wakes it."""
        with self._lock:
            if len(self._workers) - self._blocked <= self.max_workers or worker.forks:
                return False
            # Nothing queued: it goes idle, and retires if it stays so. A call
            # that blocked last time next: it is counted out as it starts.
            tasks = self._tasks
            if not self._backlog() or (tasks and blocking_keys and presumed(tasks[0].fn)):
                return False
            self._remove(worker)
            self._waking.discard(worker)
            if self._backlog():
                self._wake_worker()  # the wake-up that came here was for a task
            worker.slot.end_spell()
        return True

    def _retire_idle(self, worker: _Worker) -> bool:
        """Stop this worker, idle for ``idle_retire`` seconds, if the pool has
        more workers than ``max_workers`` and nothing has woken it; True if so."""
        with self._lock:
            if worker not in self._idle or len(self._workers) <= self.max_workers:
                return False
            self._idle.remove(worker)
            self._remove(worker)
        return True

    # A blocked worker is counted out of the pool, so queued work gets a
    # worker of its own (a compensating one, if none is idle): one blocked
    # in aiopar's wait tells the pool itself, one blocked outside aiopar is
    # found by the stall watcher, or presumed so as it starts a call that
    # blocked before. Either way it is counted out once.
    def _worker_blocked(self, worker: _Worker) -> None:
        with self._lock:
            if worker.held is None:
                self._count_out()
            worker.held = WAITING

    def _worker_resumed(self, worker: _Worker) -> None:
        with self._lock:
            worker.held = None
            self._blocked -= 1

    def _stall(self, worker: _Worker, task: PoolTask) -> bool:
        """Count ``worker`` out as blocked outside aiopar, if it still runs
        ``task`` and is not counted out already; True if it was."""
        with self._lock:
            if worker.task is not task or worker.held is not None:
                return False
            worker.held = OUTSIDE
            if worker.task is not task:  # it finished meanwhile, and may not have seen ``held``
                worker.held = None
                return False
            self._count_out()
        return True

    def _unstall(self, worker: _Worker) -> None:
        """Count ``worker``, found blocked outside aiopar, in again."""
        with self._lock:
            if worker.held is OUTSIDE:
                worker.held = None
                self._blocked -= 1

    def _count_out(self) -> None:
        # Called with self._lock held.
        self._blocked += 1
        if self._backlog():
            self._wake_worker()

    def _take_queued(self) -> list[PoolTask]:
        """Take every queued task off the queues, oldest first. Called with
        self._lock held; workers pop without it, so a queue may empty meanwhile."""
        taken: list[PoolTask] = []
        for queue in (self._tasks, *self._queues):
            while queue:
                try:
                    taken.append(queue.popleft())
                except IndexError:
                    break
        return taken

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
                    # A fork that Ctrl-C cut short after it queued its task
                    # without the lock may have left it with every worker idle.
                    self._wake_for_queued()
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
            queued = self._take_queued() if cancel_pending else []
            self._closed = True  # workers run what is queued, then stop
            while self._idle:
                worker = self._idle.popleft()
                self._waking.add(worker)
                worker.wake_up.release()  # to stop: it counts for nothing
            threads = [worker.thread for worker in self._workers]
            watcher = self._watcher
            if watcher is not None:
                watcher.stop()
                threads.append(watcher.thread)
        _cancel(queued)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    _interrupt.join(thread)


def _cancel(tasks: list[PoolTask]) -> None:
    """Cancel the futures of tasks taken off the queues (unless they started)."""
    for task in tasks:
        future = task.future
        if future is not None:
            future.cancel()


_live_pools: weakref.WeakSet[ThreadBackend] = weakref.WeakSet()
_limits_lock = threading.Lock()


def _follow_interop_threads(n: int) -> None:
    # set_num_interop_threads(n): the pools made without max_workers follow it.
    with _limits_lock:
        for pool in list(_live_pools):
            if pool._max_workers is None:
                pool._limit = n


_budget.interop_listeners.append(_follow_interop_threads)


def _after_fork_in_child() -> None:
    # Only the forking thread lives on in a child: every pool starts afresh.
    # Queued tasks are the parent's to run; here their futures are cancelled,
    # so nothing in the child waits for them for ever.
    _current.__dict__.pop("worker", None)
    for pool in list(_live_pools):
        queued = pool._take_queued()
        pool._reset()
        for task in queued:
            if task.future is not None:
                task.future.cancel()


os.register_at_fork(after_in_child=_after_fork_in_child)
