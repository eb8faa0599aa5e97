"""PyTorch's ``test/test_futures.py`` (class ``TestFuture``), ported to aiopar.

Each torch test has a counterpart here under the same name, written with
``aiopar.Future``, ``aiopar.collect_all`` and ``aiopar.wait_all``, and numpy
arrays where torch uses tensors. Where aiopar differs from torch on purpose
(a ``then`` callback's exception keeps its own type instead of becoming a
RuntimeError, a future that cannot be pickled raises TypeError, ...), the test
asserts aiopar's behaviour; docs/then.md ("From torch.futures") lists every
difference. A few tests after torch's pin differences its tests do not reach
(collect_all and wait_all with a failure, a future settled in a callback),
and the last two port an earlier revision's tests of ``Future(unwrap_func)``.
No test here needs torch.
"""

from __future__ import annotations

import logging
import pathlib
import pickle
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aiopar
from aiopar import Future, InvalidStateError

# Threads below block on futures: a lost wake-up fails the test instead of hanging it.
pytestmark = pytest.mark.timeout(60)


def add_one(fut: Future[Any]) -> Any:
    return fut.wait() + 1


def ones() -> np.ndarray:
    return np.ones((2, 2))


def settle_once_waited_on(fut: Future[Any], settle: Callable[[], object]) -> threading.Thread:
    """Start a thread that calls ``settle()`` once some thread is blocked in
    ``fut.wait()``, so that a test covers waking a blocked waiter rather than
    reading a future that is done already. The thread's ``blocked_first``
    says whether it saw the waiter (it settles anyway after 20 s)."""

    def run() -> None:
        deadline = time.monotonic() + 20
        # Private, read only: the waiters a blocked wait() has registered.
        while not fut._waiters and time.monotonic() < deadline:
            time.sleep(0.001)
        thread.blocked_first = bool(fut._waiters)  # type: ignore[attr-defined]
        settle()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def join(thread: threading.Thread) -> None:
    thread.join(timeout=30)
    assert not thread.is_alive(), f"{thread.name} did not finish"


# -- settling and reading --------------------------------------------------


def test_set_exception() -> None:
    value_error = ValueError("Intentional Value Error")

    f: Future[Any] = Future()
    f.set_exception(value_error)
    with pytest.raises(ValueError, match="Intentional"):
        f.wait()

    f = Future()
    f.set_exception(value_error)
    with pytest.raises(ValueError, match="Intentional"):
        f.value()

    def cb(fut: Future[Any]) -> None:
        fut.value()

    f = Future()
    f.set_exception(value_error)
    cb_fut = f.then(cb)
    # torch: RuntimeError("Got the following error when running the callback:
    # ValueError: ..."); aiopar: the callback's exception itself.
    with pytest.raises(ValueError, match="Intentional") as raised:
        cb_fut.wait()
    assert raised.value is value_error


def test_set_exception_multithreading() -> None:
    value_error = ValueError("Intentional Value Error")
    outcomes: list[BaseException | None] = []

    def wait_future(f: Future[Any]) -> None:
        try:
            f.wait()
        except BaseException as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)

    f: Future[Any] = Future()
    t = threading.Thread(target=wait_future, args=(f,), daemon=True)
    t.start()
    setter = settle_once_waited_on(f, lambda: f.set_exception(value_error))
    join(t)
    join(setter)
    assert setter.blocked_first  # type: ignore[attr-defined]
    assert outcomes == [value_error]

    def cb(fut: Future[Any]) -> None:
        fut.value()

    chained: queue.Queue[Future[Any]] = queue.Queue()

    def then_future(f: Future[Any]) -> None:
        fut = f.then(cb)
        chained.put(fut)
        wait_future(fut)

    outcomes.clear()
    f = Future()
    t = threading.Thread(target=then_future, args=(f,), daemon=True)
    t.start()
    setter = settle_once_waited_on(chained.get(timeout=30), lambda: f.set_exception(value_error))
    join(t)
    join(setter)
    assert setter.blocked_first  # type: ignore[attr-defined]
    # torch: RuntimeError("Got the following error ..."); aiopar: the ValueError.
    assert outcomes == [value_error]


def test_done() -> None:
    f: Future[np.ndarray] = Future()
    assert not f.done()

    f.set_result(ones())
    assert f.done()


