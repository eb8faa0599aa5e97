"""Helpers for tests that read the intra-op thread budget."""

from __future__ import annotations

import time

import aiopar
from aiopar._budget import budget


def once_alone(fn):
    """``fn`` run while no other thread counts against the budget: its
    value is one read with none counting just before and just after.

    The thread that forks a task counts until it blocks in ``wait`` (it might
    be computing beside its fork), so a task that starts at once may see a
    share for a moment, and the libraries get their threads back up to 0.1 s
    later (rule 4). A worker still awake from the last task may take the
    fork before the worker woken for it starts: the forker then counts from
    the fork, a moment after the task has started."""

    def alone() -> bool:
        return budget.running <= 1 and not late()

    def wrapper():
        deadline = time.monotonic() + 5
        while True:
            while not alone() and time.monotonic() < deadline:
                time.sleep(0.001)
            value = fn()
            if alone() or time.monotonic() >= deadline:
                return value

    return wrapper


def late() -> bool:
    """Whether the libraries have yet to get the budget's count: rule 4 gives
    threads back up to 0.1 s after they were last shared (``applied`` is
    None while someone else holds a library, rule 5)."""
    return budget.applied not in (None, budget.target())


def settle(timeout: float = 5.0) -> None:
    """Wait until the default thread pool's workers are all asleep, no task
    counts against the budget (workers finish after futures settle) and the
    libraries have the count for that. A worker woken for a fork may reach
    the queue late on a busy machine, long after the fork was cancelled or
    run by its waiter, and only then go back to sleep."""
    pool = aiopar.get_backend("thread")
    deadline = time.monotonic() + timeout
    while (
        len(pool._idle) != len(pool._workers) or budget.running or late()
    ) and time.monotonic() < deadline:
        time.sleep(0.001)
    with budget.lock:  # a change under way has ended
        assert budget.running == 0 and not late()
