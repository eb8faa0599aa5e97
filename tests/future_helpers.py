"""aiopar futures in each of concurrent.futures' states, for the tests of
what concurrent.futures code sees of them, and a fork that a wait on it
always finds running."""

from __future__ import annotations

import threading
import time
from typing import Any

from helpers import eventually

import aiopar
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


def fork_running_until_waited_on(then_sleep: float = 0.0) -> Future[None]:
    """Fork a task and return its future once a worker has started it; the
    task lasts until a thread waits on the future, and ``then_sleep``
    seconds more. A wait on it always blocks, however late it comes.

    A waiter puts its waiter in ``_waiters`` before it blocks (the name
    ``concurrent.futures.wait`` uses too)."""
    started = threading.Event()
    forked: list[Future[None]] = []

    def lasts_until_waited_on() -> None:
        started.set()
        eventually(lambda: forked and forked[0]._waiters, timeout=10)
        forked.clear()
        time.sleep(then_sleep)

    fut = aiopar.fork(lasts_until_waited_on)
    forked.append(fut)
    assert started.wait(10), "no worker started the fork"
    return fut
