"""A failure whose awaiter gave up is no error; one nobody ever read still is.

A request abandoned by ``asyncio.wait_for``, a cancelled task or a cancel
scope, whose forked call then fails, leaves a DEBUG record at most, as
``asyncio.to_thread`` and ``run_in_executor`` say nothing; a failure that
nobody awaited or waited on is logged as an error when its future goes.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import weakref

import anyio
import pytest
from helpers import eventually, run_python

import aiopar

pytestmark = pytest.mark.timeout(60)

UNREAD = "nobody retrieved"


class Failing:
    """A task that fails with ``message`` once released, and the events
    that tell when it has started and when its future is done."""

    def __init__(self, message: str) -> None:
        self.message = message
        self.started = threading.Event()
        self.release = threading.Event()
        self.settled = threading.Event()

    def __call__(self) -> None:
        self.started.set()
        self.release.wait(30)
        raise ValueError(self.message)

    def fork(self) -> aiopar.Future[None]:
        fut = aiopar.fork(self)
        fut.add_done_callback(lambda _: self.settled.set())  # reads nothing
        self.ref = weakref.ref(fut)
        return fut

    async def running(self) -> None:
        await anyio.to_thread.run_sync(self.started.wait, 30)

    def fail_and_collect(self) -> None:
        """Let the task fail, then collect its future (the caller dropped it)."""
        self.release.set()
        assert self.settled.wait(30)
        # The worker that settled it lets go of it as it returns.
        eventually(lambda: gc.collect() is not None and self.ref() is None)


def unread_records(caplog: pytest.LogCaptureFixture, message: str) -> list[logging.LogRecord]:
    """The records of unread failures whose exception says ``message``."""
    return [
        r
        for r in caplog.records
        if UNREAD in r.getMessage() and r.exc_info and message in str(r.exc_info[1])
    ]


def unread_record(caplog: pytest.LogCaptureFixture, message: str) -> logging.LogRecord:
    """The one record of the unread failure that says ``message``. The thread
    that let go of its future last logs it, maybe just after the test saw
    the future go."""
    eventually(lambda: unread_records(caplog, message))
    [record] = unread_records(caplog, message)
    return record


def run(anyio_backend: tuple[str, dict[str, object]], fn, *args) -> None:
    """``fn(*args)`` on the backend the ``anyio_backend`` fixture names, to
    its end: the loop lets go of the awaits it cancelled."""
    name, options = anyio_backend
    anyio.run(fn, *args, backend=name, backend_options=options)


def test_a_failure_whose_awaiter_a_cancel_scope_cancelled_is_logged_at_debug_only(
    anyio_backend, caplog
):
    failing = Failing("cancel scope")

    async def abandon() -> None:
        fut = failing.fork()
        await failing.running()
        with anyio.move_on_after(0.05) as scope:
            await fut
        assert scope.cancelled_caught and not fut.done()

    with caplog.at_level(logging.DEBUG, logger="aiopar"):
        run(anyio_backend, abandon)
        failing.fail_and_collect()
    record = unread_record(caplog, "cancel scope")
    assert record.levelno == logging.DEBUG
    assert "gave up" in record.getMessage()


@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
def test_a_failure_whose_asyncio_awaiter_timed_out_or_was_cancelled_is_no_error(
    anyio_backend, caplog
):
    by_wait_for, by_cancel = Failing("wait_for"), Failing("cancelled task")

    async def abandon() -> None:
        fut = by_wait_for.fork()
        await by_wait_for.running()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(fut, 0.05)

        started = asyncio.Event()

        async def await_it(fut: aiopar.Future[None]) -> None:
            started.set()
            await fut

        other = by_cancel.fork()
        await by_cancel.running()
        awaiting = asyncio.ensure_future(await_it(other))
        await started.wait()
        awaiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await awaiting

    with caplog.at_level(logging.DEBUG, logger="aiopar"):
        run(anyio_backend, abandon)
        by_wait_for.fail_and_collect()
        by_cancel.fail_and_collect()
    records = [unread_record(caplog, "wait_for"), unread_record(caplog, "cancelled task")]
    assert [r.levelno for r in records] == [logging.DEBUG, logging.DEBUG]


@pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)
def test_a_failure_of_a_cancelled_run_in_executor_call_is_no_error(anyio_backend, caplog):
    # asyncio cancels the executor's future when the one it awaits is cancelled
    failing = Failing("run_in_executor")

    async def abandon(executor: aiopar.Executor) -> None:
        call = asyncio.get_running_loop().run_in_executor(executor, failing)
        [fut] = executor._futures
        fut.add_done_callback(lambda _: failing.settled.set())
        failing.ref = weakref.ref(fut)
        del fut
        await failing.running()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(call, 0.05)

    with caplog.at_level(logging.DEBUG, logger="aiopar"), aiopar.Executor() as executor:
        run(anyio_backend, abandon, executor)
        failing.fail_and_collect()
    record = unread_record(caplog, "run_in_executor")
    assert record.levelno == logging.DEBUG


def test_a_failure_an_awaiter_read_after_another_was_cancelled_is_not_logged(anyio_backend, caplog):
    failing = Failing("read after all")

    async def abandon_then_read() -> None:
        fut = failing.fork()
        await failing.running()
        with anyio.move_on_after(0.05):
            await fut
        failing.release.set()
        with pytest.raises(ValueError, match="read after all"):
            await fut  # a second await reads it: nothing to report

    with caplog.at_level(logging.DEBUG, logger="aiopar"):
        run(anyio_backend, abandon_then_read)
        failing.fail_and_collect()
    assert not unread_records(caplog, "read after all")


def test_a_failure_nobody_awaited_or_waited_on_is_still_an_error(caplog):
    failing = Failing("never awaited")
    with caplog.at_level(logging.DEBUG, logger="aiopar"):
        fut = failing.fork()
        del fut
        failing.fail_and_collect()
    record = unread_record(caplog, "never awaited")
    assert record.levelno == logging.ERROR
    assert "gave up" not in record.getMessage()


def test_a_cancel_too_late_abandons_the_future_and_a_succeeding_one_keeps_no_report(caplog):
    failing = Failing("cancelled too late")
    with caplog.at_level(logging.DEBUG, logger="aiopar"):
        fut = failing.fork()
        assert failing.started.wait(30)
        assert not fut.cancel()  # running: not interrupted
        del fut
        failing.fail_and_collect()
        ok = aiopar.fork(int, "1")
        assert ok.wait() == 1 and not ok.cancel() and ok._unretrieved is None
    record = unread_record(caplog, "cancelled too late")
    assert record.levelno == logging.DEBUG


CTRL_C_ENDS_A_WAIT = """
import gc, logging, os, signal, sys, threading, weakref
from helpers import eventually
import aiopar

