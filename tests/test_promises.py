"""Three promises of the future (issue 39): a wait without a timeout runs a
task that has not started, and a timeout bounds the whole call (a pool's
worker still runs its own queued forks first); only its task settles a
forked future; a claimed task that never started can end cancelled."""

from __future__ import annotations

import threading
from typing import Any

import pytest

import aiopar
from aiopar.backends import Task

pytestmark = pytest.mark.timeout(60)


class Holding(aiopar.Backend):
    """Keeps every task it is given until :meth:`run_held`: a task that has
    not started, for as long as a test needs, whatever the machine does."""

    name = "holding"

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Task] = []

    def enqueue(self, task: Task) -> None:
        self.held.append(task)

    def run_held(self) -> None:
        while self.held:
            self.held.pop(0).run()

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        self._closed = True
        self.run_held()

    @property
    def max_workers(self) -> int:
        return 1


@pytest.fixture
def holding():
    with Holding() as backend:
        yield backend


def ran_where() -> str:
    return threading.current_thread().name


def test_a_wait_without_a_timeout_runs_a_task_that_has_not_started(holding):
    assert holding.fork(ran_where).wait() == threading.current_thread().name
    assert holding.fork(ran_where).result() == threading.current_thread().name


WAITS_WITH_A_TIMEOUT = {
    "wait(timeout=0)": lambda fut: fut.wait(timeout=0),
    "wait(timeout=0.01)": lambda fut: fut.wait(timeout=0.01),
    "result(timeout=0)": lambda fut: fut.result(timeout=0),
    "result(timeout=-1)": lambda fut: fut.result(timeout=-1),
    "result(timeout=0.01)": lambda fut: fut.result(timeout=0.01),
    "exception(timeout=0.01)": lambda fut: fut.exception(timeout=0.01),
}


@pytest.mark.parametrize("wait", WAITS_WITH_A_TIMEOUT.values(), ids=WAITS_WITH_A_TIMEOUT.keys())
def test_a_timeout_bounds_the_whole_call_and_leaves_a_task_that_has_not_started(holding, wait):
    # What README, then.md and guarantees.md say: a progress loop that
    # waits a little at a time keeps its thread.
    fut = holding.fork(ran_where)
    with pytest.raises(TimeoutError, match="still not done"):
        wait(fut)
    assert not fut.done()  # not run in the caller
    holding.run_held()
    assert fut.wait(timeout=0) == threading.current_thread().name


def test_a_pool_worker_that_waits_with_a_timeout_first_runs_its_own_queued_forks():
    def parent() -> tuple[str, str]:
        child = pool.fork(ran_where)  # to this worker's own deque
        return ran_where(), child.wait(timeout=30)

    with aiopar.get_backend("thread", max_workers=1) as pool:
        here, child_ran = pool.fork(parent).result(timeout=30)
    assert child_ran == here != threading.current_thread().name


def test_a_timeout_still_bounds_the_wait_for_a_task_running_elsewhere():
    gate = threading.Event()
    started = threading.Event()

    def blocked() -> None:
        started.set()
        gate.wait(30)

    fut = aiopar.fork(blocked)
    assert started.wait(30)
    try:
        with pytest.raises(TimeoutError, match="still not done"):
            fut.wait(timeout=0.01)
    finally:
        gate.set()
    assert fut.wait(timeout=30) is None


# -- only its task settles a forked future -------------------------------------


SETTLE_BY_HAND = {
    "set_result": lambda fut: fut.set_result("outside"),
    "set_exception": lambda fut: fut.set_exception(KeyError("outside")),
}


@pytest.mark.parametrize("settle", SETTLE_BY_HAND.values(), ids=SETTLE_BY_HAND.keys())
def test_a_forked_future_that_has_not_started_refuses_to_be_settled_by_hand(holding, settle):
    fut = holding.fork(ran_where)
    with pytest.raises(aiopar.InvalidStateError) as refused:
        settle(fut)
    message = str(refused.value)
    assert "ran_where()" in message and "only its task settles it" in message
    assert "Future() you made yourself" in message and "cancel()" in message
    holding.run_held()  # the task still runs, and its outcome stands
    assert fut.wait() == threading.current_thread().name


@pytest.mark.parametrize("settle", SETTLE_BY_HAND.values(), ids=SETTLE_BY_HAND.keys())
def test_a_running_forked_future_refuses_to_be_settled_by_hand(settle):
    started, gate = threading.Event(), threading.Event()

    def running() -> str:
        started.set()
        gate.wait(30)
        return "its own"

    fut = aiopar.fork(running)
    assert started.wait(30)
    try:
        with pytest.raises(aiopar.InvalidStateError, match=r"running\(\): only its task"):
            settle(fut)
    finally:
        gate.set()
    assert fut.wait(timeout=30) == "its own"
    with pytest.raises(aiopar.InvalidStateError, match="already done"):
        settle(fut)


def test_map_items_and_coroutine_forks_refuse_to_be_settled_by_hand(holding):
    async def coro() -> int:
        return 1

    items = holding.map(abs, [-1, -2])
    coroutine = aiopar.fork(coro)
    for fut in [*items, coroutine]:
        with pytest.raises(aiopar.InvalidStateError, match="only its task settles it"):
            fut.set_result(0)
    holding.run_held()
    assert [f.wait() for f in items] == [1, 2] and coroutine.wait(timeout=30) == 1


def test_a_future_made_by_hand_is_settled_by_hand_as_before():
    fut: aiopar.Future[int] = aiopar.Future()
    fut.set_result(3)
    assert fut.wait() == 3
    with pytest.raises(aiopar.InvalidStateError, match="already done"):
        fut.set_exception(ValueError)
    failed: aiopar.Future[Any] = aiopar.Future()
    failed.set_running_or_notify_cancel()  # as a concurrent.futures executor does
    failed.set_exception(ValueError)
    assert isinstance(failed.exception(), ValueError)


# -- a claimed task that never started -----------------------------------------


def test_a_future_claimed_but_never_started_can_end_cancelled(holding):
    fut = holding.fork(ran_where)
    told = []
    fut.add_done_callback(told.append)
    assert not fut._cancel_claimed()  # pending: cancel() is the way
    assert fut._claim()  # what a process pool does as it sends a task ahead
    assert not fut.cancel()
    assert fut._cancel_claimed()
    assert fut.cancelled() and told == [fut]
    with pytest.raises(aiopar.CancelledError):
        fut.wait()
    holding.run_held()  # its claim fails: it never runs
    assert fut.cancelled()
