"""Done-callbacks in asyncio's spelling: add_done_callback, remove_done_callback
(the behaviours of the done-callback tests in CPython's test_asyncio/test_futures,
written against aiopar). Unlike an asyncio future's, an aiopar future's
callbacks run in the thread that settles it, not on a loop: see docs/async.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from helpers import run_python

from aiopar import Future

pytestmark = pytest.mark.timeout(60)


def appender(bag: list[Any], thing: Any) -> Callable[[Future[Any]], None]:
    def append(fut: Future[Any]) -> None:
        bag.append(thing)

    return append


@pytest.mark.parametrize(
    ("removed", "ran"),
    [([0, 0], [17, 100]), ([0, 1, 0], [100]), ([2, 2], [42, 17])],
    ids=["first", "first-and-second", "third"],
)
def test_a_removed_callback_never_runs_and_the_rest_run_in_order(removed, ran):
    bag: list[int] = []
    callbacks = [appender(bag, 42), appender(bag, 17), appender(bag, 100)]
    fut: Future[str] = Future()
    for callback in callbacks:
        fut.add_done_callback(callback)
    for index in removed:
        fut.remove_done_callback(callbacks[index])
    assert bag == []
    fut.set_result("foo")
    assert bag == ran and fut.result() == "foo"


@pytest.mark.parametrize("settle", ["result", "exception"])
def test_callbacks_run_in_the_order_they_were_added(settle):
    bag: list[int] = []
    fut: Future[str] = Future()
    fut.add_done_callback(appender(bag, 42))
    fut.add_done_callback(appender(bag, 17))
    error = RuntimeError()
    if settle == "result":
        fut.set_result("foo")
    else:
        fut.set_exception(error)
    assert bag == [42, 17]
    assert fut.exception() is (None if settle == "result" else error)


def test_remove_done_callback_says_how_many_equal_callbacks_it_removed():
    bag: list[int] = []
    one, two, three = appender(bag, 1), appender(bag, 2), appender(bag, 3)
    fut: Future[str] = Future()
    fut.add_done_callback(one)
    fut.add_done_callback(two)
    assert fut.remove_done_callback(two) == 1
    assert fut.remove_done_callback(three) == 0
    fut.add_done_callback(two)
    for _ in range(5):
        fut.add_done_callback(one)
    assert fut.remove_done_callback(one) == 6
    fut.set_result("foo")
    assert bag == [2]
    assert fut.remove_done_callback(two) == 0  # it has run


def test_a_callback_that_removes_others_as_callbacks_run_stops_none_of_them():
    bag: list[str] = []
    later = appender(bag, "later")
    fut: Future[int] = Future()
    fut.add_done_callback(lambda f: f.remove_done_callback(later))
    fut.add_done_callback(later)
    fut.add_done_callback(later)
    fut.set_result(1)
    assert bag == ["later", "later"]


def test_an_equality_that_calls_back_into_the_future_neither_deadlocks_nor_breaks_it():
    # bpo-28963, gh-97592, bpo-30828: remove_done_callback compares each
    # callback with __eq__, which may remove or add callbacks of the same
    # future. A deadlock would hang: the child's timeout catches it.
    done = run_python(
        """
        from aiopar import Future

        def make():
            ran = []
            fut = Future()
            fut.add_done_callback(lambda f: ran.append("first"))
            for _ in range(63):
                fut.add_done_callback(id)
            return fut, ran

        fut, ran = make()
        class RemovesOthers:
            def __eq__(self, other):
                fut.remove_done_callback(id)
                return False
        assert fut.remove_done_callback(RemovesOthers()) == 0
        fut.set_result(1)
        assert ran == ["first"], ran

        fut, ran = make()
        class RemovesWhatItIsComparedWith:
            def __eq__(self, other):
                fut.remove_done_callback(other)
        assert fut.remove_done_callback(RemovesWhatItIsComparedWith()) == 0
        fut.set_result(1)
        assert ran == [], ran

        fut, ran = make()
        class AddsMore:
            def __eq__(self, other):
                fut.add_done_callback(id)
                return False
        assert fut.remove_done_callback(AddsMore()) == 0
        assert fut.remove_done_callback(id) >= 63
        fut.set_result(1)
        assert ran == ["first"], ran
        print("ok")
        """,
        timeout=30,
    )
    assert done.returncode == 0 and done.stdout == "ok\n", done.stderr
