"""An aiopar Future as a concurrent.futures.Future: states, result() and
exception() with their timeouts, done-callbacks (the behaviours CPython's
test_future checks, written against aiopar). wait() keeps torch's rules:
see test_future.py."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Any

import pytest
from future_helpers import cancelled, failed, pending, running, succeeded

from aiopar import CancelledError, Future, InvalidStateError

pytestmark = pytest.mark.timeout(60)

LIMIT = 10


STATES = {
    "pending": pending,
    "running": running,
    "cancelled": cancelled,
    "failed": failed,
    "succeeded": succeeded,
}
# state: (done(), cancelled(), running())
FLAGS = {
    "pending": (False, False, False),
    "running": (False, False, True),
    "cancelled": (True, True, False),
    "failed": (True, False, False),
    "succeeded": (True, False, False),
}


@pytest.mark.parametrize("state", STATES)
def test_done_cancelled_and_running_in_each_state(state):
    fut = STATES[state]()
    assert (fut.done(), fut.cancelled(), fut.running()) == FLAGS[state]


@pytest.mark.parametrize("timeout", [0, -1, -0.5, float("nan")])
@pytest.mark.parametrize("state", ["pending", "running"])
def test_result_and_exception_with_no_time_left_raise_timeout_error(state, timeout):
    # As concurrent.futures: Executor.map passes a negative timeout once its
    # deadline has passed.
    fut = STATES[state]()
    with pytest.raises(TimeoutError):
        fut.result(timeout)
    with pytest.raises(TimeoutError):
        fut.exception(timeout)


@pytest.mark.parametrize("timeout", [0, -1])
def test_result_and_exception_of_a_done_future_need_no_time(timeout):
    assert succeeded().result(timeout) == 42
    assert succeeded().exception(timeout) is None
    with pytest.raises(OSError, match="on purpose"):
        failed().result(timeout)
    assert isinstance(failed().exception(timeout), OSError)
    with pytest.raises(concurrent.futures.CancelledError):
        cancelled().result(timeout)
    with pytest.raises(concurrent.futures.CancelledError):
        cancelled().exception(timeout)


def test_wait_keeps_its_own_rule_for_negative_timeouts():
    with pytest.raises(ValueError, match="timeout"):
        pending().wait(timeout=-1)


@pytest.mark.parametrize("settle", ["result", "exception", "cancel"])
def test_a_blocked_result_wakes_when_another_thread_settles(settle):
    fut: Future[int] = Future()

    def settle_it() -> None:
        if settle == "result":
            fut.set_result(5)
        elif settle == "exception":
            fut.set_exception(OSError("settled elsewhere"))
        else:
            fut.cancel()

    threading.Thread(target=settle_it).start()
    if settle == "result":
        assert fut.result(timeout=LIMIT) == 5
    elif settle == "exception":
        assert isinstance(fut.exception(timeout=LIMIT), OSError)
    else:
        with pytest.raises(CancelledError):
            fut.result(timeout=LIMIT)


def test_cancel_succeeds_before_the_future_runs_and_never_after():
    for make, expected in [
        (pending, True),
        (cancelled, True),
        (running, False),
        (failed, False),
        (succeeded, False),
    ]:
        fut = make()
        assert fut.cancel() is expected, make.__name__
        assert fut.cancelled() is expected
    assert concurrent.futures.wait([cancelled()], timeout=0).done  # notified at once


def test_a_second_settle_raises_invalid_state_naming_the_future():
    for settle in (lambda f: f.set_result(2), lambda f: f.set_exception(ValueError())):
        fut = succeeded()
        with pytest.raises(concurrent.futures.InvalidStateError, match="finished returned int"):
            settle(fut)
        assert fut.result() == 42
    with pytest.raises(InvalidStateError, match="cancelled"):
        cancelled().set_result(1)


def test_set_running_or_notify_cancel_as_an_executor_calls_it():
    assert pending().set_running_or_notify_cancel() is True
    assert cancelled().set_running_or_notify_cancel() is False
    for make in (running, succeeded):
        with pytest.raises(InvalidStateError, match="runs only once"):
            make().set_running_or_notify_cancel()


@pytest.mark.parametrize("settle", ["result", "exception", "cancel"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_done_callback_sees_the_outcome_whether_added_before_or_after(settle, when):
    seen: list[Any] = []

    def callback(fut: Future[int]) -> None:
        if fut.cancelled():
            seen.append("cancelled")
        elif fut.exception() is not None:
            seen.append(fut.exception().args)
        else:
            seen.append(fut.result())

    fut: Future[int] = Future()
    if when == "before":
        fut.add_done_callback(callback)
    {
        "result": lambda: fut.set_result(5),
        "exception": lambda: fut.set_exception(Exception("test")),
        "cancel": fut.cancel,
    }[settle]()
    if when == "after":
        fut.add_done_callback(callback)
    assert seen == [{"result": 5, "exception": ("test",), "cancel": "cancelled"}[settle]]


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_callback_that_raises_is_logged_and_the_next_one_still_runs(caplog, when):
    ran: list[str] = []

    def raising(fut: Future[int]) -> None:
        ran.append("raising")
        raise Exception("doh!")

    fut: Future[int] = Future()
    with caplog.at_level(logging.ERROR, logger="aiopar"):
        if when == "before":
            fut.add_done_callback(raising)
            fut.add_done_callback(lambda f: ran.append("next"))
            fut.set_result(5)
        else:
            fut.set_result(5)
            fut.add_done_callback(raising)
            ran.append("next")
    assert ran == ["raising", "next"]
    (record,) = caplog.records
    assert "done-callback" in record.getMessage() and "Exception: doh!" in record.exc_text


def test_repr_says_the_state_and_outcome():
    assert "pending" in repr(pending())
    assert "running" in repr(running())
    assert "cancelled" in repr(cancelled())
    assert "finished raised OSError" in repr(failed())
    assert "finished returned int" in repr(succeeded())
