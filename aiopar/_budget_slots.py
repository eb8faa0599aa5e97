"""Each thread's standing in the thread budget (rule 2 of ``aiopar._budget``),
and the occupancy hook through which the pools report to it.

The pools call the hook with fork, busy, idle and wait events. It is
``None`` until threadpoolctl finds a BLAS or OpenMP library in the process
(:func:`probe` looks, off the fork path): a pure-Python fork pays one
attribute check for the budget, and nothing else.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque

from . import _budget, _waiter
from ._budget import budget
from ._loop import on_event_loop

__all__ = ["Occupancy", "Slot", "hook", "probe", "this_thread", "use_slot"]


#: a thread that waits this soon after its last fork is not computing beside it
WAITS_AT_ONCE = 0.001


class Slot:
    """One thread's standing in the budget (rule 2), and the waiter of a
    thread outside the pools.

    A slot holds one token while it counts. Its own thread calls
    :meth:`task_started` / :meth:`task_ended` around each task it runs,
    :meth:`went_idle` when it finds no task (a pool's worker) and, through
    the waiter protocol, :meth:`blocked` / :meth:`blocked_long` /
    :meth:`resumed`; a pool calls :meth:`forked` in the thread that forks a
    task, and :meth:`fork_taken` and :meth:`fork_finished` on that thread's
    slot from the thread that runs it.

    Only a slot's own thread writes its counters; other threads set
    ``elsewhere`` and ``sharing``. A transition that may change whether the
    slot counts recounts under ``lock``; one that cannot (the common case,
    task after task) takes no lock.
    """

    __slots__ = (
        "anticipates",
        "counted",
        "counted_since",
        "elsewhere",
        "forked_at",
        "forks",
        "is_blocked",
        "is_worker",
        "lock",
        "running",
        "running_own",
        "sharing",
    )

    def __init__(self, is_worker: bool) -> None:
        self.lock = threading.Lock()
        self.is_worker = is_worker
        self.running = 0  # tasks this thread runs that count (nested ones too)
        self.running_own = 0  # forks of its own it runs (they count only beside others)
        # One item per fork of this thread not finished (nor cancelled) yet:
        # forks append and finishing threads pop, both atomic without a lock.
        self.forks: deque[None] = deque()
        self.elsewhere = False  # another thread started one of them
        self.sharing = False  # it counts for its forks (rule 3)
        self.anticipates = True  # rule 3: it computes beside its forks
        self.forked_at = 0.0
        self.is_blocked = False
        self.counted = False
        self.counted_since = 0.0

    def _recount(self, reserved: bool = False, *, unused: bool = False) -> bool:
        # Called with self.lock held. ``reserved``: a token the task that
        # starts here took at its fork, which this thread takes over if it
        # starts counting now; returns whether it did. ``unused``: if it
        # stops counting, its share was never used (rule 4 does not wait).
        counts = (self.sharing or self.running > 0) and not self.is_blocked
        if counts != self.counted:
            self.counted = counts
            if counts:
                self.counted_since = _budget.clock()
                if reserved:
                    return True
                budget.take()
            else:
                budget.give_back(now=unused)
        return False

    # -- a task runs in this slot's thread --

    def task_started(self, reserved: bool, forker: Slot | None, *, queued: bool = False) -> None:
        """This thread starts a task (forked by ``forker``, a thread outside
        the pools, or None); ``reserved`` if it holds a token from its fork,
        ``queued`` if other tasks wait in its pool's queue."""
        if forker is self:  # it waits for its own fork, and runs it
            self._waits()
            if reserved:
                _reserved_not_needed(queued)
            self.running_own += 1
            if self.elsewhere and not self.sharing:  # it computes beside its other forks after all
                with self.lock:
                    self._share(anyway=True)
            return
        self.running += 1
        # A thread that counts already (it is not blocked: it runs this task)
        # goes on counting.
        if reserved or not self.counted:
            with self.lock:
                took_over = self._recount(reserved)
            if reserved and not took_over:
                _reserved_not_needed(queued)
        if forker is not None:
            forker.fork_taken()
        if budget.per_thread:
            budget.apply_here()

    def task_ended(self, forker: Slot | None, *, linger: bool = False) -> None:
        """The task started by the matching :meth:`task_started` ended.

        With ``linger`` (tasks are queued) a pool's worker keeps counting
        until its next transition, which :meth:`went_idle` guarantees, so a
        stream of tasks does not take and give back a token for each one.
        Any other thread stops counting at once.
        """
        if forker is self:
            self.running_own -= 1
            self.fork_finished()
            return
        if forker is not None:
            forker.fork_finished()
        self.running -= 1
        if not (linger and self.is_worker):
            self._stop_unless_running()

    def went_idle(self) -> None:
        """This thread, a pool's worker, found no task to run."""
        if self.counted and not self.running:
            self._stop_unless_running()
        else:
            # It never counted: it was woken for a fork that another thread
            # ran, and the others queued then had been run too (rule 3), so
            # the share kept for it goes.
            budget.follow()

    def _stop_unless_running(self) -> None:
        with self.lock:
            self._recount()
            idle = not self.counted
        if idle and budget.per_thread:
            budget.restore_here()

    # -- forks made by this slot's thread (a thread outside the pools) --

    def forked(self, woken: bool) -> None:
        """This thread forked a task; ``woken`` if an idle worker was woken for it."""
        self.forks.append(None)
        self.forked_at = _budget.clock()
        if woken and self.anticipates and not self.sharing:
            with self.lock:
                self._share()

    def fork_taken(self) -> None:
        """Another thread started one of this thread's forks."""
        # Nothing changes once it is known to count for its forks, or known
        # not to (it forks and waits, and runs none of them itself).
        if self.elsewhere and (self.sharing or not (self.anticipates or self.running_own)):
            return
        with self.lock:
            self.elsewhere = True
            self._share(anyway=self.running_own > 0)

    def _share(self, anyway: bool = False) -> None:
        # Called with self.lock held.
        if (anyway or self.anticipates) and not self.sharing:
            self.sharing = True
            self._recount()

    def fork_finished(self) -> None:
        """One of this thread's forks ended, or was cancelled before it started."""
        forks = self.forks
        forks.pop()
        if not forks:
            with self.lock:
                if not forks:  # no fork came meanwhile
                    self.elsewhere = False
                    if self.sharing:
                        self.sharing = False
                        self._recount(unused=self._forked_and_waited())

    def _forked_and_waited(self) -> bool:
        """Whether it counts only for its forks (rule 3), and has for less than
        WAITS_AT_ONCE: it forked and waited, and never used its share."""
        return not self.running and _budget.clock() - self.counted_since < WAITS_AT_ONCE

    def _waits(self) -> None:
        """This thread waits for a future: rule 3 learns how it forks. Only
        a wait at once with a single fork out is ``fork(f).wait()``: a thread
        with several forks out goes on to run some of them itself."""
        forks = len(self.forks)
        if forks:
            self.anticipates = forks > 1 or _budget.clock() - self.forked_at >= WAITS_AT_ONCE

    # -- the waiter protocol: this slot's thread blocks in Future.wait --

    def _idle(self) -> bool:
        # Nothing of this thread counts, or can start to while it waits: no
        # task of its own runs and none of its forks is out (so no other
        # thread touches this slot), as for an event loop's thread.
        return not (self.counted or self.running or self.forks)

    def blocked(self) -> None:
        if self._idle():
            self.is_blocked = True
            return
        self._waits()
        with self.lock:
            counted, since = self.counted, self.counted_since
            self.is_blocked = True
            self._recount(unused=self._forked_and_waited())
        if counted and _budget.clock() - since < _waiter.BLOCKED_LONG:
            budget.follow()  # it waits at once: its cores go to what it waits for

    def blocked_long(self) -> None:
        budget.follow()

    def resumed(self) -> None:
        if self._idle():
            self.is_blocked = False
            return
        with self.lock:
            self.is_blocked = False
            self._recount()


def _reserved_not_needed(queued: bool) -> None:
    """Give back the token of a fork whose woken worker did not run it (its
    forker, or another thread that counts already, did). At once, unless
    other tasks are queued: that worker takes one of them, and counts."""
    budget.give_back(now=not queued)


_local = threading.local()  # .slot: this thread's Slot


def this_thread() -> Slot:
    """The calling thread's slot; a thread outside the pools gets one on
    first use, registered as its waiter unless it has one."""
    slot = _local.__dict__.get("slot")
    if slot is None:
        slot = _local.slot = Slot(is_worker=False)
        if _waiter.get_waiter() is None:
            _waiter.set_waiter(slot)
    return slot


def use_slot(slot: Slot) -> None:
    """Make ``slot`` the calling thread's: a pool's worker, whose pool is its waiter."""
    _local.slot = slot


class Occupancy:
    """The budget's ear on the pools: each method is an event a pool reports.

    Installed as :data:`hook` once a BLAS or OpenMP library is loaded; a
    pool reads ``hook`` once per event and, where an event has a matching end
    (a task that starts and ends), reports the end to the hook it reported
    the start to.
    """

    def forked(self, woken: bool, forker_counts: bool) -> Slot | None:
        """A task was forked, in the forking thread, under its pool's lock;
        ``woken`` if an idle worker was woken (or started) for it, which
        holds a token from now on (rule 3). Returns the forker's slot if it
        counts beside the fork: a thread outside the pools that is not an
        event loop's, if ``forker_counts``."""
        if woken:
            budget.take()
        if not forker_counts or on_event_loop():
            return None
        slot = this_thread()
        if slot.is_worker:
            return None
        slot.forked(woken)
        return slot

    def busy(self, reserved: bool, forker: Slot | None, *, queued: bool) -> Slot:
        """This thread starts a task; returns its slot, for :meth:`Slot.task_ended`."""
        slot = this_thread()
        slot.task_started(reserved, forker, queued=queued)
        return slot

    def cancelled(self, forker: Slot | None, reserved: bool) -> None:
        """A task that never ran gives back what its fork took."""
        if forker is not None:
            forker.fork_finished()
        if reserved:
            budget.give_back(now=True)


#: the occupancy hook: None until a BLAS or OpenMP library is loaded
hook: Occupancy | None = None


def _install() -> None:
    global hook
    if hook is None:
        hook = Occupancy()


budget.on_found = _install


def probe() -> None:
    """Install :data:`hook` if a BLAS or OpenMP library was loaded since the
    budget last looked; costs a length check while no module was imported.
    Pools call it off the fork path: when a worker starts, goes idle or blocks."""
    if hook is None and len(sys.modules) != budget.modules_seen:
        with budget.lock:
            budget._scan()


def _after_fork_in_child() -> None:
    # Only the forking thread survives in a child: its slot starts afresh.
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)