logging.basicConfig(level=logging.DEBUG, format="%(levelname)s %(message)s", stream=sys.stdout)
started, release, done = threading.Event(), threading.Event(), threading.Event()

def fail():
    started.set()
    release.wait(30)
    raise ValueError("interrupted wait")

fut = aiopar.fork(fail)
fut.add_done_callback(lambda _: done.set())
assert started.wait(30)  # on a worker: the wait below blocks

def interrupt():
    eventually(lambda: fut._waiters)  # the main thread blocks in wait()
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt).start()
try:
    fut.wait()
except KeyboardInterrupt:
    print("interrupted", flush=True)
gone = weakref.ref(fut)
del fut
release.set()
assert done.wait(30)
eventually(lambda: gc.collect() is not None and gone() is None)
logging.shutdown()
"""


def test_a_failure_whose_wait_ctrl_c_ended_is_logged_at_debug_only():
    from pathlib import Path

    tests = str(Path(__file__).resolve().parent)
    done = run_python(f"import sys; sys.path.insert(0, {tests!r})\n" + CTRL_C_ENDS_A_WAIT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "interrupted" in lines
    assert any(line.startswith("DEBUG") and UNREAD in line for line in lines), done.stdout
    assert not any(line.startswith("ERROR") for line in lines), done.stdout
