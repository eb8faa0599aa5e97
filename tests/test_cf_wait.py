"""concurrent.futures.wait() and as_completed() on aiopar futures, as on the
standard library's own (the behaviours CPython's test_wait and
test_as_completed check, written against aiopar)."""

from __future__ import annotations

import concurrent.futures
import threading
from concurrent.futures import ALL_COMPLETED, FIRST_COMPLETED, FIRST_EXCEPTION
from typing import Any

import pytest
from future_helpers import done_futures, failed, succeeded

import aiopar
from aiopar import Future

pytestmark = pytest.mark.timeout(60)

LIMIT = 10  # every wait here is bounded: a regression fails, it never hangs


@pytest.mark.parametrize("timeout", [0, -1])
def test_as_completed_with_no_time_left_yields_the_done_futures_then_times_out(timeout):
    done = done_futures()
    pending: list[Future[Any]] = [Future(), Future()]
    yielded = []
    with pytest.raises(TimeoutError, match=r"^2 \(of 5\) futures unfinished$"):
        for fut in concurrent.futures.as_completed(done + pending, timeout=timeout):
            yielded.append(fut)
    assert sorted(map(id, yielded)) == sorted(map(id, done))


@pytest.mark.parametrize("return_when", [FIRST_COMPLETED, FIRST_EXCEPTION, ALL_COMPLETED])
@pytest.mark.parametrize("timeout", [0, -1])
def test_wait_with_no_time_left_sorts_done_from_pending(return_when, timeout):
    done = done_futures()
    pending: list[Future[Any]] = [Future()]
    result = concurrent.futures.wait(done + pending, timeout=timeout, return_when=return_when)
    assert result.done == set(done) and result.not_done == set(pending)


def test_first_completed_returns_every_future_done_already_with_executor_ones():
    executor_future: concurrent.futures.Future[int] = concurrent.futures.Future()
    executor_future.set_result(0)
    ours = succeeded()
    pending: Future[int] = Future()
    done, not_done = concurrent.futures.wait(
        [executor_future, ours, pending], timeout=LIMIT, return_when=FIRST_COMPLETED
    )
    assert done == {executor_future, ours} and not_done == {pending}


def test_first_exception_returns_at_once_when_one_failed_already():
    failure = failed()
    pending: Future[int] = Future()
    done, not_done = concurrent.futures.wait(
        [failure, pending, succeeded()], return_when=FIRST_EXCEPTION
    )
    assert failure in done and not_done == {pending}


def test_first_exception_waits_for_a_failure_and_not_for_the_rest():
    gate = threading.Event()
    fine = aiopar.fork(int, "1")
    failing = aiopar.fork(int, "x")
    held = aiopar.fork(gate.wait, LIMIT)
    try:
        done, not_done = concurrent.futures.wait(
            [fine, failing, held], timeout=LIMIT, return_when=FIRST_EXCEPTION
        )
        assert failing in done and not_done == {held}
    finally:
        gate.set()
    assert isinstance(failing.exception(), ValueError)


def test_first_exception_without_a_failure_waits_for_all():
    futs = [aiopar.fork(int, "1"), aiopar.fork(int, "2")]
    done, not_done = concurrent.futures.wait(futs, timeout=LIMIT, return_when=FIRST_EXCEPTION)
    assert done == set(futs) and not not_done


def test_a_timeout_leaves_a_running_future_in_not_done():
    gate = threading.Event()
    held = aiopar.fork(gate.wait, LIMIT)
    try:
        done, not_done = concurrent.futures.wait(
            [*done_futures(), held], timeout=0.05, return_when=ALL_COMPLETED
        )
        assert len(done) == 3 and not_done == {held}
    finally:
        gate.set()


def test_a_future_given_twice_comes_back_once():
    fut = aiopar.fork(int, "7")
    done, not_done = concurrent.futures.wait([fut, fut], timeout=LIMIT)
    assert done == {fut} and not not_done
    assert list(concurrent.futures.as_completed(iter([fut, fut, fut]))) == [fut]


def test_an_unknown_return_when_is_refused_as_the_standard_library_does():
    with pytest.raises(ValueError, match="Invalid return condition"):
        concurrent.futures.wait([Future()], timeout=0, return_when="SOMETIME")


def test_many_futures_settling_together_are_all_counted():
    # Many workers settle at once while wait() counts them (CPython's
    # issue 14406): none is missed, and wait() returns.
    start = threading.Event()
    pool = aiopar.get_backend("thread", max_workers=8)
    futs = {pool.fork(start.wait, LIMIT) for _ in range(100)}
    start.set()
    done, not_done = concurrent.futures.wait(futs, timeout=LIMIT)
    assert done == futs and not not_done


def test_as_completed_yields_the_done_ones_first_then_in_completion_order():
    first: Future[str] = Future()
    second: Future[str] = Future()
    done = done_futures()
    finished = concurrent.futures.as_completed([second, first, *done], timeout=LIMIT)
    assert {id(next(finished)) for _ in done} == set(map(id, done))
    threading.Thread(target=first.set_result, args=("first",)).start()
    assert next(finished) is first
    second.set_result("second")
    assert next(finished) is second
    assert list(finished) == []


def test_as_completed_keeps_no_reference_to_the_futures_it_yielded():
    import gc
    import weakref

    futs: list[Future[Any]] = [Future() for _ in range(4)] + done_futures()
    with pytest.raises(TimeoutError):
        for fut in concurrent.futures.as_completed(futs, timeout=0):
            futs.remove(fut)
            ref = weakref.ref(fut)
            del fut
            gc.collect()
            assert ref() is None
    futs[0].set_result("first")
    for fut in concurrent.futures.as_completed(futs):
        futs.remove(fut)
        ref = weakref.ref(fut)
        del fut
        gc.collect()
        assert ref() is None
        if futs:
            futs[0].set_result("next")
