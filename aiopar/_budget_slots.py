"""Each thread's standing in the thread budget (rule 2 of ``aiopar._budget``),
and the occupancy hook through which the pools report to it.

The pools report transitions, not tasks: a worker woken for work (idle to
busy), a worker that finds no task (busy to idle), a pool with no worker
busy, and, through the waiter protocol, a thread that blocks in ``wait``
and resumes. A task that follows another on the same worker and a fork that
wakes no worker report nothing. The hook is ``None`` until threadpoolctl
finds a BLAS or OpenMP library in the process (:func:`probe` looks, off the
fork path): until then a fork pays one attribute check for the budget.

The hook's methods that a plain ``fork(f).wait()`` passes through make no
further Python call unless the libraries' count must change: they spell out
the budget's ``take`` and ``give_back``, and read the share from its table
(tests/test_budget_copies.py checks that each copy behaves as its original).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

from . import _budget, _waiter
from ._budget import budget

__all__ = ["Occupancy", "Slot", "hook", "probe", "this_thread", "use_slot"]


#: a thread that waits this soon after a fork that woke a worker forks and waits (rule 3)
WAITS_AT_ONCE = 0.001


class Slot:
    """One thread's standing in the budget (rule 2), and the waiter of a
    thread outside the pools.

    A slot holds one token while it counts: while it is ``busy`` (a pool's
    worker from its wake-up to going idle; a thread outside the pools while
    it runs another thread's task) or ``sharing`` (a thread outside the
    pools beside its forks, rule 3), and not blocked in ``wait``. A worker's
    slot is written by its own thread, or by the thread that wakes it while
    it sleeps; another thread may end a slot's ``sharing`` (its pool went
    quiet), so a change of ``counted`` outside a worker takes ``lock``.
    """

    __slots__ = (
        "anticipates",
        "busy",
        "counted",
        "counted_since",
        "forked_at",
        "is_blocked",
        "is_worker",
        "lock",
        "ran",
        "sharing",
        "wakes",
        "woken_by",
    )

    def __init__(self, is_worker: bool) -> None:
        self.lock = threading.Lock()
        self.is_worker = is_worker
        self.busy = 0  # a worker: 1 from its wake-up to going idle; else tasks it runs
        self.sharing = False  # it counts beside its forks (rule 3)
        self.is_blocked = False
        self.counted = False  # it holds a token
        self.counted_since = 0.0
        self.ran = False  # a worker ran a task since its wake-up
        self.woken_by: Slot | None = None  # a worker: the forker that woke it (rule 3)
        # Rule 3: whether it computes beside its forks, as far as it has
        # shown, and the time of its last fork that woke a worker until it
        # next waits.
        self.anticipates = True
        self.forked_at: float | None = None
        # The workers woken for its forks that have not started a task yet,
        # and whose forks it has not run itself (set.add and set.discard are
        # atomic: the woken worker's thread discards too).
        self.wakes: set[Slot] = set()

    def _recount(self, *, unused: bool = False) -> None:
        # Called with self.lock held, or by a worker's own thread. ``unused``:
        # if it stops counting, its share was never used (rule 4 does not wait).
        counts = (self.sharing or self.busy > 0) and not self.is_blocked
        if counts != self.counted:
            self.counted = counts
            if counts:
                self.counted_since = _budget.clock()
                budget.take()
            else:
                budget.give_back(now=unused)

    # -- rule 3: a thread outside the pools beside its forks --

    def share(self) -> None:
        """It forked, waking a worker, and computes beside the fork: it counts."""
        with self.lock:
            if not self.sharing:
                self.sharing = True
                self._recount()

    def stop_sharing(self, *, unused: bool = False) -> None:
        """Its forks need no room any more: it stops counting for them."""
        with self.lock:
            if self.sharing:
                self.sharing = False
                self._recount(unused=unused)

    def _waits(self, pending: int = 1) -> None:
        """It waits: rule 3 learns whether it forks and waits at once: within
        WAITS_AT_ONCE of its last fork that woke a worker, with no more than
        ``pending`` woken workers yet to start a task (the one woken for what
        it waits for, if it has not run that itself). It stops counting
        beside its forks, at once if it forked and waited."""
        forked_at = self.forked_at
        self.forked_at = None
        if forked_at is not None:
            now = _budget.clock()
            at_once = len(self.wakes) <= pending and now - forked_at < WAITS_AT_ONCE
            self.anticipates = not at_once
            if self.sharing:
                self.stop_sharing(unused=at_once and now - self.counted_since < WAITS_AT_ONCE)
        elif self.sharing:
            self.stop_sharing()

    # -- a pool's worker: a spell of work from its wake-up to going idle --

    def first_task(self) -> None:
        """This worker starts the first task of its spell of work: it counts
        from now, if it does not already (rule 2)."""
        self.ran = True
        woken_by = self.woken_by
        if woken_by is not None:
            self.woken_by = None
            woken_by.wakes.discard(self)
        if self.counted or hook is None:
            return
        now = _budget.clock()
        self.counted, self.counted_since = True, now
        # budget.take(now), inline: once per `await fork(f)`, and the Python
        # calls of a fork and its wait are counted (tests/test_overhead.py);
        # tests/test_budget_copies.py checks that the two count alike.
        tokens = budget.tokens
        tokens.append(None)
        running = len(tokens)
        if running > 1:
            budget.crowded_at = now
        if budget.explicit is None and budget.shares[running] != budget.applied:
            budget.follow()
        if budget.per_thread:
            budget.apply_here()

    def end_spell(self) -> None:
        """This worker, woken by :meth:`Occupancy.woke`, found no task and is
        idle again, or stops. Called in its own thread under its pool's lock,
        before a thread that wakes it may start another spell; nothing
        changes if it had no spell. Its token, if it counted, comes back: at
        once if it ran no task since its wake-up, else as rule 4 says."""
        self.busy = 0
        woken_by = self.woken_by
        if woken_by is not None:
            self.woken_by = None
            woken_by.wakes.discard(self)
        if not self.counted:
            return
        self.counted = False
        # budget.give_back(now=not self.ran), inline: as in first_task.
        tokens = budget.tokens
        tokens.pop()
        now = not self.ran
        if (
            (now or not tokens)
            and budget.explicit is None
            and budget.shares[len(tokens)] != budget.applied
        ):
            budget.follow(now=now)
        if budget.per_thread:
            budget.restore_here()

    # -- rule 2: a thread outside the pools runs another thread's task --

    def task_started(self) -> None:
        self.busy += 1
        if not self.counted:
            with self.lock:
                self._recount()
        if budget.per_thread:
            budget.apply_here()

    def task_ended(self) -> None:
        self.busy -= 1
        if not self.busy and self.counted and not self.sharing:
            with self.lock:
                self._recount()
            if budget.per_thread:
                budget.restore_here()

    # -- the waiter protocol: this slot's thread blocks in Future.wait --

    def blocked(self) -> None:
        counted, since = self.counted, self.counted_since
        if self.sharing:
            self._waits()
        elif self.forked_at is not None:
            # self._waits(), inline: once per fork and wait, whose Python calls
            # are counted; tests/test_budget_copies.py checks they agree.
            forked_at, self.forked_at = self.forked_at, None
            self.anticipates = not (
                len(self.wakes) <= 1 and _budget.clock() - forked_at < WAITS_AT_ONCE
            )
        self.is_blocked = True
        if not counted:
            return
        if self.is_worker:
            self._recount()
        elif self.counted:
            with self.lock:
                self._recount()
        if _budget.clock() - since < _waiter.BLOCKED_LONG:
            budget.follow()  # it waits at once: its cores go to what it waits for

    def blocked_long(self) -> None:
        budget.follow()

    def resumed(self) -> None:
        self.is_blocked = False
        if self.busy or self.sharing:
            if self.is_worker:
                self._recount()
            else:
                with self.lock:
                    self._recount()


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
    """The budget's ear on the pools: each method is a transition a pool reports.

    Installed as :data:`hook` once a BLAS or OpenMP library is loaded. A
    worker whose wake-up was reported reports its first task and the end
    of its spell of work to its slot (:meth:`Slot.first_task`,
    :meth:`Slot.end_spell`), whatever the hook is by then.
    """

    def woke(self, worker: Slot, forker_counts: bool) -> Slot | None:
        """An idle worker was woken (or started) for queued work; called
        under its pool's lock, while the worker cannot run. Its spell of work
        begins: it counts from its first task (:meth:`Slot.first_task`), or
        from now if its forker computes beside its forks (rule 3): then that
        thread counts from now too, and its slot is returned, for
        :meth:`pool_quiet`. ``forker_counts``: the calling thread forked that
        work and is a thread outside the pools that is not an event loop's."""
        worker.busy, worker.ran = 1, False
        if not forker_counts:
            return None
        forker = _local.__dict__.get("slot") or this_thread()
        forker.wakes.add(worker)
        worker.woken_by = forker
        forker.forked_at = now = _budget.clock()
        if not forker.anticipates:
            return None
        worker.counted, worker.counted_since = True, now
        budget.take()
        if forker.sharing:
            return None
        forker.share()
        return forker

    def pool_quiet(self, sharers: list[Slot]) -> None:
        """A pool has no worker busy: the threads that counted beside their
        forks on it stop (rule 3)."""
        for slot in sharers:
            slot.stop_sharing()

    def runs_other_task(self) -> Slot:
        """A thread outside the pools runs a task another thread forked, in
        ``wait``: it counts until :meth:`Slot.task_ended`."""
        slot = this_thread()
        slot.task_started()
        return slot

    def runs_own_fork(self, woken: Slot | None, beside: Callable[[], bool]) -> Slot | None:
        """A thread outside the pools runs one of its forks in ``wait``: one
        for which the worker ``woken`` was woken, or any while it does not
        count beside its forks. It counts from now if another worker woken
        for its forks has yet to start (it runs this one beside that), or if
        ``beside()`` says a worker runs a task beside it: then its slot is
        returned, for :meth:`pool_quiet`."""
        slot = this_thread()
        if woken is not None:
            slot.wakes.discard(woken)  # that worker will not run this fork
            slot._waits(pending=0)
        if slot.sharing or not (slot.wakes or beside()):
            return None
        slot.share()
        return slot


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
            budget.scan()


def _after_fork_in_child() -> None:
    # Only the forking thread survives in a child: its slot starts afresh.
    global _local
    _local = threading.local()


os.register_at_fork(after_in_child=_after_fork_in_child)
