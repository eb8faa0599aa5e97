"""aiopar futures in each of concurrent.futures' states, for the tests of
what concurrent.futures code sees of them."""

from __future__ import annotations

from typing import Any

from aiopar import Future


def pending() -> Future[Any]:
    return Future()


def running() -> Future[Any]:
    fut: Future[Any] = Future()
    assert fut.set_running_or_notify_cancel()
    return fut


def cancelled() -> Future[Any]:
    fut: Future[Any] = Future()
    assert fut.cancel()
    return fut


def failed() -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_exception(OSError("failed on purpose"))
    fut.exception()  # read: not logged when collected
    return fut


def succeeded(value: Any = 42) -> Future[Any]:
    fut: Future[Any] = Future()
    fut.set_result(value)
    return fut


def done_futures() -> list[Future[Any]]:
    """One future of each way to be done: succeeded, failed, cancelled."""
    return [succeeded(), failed(), cancelled()]
