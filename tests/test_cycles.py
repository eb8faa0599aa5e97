"""A failed future and its exception go as soon as the last reference to the
future does: no frame of aiopar's in the exception's traceback holds the
future or the exception, so no reference cycle waits for the garbage
collector (CPython's concurrent.futures breaks the same cycles:
bpo-35930, gh-95169). The exception's frames hold the failing call's
locals, arrays and shared memory among them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import threading
import time
import types
import weakref
from collections.abc import Callable
from typing import Any

import pytest

import aiopar

pytestmark = pytest.mark.usefixtures("gc_off")


class Payload:
    """What the failing call holds in its frame: the exception's traceback keeps it."""


class Failure(ValueError):
    """A failure that a weak reference can follow (a built-in exception cannot)."""


def fail(_: object = None) -> None:
    payload = Payload()  # noqa: F841  (a local of the failed call's frame)
    raise Failure("on purpose")


def failure() -> Failure:
    try:
        fail()
    except Failure as exc:
        return exc
    raise AssertionError("fail() returned")


def failed_future() -> aiopar.Future[None]:
    return _settled_with(failure())  # (this frame holds no future while failure() runs)


def _settled_with(exception: BaseException) -> aiopar.Future[None]:
    fut: aiopar.Future[None] = aiopar.Future()
    fut.set_exception(exception)
    return fut


def caught(wait: Callable[[], object]) -> None:
    """Run ``wait`` and swallow what it raises, as a user's code does."""
    try:
        wait()
    except (ValueError, aiopar.CancelledError):
        pass
    finally:
        del wait


def assert_gone_with_its_future(make: Callable[[], aiopar.Future[Any]], use: Callable) -> None:
    """``use(box)`` takes the failed future out of ``box`` and uses it: no
    frame of the test's own holds the future then, so only aiopar's frames
    could make a cycle (a frame in the traceback holds its callers' frames)."""
    box = [make()]
    exception = box[0].exception(timeout=30)  # with a timeout: no waiter runs the task
    assert exception is not None
    gone = [weakref.ref(obj) for obj in (box[0], exception, *_payload_of(exception))]
    del exception
    use(box)
    assert not box, "use() must take the future"
    assert _all_gone(gone), _holders(gone[0]())


def _all_gone(refs: list[weakref.ref[Any]], timeout: float = 5.0) -> bool:
    """Whether every referent goes within ``timeout`` seconds (the thread
    that settled a future may still be on its way out of its frames). With
    the garbage collector off, what a cycle holds never goes."""
    deadline = time.monotonic() + timeout
    while any(ref() is not None for ref in refs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def _holders(fut: aiopar.Future[Any] | None) -> list[str]:
    """The frames that hold the future still, for the failure's message."""
    if fut is None:
        return []
    return [
        f"{holder.f_code.co_name} ({holder.f_code.co_filename}:{holder.f_lineno})"
        for holder in gc.get_referrers(fut)
        if isinstance(holder, types.FrameType)
    ]


def _payload_of(exception: BaseException) -> list[Payload]:
    """The failing call's payload, if its frame is in the traceback (it is
    not when the call failed in another process)."""
    tb = exception.__traceback__
    while tb is not None:
        if "payload" in tb.tb_frame.f_locals:
            return [tb.tb_frame.f_locals["payload"]]
        tb = tb.tb_next
    return []


async def _await(box: list[aiopar.Future[Any]]) -> None:
    # Caught inside: one that left the coroutine would stay in asyncio's
    # task, a cycle of asyncio's own.
    with contextlib.suppress(ValueError):
        await box.pop()


USES: dict[str, Callable[[list[aiopar.Future[Any]]], None]] = {
    "wait": lambda box: caught(box.pop().wait),
    "wait(timeout)": lambda box: caught(functools.partial(box.pop().wait, 10)),
    "value": lambda box: caught(box.pop().value),
    "result": lambda box: caught(box.pop().result),
    "exception": lambda box: box.pop().exception(),
    "await": lambda box: asyncio.run(_await(box)),
    "wait_all": lambda box: caught(functools.partial(aiopar.wait_all, [box.pop()])),
    "collect_all": lambda box: aiopar.collect_all([box.pop()]).wait(),
    "nothing": lambda box: box.pop(),
}


@pytest.mark.parametrize("use", list(USES))
def test_a_failed_future_leaves_no_cycle(use):
    assert_gone_with_its_future(failed_future, USES[use])


@pytest.mark.parametrize("backend", ["thread", "process"])
@pytest.mark.parametrize("use", ["wait", "exception", "await", "nothing"])
def test_a_failed_fork_leaves_no_cycle(backend, use):
    with aiopar.use_backend(backend):
        assert_gone_with_its_future(lambda: aiopar.fork(fail), USES[use])


async def fail_async() -> None:
    fail()


@pytest.mark.parametrize("use", ["wait", "exception", "nothing"])
def test_a_failed_coroutine_fork_leaves_no_cycle(use):
    assert_gone_with_its_future(lambda: aiopar.fork(fail_async), USES[use])


def done_future() -> aiopar.Future[int]:
    fut: aiopar.Future[int] = aiopar.Future()
    fut.set_result(1)
    return fut


def then_fail_settled_in_a_pool_thread() -> aiopar.Future[None]:
    """then(fail) on a future that a pool's thread settles after, so it runs fail()."""
    fut: aiopar.Future[int] = aiopar.Future()
    chained = fut.then(fail)
    aiopar.fork(fut.set_result, 1)
    return chained


@pytest.mark.parametrize(
    "then_fail",
    [then_fail_settled_in_a_pool_thread, lambda: done_future().then(fail)],
    ids=["pending", "done"],  # "done": then() runs fail() at once
)
def test_a_failed_then_callback_leaves_no_cycle(then_fail):
    assert_gone_with_its_future(then_fail, USES["wait"])


@pytest.mark.parametrize("use", ["wait", "wait_all"])
def test_a_task_that_fails_in_its_waiters_thread_leaves_no_cycle(use):
    # The pool's one worker is busy: the waiter runs the task itself.
    release = threading.Event()
    with aiopar.use_backend("thread", max_workers=1):
        busy = aiopar.fork(release.wait)
        box = [aiopar.fork(fail)]
        assert not box[0].done()
        gone = weakref.ref(box[0])
        USES[use](box)
        release.set()
        busy.wait()
    assert _all_gone([gone]), _holders(gone())


@pytest.mark.parametrize("use", ["wait", "exception", "nothing"])
def test_a_failed_item_of_map_leaves_no_cycle(use):
    def failed_item() -> aiopar.Future[None]:
        first, _ = aiopar.get_backend("thread").map(fail, [None, None], chunksize=2)
        return first

    assert_gone_with_its_future(failed_item, USES[use])
