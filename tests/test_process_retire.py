"""max_tasks_per_child, as ProcessPoolExecutor has it: a worker that has run
its share of tasks exits cleanly and a new one takes its place."""

from __future__ import annotations

import logging
import os
from collections import Counter

import process_helpers
import pytest

nothing_left_behind = process_helpers.nothing_left_behind
own_pool = process_helpers.own_pool


@pytest.mark.parametrize("at_once", [True, False])
def test_a_worker_retires_after_max_tasks_per_child_and_is_replaced(own_pool, caplog, at_once):
    backend = own_pool(1, max_tasks_per_child=2)
    with caplog.at_level(logging.WARNING, logger="aiopar"):
        if at_once:  # queued ahead on the worker (prefetch) as far as its share allows
            pids = [f.wait(timeout=60) for f in [backend.fork(os.getpid) for _ in range(5)]]
        else:
            pids = [backend.fork(os.getpid).wait(timeout=60) for _ in range(5)]
    assert sorted(Counter(pids).values()) == [1, 2, 2], pids
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4], pids
    assert not caplog.records  # a retirement, not a failure


def test_max_tasks_per_child_is_a_whole_number():
    from aiopar.backends.process import ProcessBackend

    with pytest.raises(ValueError, match="max_tasks_per_child must be a whole number >= 1"):
        ProcessBackend(1, max_tasks_per_child=0)