def test_done_exception() -> None:
    err_msg = "Intentional Value Error"

    def raise_exception(unused_future: Future[Any]) -> None:
        raise RuntimeError(err_msg)

    f1: Future[np.ndarray] = Future()
    assert not f1.done()
    f1.set_result(ones())
    assert f1.done()

    # then() on a done future runs the callback at once.
    f2 = f1.then(raise_exception)
    assert f2.done()
    with pytest.raises(RuntimeError, match=err_msg):
        f2.wait()


def test_wait() -> None:
    f: Future[np.ndarray] = Future()
    f.set_result(ones())

    np.testing.assert_array_equal(f.wait(), ones())


def test_wait_multi_thread() -> None:
    f: Future[np.ndarray] = Future()
    setter = settle_once_waited_on(f, lambda: f.set_result(ones()))

    np.testing.assert_array_equal(f.wait(), ones())
    join(setter)
    assert setter.blocked_first  # type: ignore[attr-defined]


def test_mark_future_twice() -> None:
    fut: Future[int] = Future()
    fut.set_result(1)
    # torch: RuntimeError "... a Future can only be marked completed once".
    # aiopar: InvalidStateError, which is a RuntimeError too.
    with pytest.raises(RuntimeError, match="settled only once") as raised:
        fut.set_result(1)
    assert isinstance(raised.value, InvalidStateError)
    with pytest.raises(InvalidStateError, match="settled only once"):
        fut.set_exception(ValueError("too late"))
    assert fut.wait() == 1  # the first settle stands


def test_pickle_future(tmp_path: pathlib.Path) -> None:
    fut: Future[int] = Future()
    # torch.save raises RuntimeError("Can not pickle torch.futures.Future");
    # aiopar raises TypeError, as Python does for any unpicklable object.
    with (
        open(tmp_path / "fut.pkl", "wb") as file,
        pytest.raises(TypeError, match=r"aiopar\.Future cannot be pickled") as raised,
    ):
        pickle.dump(fut, file)
    assert not isinstance(raised.value, RuntimeError)


# -- then ------------------------------------------------------------------


def test_then() -> None:
    fut: Future[np.ndarray] = Future()
    then_fut = fut.then(lambda x: x.wait() + 1)

    fut.set_result(ones())
    np.testing.assert_array_equal(fut.wait(), ones())
    np.testing.assert_array_equal(then_fut.wait(), ones() + 1)


def test_chained_then() -> None:
    fut: Future[np.ndarray] = Future()
    futs = []
    last_fut: Future[Any] = fut
    for _ in range(20):
        last_fut = last_fut.then(add_one)
        futs.append(last_fut)

    fut.set_result(ones())

    for i in range(len(futs)):
        np.testing.assert_array_equal(futs[i].wait(), ones() + i + 1)


def _test_then_error(
    cb: Callable[..., Any], error: type[BaseException], err_msg: str
) -> BaseException:
    """Assert that ``fut.then(cb)`` fails with exactly ``error`` (torch wraps
    every callback error in a RuntimeError) while ``fut`` keeps its value."""
    fut: Future[int] = Future()
    then_fut = fut.then(cb)

    fut.set_result(5)
    assert fut.wait() == 5
    with pytest.raises(error, match=err_msg) as raised:
        then_fut.wait()
    assert raised.type is error
    return raised.value


def test_then_wrong_arg() -> None:
    def wrong_arg(tensor: Any) -> Any:
        return tensor + 1

    _test_then_error(wrong_arg, TypeError, "unsupported operand type.*Future.*int")


def test_then_no_arg() -> None:
    def no_arg() -> bool:
        return True

    _test_then_error(no_arg, TypeError, "takes 0 positional arguments but 1 was given")


def test_then_raise() -> None:
    def raise_value_error(fut: Future[Any]) -> None:
        raise ValueError("Expected error")

    _test_then_error(raise_value_error, ValueError, "Expected error")


# -- add_done_callback -----------------------------------------------------


def test_add_done_callback_simple() -> None:
    callback_result = False

    def callback(fut: Future[Any]) -> None:
        nonlocal callback_result
        fut.wait()
        callback_result = True

    fut: Future[np.ndarray] = Future()
    fut.add_done_callback(callback)

    assert not callback_result
    fut.set_result(ones())
    np.testing.assert_array_equal(fut.wait(), ones())
    assert callback_result


