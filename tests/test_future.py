"""The Future on its own: states, settling, waiting, callbacks and then()."""

from __future__ import annotations

import concurrent.futures
import logging
import pickle
import threading
import time
import traceback

import cloudpickle
import pytest
from helpers import eventually
from hypothesis import given
from hypothesis import strategies as st

import aiopar
from aiopar import CancelledError, Future, InvalidStateError


def test_set_result_then_value_and_wait():
    fut: Future[int] = Future()
    assert not fut.done() and not fut.cancelled()
    fut.set_result(3)
    assert fut.done()
    assert fut.value() == fut.wait() == fut.result() == 3
    assert fut.exception() is None


def test_second_settle_raises_invalid_state():
    fut: Future[int] = Future()
    fut.set_result(1)
    with pytest.raises(InvalidStateError, match="already done"):
        fut.set_result(2)
    with pytest.raises(InvalidStateError):
        fut.set_exception(ValueError())
    assert fut.value() == 1


def test_invalid_state_error_is_runtime_and_concurrent_futures_error():
    assert issubclass(InvalidStateError, RuntimeError)
    assert issubclass(InvalidStateError, concurrent.futures.InvalidStateError)
    assert issubclass(CancelledError, concurrent.futures.CancelledError)


def test_value_before_done_is_a_runtime_error():
    with pytest.raises(RuntimeError, match="not done"):
        Future().value()


def test_set_exception_reraises_with_type():
    fut: Future[int] = Future()
    fut.set_exception(KeyError("k"))
    with pytest.raises(KeyError):
        fut.wait()
    assert isinstance(fut.exception(), KeyError)


def test_set_exception_accepts_class_and_rejects_non_exceptions():
    fut: Future[int] = Future()
    fut.set_exception(ValueError)
    assert isinstance(fut.exception(), ValueError)
    with pytest.raises(TypeError, match="exception instance"):
        Future().set_exception("boom")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, -0.5, float("nan")])
def test_wait_rejects_bad_timeout(bad):
    fut: Future[int] = Future()
    with pytest.raises(ValueError, match="timeout"):
        fut.wait(timeout=bad)
    fut.set_result(1)
    with pytest.raises(ValueError, match="timeout"):
        fut.wait(timeout=bad)  # checked even when the answer is ready


def test_wait_timeout_raises_builtin_timeout_error():
    fut: Future[int] = Future()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="not done"):
        fut.wait(timeout=0.05)
    assert time.monotonic() - start >= 0.04
    fut.set_result(1)  # a timed-out waiter leaves no trace behind
    assert fut.wait(timeout=0) == 1


def test_wait_wakes_when_another_thread_settles():
    fut: Future[str] = Future()
    threading.Timer(0.05, fut.set_result, args=("late",)).start()
    assert fut.wait() == "late"


def test_cancel_pending_user_future():
    fut: Future[int] = Future()
    seen = []
    fut.add_done_callback(seen.append)
    assert fut.cancel()
    assert fut.cancelled() and fut.done()
    assert seen == [fut]
    assert fut.cancel()  # cancelling again is still true
    with pytest.raises(CancelledError):
        fut.wait()
    with pytest.raises(CancelledError):
        fut.exception()
    with pytest.raises(InvalidStateError):
        fut.set_result(1)


def test_cancel_finished_future_is_false():
    fut: Future[int] = Future()
    fut.set_result(1)
    assert not fut.cancel()
    assert not fut.cancelled()


def test_callbacks_run_once_in_order_and_at_once_when_done():
    fut: Future[int] = Future()
    order = []
    fut.add_done_callback(lambda f: order.append(("a", f.value())))
    fut.add_done_callback(lambda f: order.append(("b", f.value())))
    fut.set_result(7)
    fut.add_done_callback(lambda f: order.append(("c", f.value())))
    assert order == [("a", 7), ("b", 7), ("c", 7)]


def test_callback_exception_is_logged_not_raised(caplog):
    fut: Future[int] = Future()
    ran = []

    def bad(_):
        raise RuntimeError("callback bug")

    fut.add_done_callback(bad)
    fut.add_done_callback(ran.append)
    with caplog.at_level(logging.ERROR, logger="aiopar"):
        fut.set_result(1)
    assert ran == [fut]
    assert "callback bug" in caplog.text


def test_add_done_callback_rejects_non_callable():
    with pytest.raises(TypeError, match="callable"):
        Future().add_done_callback(3)  # type: ignore[arg-type]


def test_then_chains_values():
    fut: Future[int] = Future()
    chained = fut.then(lambda f: f.value() + 1).then(lambda f: f.value() * 10)
    fut.set_result(1)
    assert chained.wait() == 20


