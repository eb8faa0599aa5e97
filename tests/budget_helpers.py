"""Helpers for tests that read the intra-op thread budget."""

from __future__ import annotations

import time

from aiopar._budget import budget


def once_alone(fn):
    """``fn`` run once no other thread counts against the budget.

    The thread that forks a task counts until it blocks in ``wait`` (it might
    be computing beside its fork), so a task that starts at once may see a
    share for a moment."""

    def wrapper():
        deadline = time.monotonic() + 5
        while budget.running > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        return fn()

    return wrapper
