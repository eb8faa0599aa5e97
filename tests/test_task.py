"""The two places where the hot path spells out what a function does, to
save its call: Task.run claims as Task.claim does (see Task.run), and
wait_all reads values as Future.value does."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import aiopar
from aiopar.backends._base import Task


def _task() -> Task:
    future: aiopar.Future[Any] = aiopar.Future()
    return Task(future, int, ("7",), {}, None, aiopar.get_backend("inline"))


def _pending(task: Task) -> None:
    pass


def _cancelled(task: Task) -> None:
    assert task.future is not None
    task.future.cancel()


def _claimed_elsewhere(task: Task) -> None:
    assert task.future is not None
    assert Task(task.future, int, (), {}, None, task.backend).claim() is task.future


def _already_run(task: Task) -> None:
    task.run()


@pytest.mark.parametrize("before", [_pending, _cancelled, _claimed_elsewhere, _already_run])
def test_run_claims_exactly_as_claim_does(before: Callable[[Task], None]) -> None:
    by_claim, by_run = _task(), _task()
    before(by_claim)
    before(by_run)
    future_of_claim, future_of_run = by_claim.future, by_run.future
    claimed = by_claim.claim()
    by_run.run()
    # The task lets go of its future exactly when claim takes it.
    assert (by_claim.future is None) == (by_run.future is None)
    if claimed is None:
        # Nothing ran: the future is as claim left it.
        assert future_of_run is None or future_of_run.running() == (
            future_of_claim is not None and future_of_claim.running()
        )
        assert future_of_run is None or not future_of_run.done() or future_of_run.cancelled()
    else:
        assert claimed is future_of_claim and claimed.running()
        assert future_of_run is not None and future_of_run.wait(timeout=0) == 7


def test_values_reads_as_value_does() -> None:
    # wait_all's read of a batch's values (aiopar._future.values) is value()'s
    # common case without its call: the two must agree on every success.
    from aiopar._future import values

    futures: list[aiopar.Future[Any]] = [aiopar.Future() for _ in range(4)]
    for value, fut in zip([0, None, "x", [1]], futures, strict=True):
        fut.set_result(value)
    assert values(futures) == [fut.value() for fut in futures]