def test_then_on_done_future_runs_at_once():
    fut: Future[int] = Future()
    fut.set_result(2)
    chained = fut.then(lambda f: f.value() ** 2)
    assert chained.done() and chained.value() == 4


def test_then_callback_exception_fails_chained_future_only():
    fut: Future[int] = Future()
    failed = fut.then(lambda f: 1 / 0)
    after = failed.then(lambda f: "saw " + type(f.exception()).__name__)
    fut.set_result(1)  # must not raise in the settling thread
    assert fut.value() == 1
    with pytest.raises(ZeroDivisionError):
        failed.wait()
    assert after.wait() == "saw ZeroDivisionError"


def test_then_sees_source_failure():
    fut: Future[int] = Future()
    chained = fut.then(lambda f: f.value())
    fut.set_exception(ValueError("source"))
    with pytest.raises(ValueError, match="source"):
        chained.wait()


@pytest.mark.usefixtures("gc_off")  # a full collection walks every link: half the test's time
def test_million_link_then_chain_settles_without_recursion():
    links = 1_000_000
    calls = 0

    def step(f: Future[int]) -> int:
        nonlocal calls
        calls += 1
        return f.value() + 1

    root: Future[int] = Future()
    tail = root
    for _ in range(links):
        tail = tail.then(step)
    root.set_result(0)
    assert tail.wait() == links
    assert calls == links


def test_waiting_inside_a_callback_on_a_deferred_chain_does_not_deadlock():
    # The chain's callbacks are deferred while a callback runs; a wait inside
    # that callback must run them rather than block for ever.
    root: Future[int] = Future()
    other: Future[int] = Future()
    chained = other.then(lambda f: f.value() + 1)
    seen = []

    def on_root(_):
        other.set_result(1)
        seen.append(chained.wait(timeout=5))

    root.add_done_callback(on_root)
    root.set_result(0)
    assert seen == [2]


def test_racing_settles_and_callbacks_never_lose_a_callback():
    count = 100_000
    futures = [Future() for _ in range(count)]
    hits = [0] * count
    lock = threading.Lock()

    def make_callback(i):
        def callback(_):
            with lock:
                hits[i] += 1

        return callback

    def settle(start):
        for i in range(start, count, 2):
            futures[i].set_result(i)

    def register(start):
        for i in range(start, count, 2):
            if i % 4 < 2:
                futures[i].add_done_callback(make_callback(i))
            else:
                futures[i].then(make_callback(i))

    threads = [threading.Thread(target=f, args=(s,)) for f in (settle, register) for s in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert hits == [1] * count


def test_many_threads_wait_on_one_future():
    fut: Future[int] = Future()
    results = []
    threads = [threading.Thread(target=lambda: results.append(fut.wait())) for _ in range(16)]
    for t in threads:
        t.start()
    eventually(lambda: len(fut._waiters or ()) == 16)  # all of them block in wait
    fut.set_result(5)
    for t in threads:
        t.join(timeout=5)
    assert results == [5] * 16


def test_repr_names_state():
    fut: Future[int] = Future()
    assert "pending" in repr(fut)
    fut.set_exception(ValueError())
    assert "finished raised ValueError" in repr(fut)


def test_error_keeps_original_traceback_text():
    def deep_failure():
        raise LookupError("from the worker")

    fut = aiopar.fork(deep_failure)
    with pytest.raises(LookupError) as info:
        fut.wait()
    text = "".join(traceback.format_exception(info.value))
    assert "deep_failure" in text and "from the worker" in text


@given(st.lists(st.sampled_from(["result", "error", "cancel"]), min_size=1, max_size=8))
def test_only_the_first_settle_wins(actions):
    fut: Future[int] = Future()
    first = actions[0]
    for i, action in enumerate(actions):
        if action == "result":
            ok = _try(lambda i=i: fut.set_result(i))
        elif action == "error":
            ok = _try(lambda i=i: fut.set_exception(ValueError(i)))
        else:
            ok = fut.cancel()
        if i == 0:
            assert ok
    if first == "result":
        assert fut.value() == 0
    elif first == "error":
        assert isinstance(fut.exception(), ValueError)
    else:
        assert fut.cancelled()


def _try(fn) -> bool:
    try:
        fn()
    except InvalidStateError:
        return False
    return True


@pytest.mark.parametrize("dumps", [pickle.dumps, cloudpickle.dumps])
def test_a_future_cannot_be_pickled_and_says_what_to_send_instead(dumps):
    # It once failed on the future's lock: "cannot pickle '_thread.lock' object".
    with pytest.raises(TypeError, match=r"aiopar\.Future cannot be pickled; send its value"):
        dumps([1, aiopar.Future()])