def test_add_done_callback_maintains_callback_order() -> None:
    callback_result = 0

    def callback_set1(fut: Future[Any]) -> None:
        nonlocal callback_result
        fut.wait()
        callback_result = 1

    def callback_set2(fut: Future[Any]) -> None:
        nonlocal callback_result
        fut.wait()
        callback_result = 2

    fut: Future[np.ndarray] = Future()
    fut.add_done_callback(callback_set1)
    fut.add_done_callback(callback_set2)

    fut.set_result(ones())
    np.testing.assert_array_equal(fut.wait(), ones())
    # set2 called last, callback_result = 2
    assert callback_result == 2


def _test_add_done_callback_error_ignored(
    cb: Callable[..., Any], err_msg: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The callback's error neither reaches set_result's caller nor the
    future; it is logged on the ``aiopar`` logger (torch logs it from C++)."""
    fut: Future[int] = Future()
    fut.add_done_callback(cb)

    with caplog.at_level(logging.ERROR, logger="aiopar"):
        fut.set_result(5)
    assert fut.wait() == 5
    assert fut.exception() is None
    [record] = [r for r in caplog.records if r.name == "aiopar"]
    assert record.levelno == logging.ERROR
    assert "done-callback" in record.getMessage()
    assert record.exc_info is not None
    assert err_msg in str(record.exc_info[1])


def test_add_done_callback_error_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    def raise_value_error(fut: Future[Any]) -> None:
        raise ValueError("Expected error")

    _test_add_done_callback_error_ignored(raise_value_error, "Expected error", caplog)


def test_add_done_callback_no_arg_error_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    def no_arg() -> bool:
        return True

    _test_add_done_callback_error_ignored(
        no_arg, "takes 0 positional arguments but 1 was given", caplog
    )


def test_interleaving_then_and_add_done_callback_maintains_callback_order() -> None:
    callback_result = 0

    def callback_set1(fut: Future[Any]) -> None:
        nonlocal callback_result
        fut.wait()
        callback_result = 1

    def callback_set2(fut: Future[Any]) -> None:
        nonlocal callback_result
        fut.wait()
        callback_result = 2

    def callback_then(fut: Future[Any]) -> Any:
        return fut.wait() + callback_result

    fut: Future[np.ndarray] = Future()
    fut.add_done_callback(callback_set1)
    then_fut = fut.then(callback_then)
    fut.add_done_callback(callback_set2)

    fut.set_result(ones())
    np.testing.assert_array_equal(fut.wait(), ones())
    # then_fut's callback is called with callback_result = 1
    np.testing.assert_array_equal(then_fut.wait(), ones() + 1)
    # set2 called last, callback_result = 2
    assert callback_result == 2


def test_interleaving_then_and_add_done_callback_propagates_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def raise_value_error(fut: Future[Any]) -> None:
        raise ValueError("Expected error")

    fut: Future[np.ndarray] = Future()
    then_fut = fut.then(raise_value_error)
    fut.add_done_callback(raise_value_error)
    with caplog.at_level(logging.ERROR, logger="aiopar"):
        fut.set_result(ones())

    # error from add_done_callback's callback is logged, and goes nowhere else;
    # error from then's callback settles then_fut (a ValueError, not torch's RuntimeError)
    np.testing.assert_array_equal(fut.wait(), ones())
    with pytest.raises(ValueError, match="Expected error"):
        then_fut.wait()
    assert len([r for r in caplog.records if r.name == "aiopar"]) == 1


# -- collect_all and wait_all ----------------------------------------------


def test_collect_all() -> None:
    fut1: Future[int] = Future()
    fut2: Future[int] = Future()
    fut_all = aiopar.collect_all([fut1, fut2])

    setter = settle_once_waited_on(fut_all, lambda: fut1.set_result(1))
    fut2.set_result(2)

    res = fut_all.wait()
    assert res == [fut1, fut2] and res[0] is fut1 and res[1] is fut2
    assert res[0].wait() == 1
    assert res[1].wait() == 2
    join(setter)
    assert setter.blocked_first  # type: ignore[attr-defined]


def test_wait_all() -> None:
    fut1: Future[int] = Future()
    fut2: Future[int] = Future()

    # No error version
    fut1.set_result(1)
    fut2.set_result(2)
    res = aiopar.wait_all([fut1, fut2])
    assert res == [1, 2]

    # Version with an exception: torch raises RuntimeError("Got the following
    # error when running the callback: ValueError: ..."), aiopar the ValueError.
    def raise_in_fut(fut: Future[Any]) -> None:
        raise ValueError("Expected error")

    fut3 = fut1.then(raise_in_fut)
    mixed: list[Future[Any]] = [fut3, fut2]
    with pytest.raises(ValueError, match="Expected error"):
        aiopar.wait_all(mixed)


# -- where aiopar's collect_all and wait_all differ from torch's -------------


def test_collect_all_does_not_fail_when_a_future_fails() -> None:
    # torch's collected future fails with the first failure once all are
    # done; aiopar's never fails, and each future keeps its own outcome.
    fut1: Future[int] = Future()
    fut2: Future[int] = Future()
    fut_all = aiopar.collect_all([fut1, fut2])

    fut1.set_exception(ValueError("Expected error"))
    assert not fut_all.done()  # it still waits for fut2
    fut2.set_result(2)

    res = fut_all.wait()
    assert res[0] is fut1 and res[1] is fut2
    with pytest.raises(ValueError, match="Expected error"):
        res[0].wait()
    assert res[1].wait() == 2


def test_wait_all_raises_without_waiting_for_the_others() -> None:
    # torch's wait_all waits for every future before it raises (its
    # docstring says it exits early); aiopar's raises once one has failed.
    pending: Future[int] = Future()
    failed: Future[int] = Future()
    failed.set_exception(ValueError("Expected error"))
    with pytest.raises(ValueError, match="Expected error"):
        aiopar.wait_all([pending, failed])

    # The same when the failure comes while wait_all() is blocked, on the
    # failing future or on another one.
    for failing_last in (True, False):
        late: Future[int] = Future()
        futures = [pending, late] if failing_last else [late, pending]
        outcome: queue.Queue[BaseException | list[int]] = queue.Queue()

        def call_wait_all(
            futures: list[Future[int]], outcome: queue.Queue[BaseException | list[int]]
        ) -> None:
            try:
                outcome.put(aiopar.wait_all(futures))
            except BaseException as exc:
                outcome.put(exc)

        waiter = threading.Thread(target=call_wait_all, args=(futures, outcome), daemon=True)
        waiter.start()
        # Private, read only: the lock wait_all() blocks on, on one of them.
        deadline = time.monotonic() + 20
        while not (late._waiters or pending._waiters) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert late._waiters or pending._waiters, "wait_all() never blocked"
        late.set_exception(ValueError("late error"))
        error = outcome.get(timeout=30)
        join(waiter)
        assert isinstance(error, ValueError) and str(error) == "late error"
        assert not pending.done()


def test_callbacks_of_a_future_settled_in_a_callback_run_after_it() -> None:
    # torch runs b's callbacks inside b.set_result(), even in a callback of
    # a; aiopar queues them until a's callback returns, so that chains of any
    # length settle without recursion. wait() inside the callback runs them.
    a: Future[int] = Future()
    b: Future[int] = Future()
    chained = b.then(lambda f: f.wait() + 1)
    seen: list[object] = []

    def on_a(f: Future[int]) -> None:
        b.set_result(1)
        seen.append(chained.done())  # torch: True
        with pytest.raises(InvalidStateError):
            chained.value()  # torch: 2
        seen.append(chained.wait())
        seen.append(chained.done())

    a.add_done_callback(on_a)
    a.set_result(0)
    assert seen == [False, 2, True]


# -- an earlier revision of torch's file: Future(unwrap_func) ----------------
#
# torch's Future once took a function applied to the value at wait(); that
# argument is gone from torch, and aiopar's Future() takes none: then() is
# the way to transform a value.


def test_unwrap() -> None:
    set_by_unwrap = None

    def set_tensor(t: Future[Any]) -> None:
        nonlocal set_by_unwrap
        set_by_unwrap = t.wait()

    with pytest.raises(TypeError):
        Future(set_tensor)  # type: ignore[call-arg]

    f: Future[np.ndarray] = Future()
    unwrapped = f.then(set_tensor)
    f.set_result(ones())
    unwrapped.wait()

    np.testing.assert_array_equal(set_by_unwrap, ones())


def test_unwrap_throw_error() -> None:
    value_error = ValueError("Intentional Value Error")

    def processing(fut: Future[Any]) -> Any:
        fut_result = fut.wait()
        if isinstance(fut_result, ValueError):
            raise fut_result
        return fut_result

    f: Future[Any] = Future()
    f.set_result(value_error)  # an exception can be a plain value
    assert f.wait() is value_error
    with pytest.raises(ValueError, match="Intentional"):
        f.then(processing).wait()

    f = Future()
    f.set_result(value_error)
    processed = f.then(processing)
    with pytest.raises(ValueError, match="Intentional"):
        processed.value()
