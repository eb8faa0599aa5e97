"""aiopar.drain(): what is queued runs before an application stops, even one
that a signal's default action ends, where no exit hook runs.

Every drain runs in a child process: it waits for every live backend, and
so for whatever another test may have left running."""

from __future__ import annotations

import fractions
import signal
import textwrap
import threading
from collections.abc import Callable

import pytest
from helpers import run_python

import aiopar

pytestmark = pytest.mark.timeout(120)

# Forks that are still queued when the drain starts: a one-worker pool's
# worker waits at a gate, and each task forks a child on the default pool
# (what those tasks fork runs too). Each task and child prints a line.
QUEUED = """
import os, signal, sys, threading, time
import aiopar

gate = threading.Event()
pool = aiopar.get_backend("thread", max_workers=1)

def say(what):
    os.write(1, f"ran {what}\\n".encode())

def task(n):
    time.sleep(0.002)
    aiopar.fork(say, f"child {n}")  # fire and forget, on another backend
    say(f"task {n}")

pool.fork(gate.wait, 30)
for n in range(20):
    pool.fork(task, n)
"""


def ran(stdout: str) -> set[str]:
    return {line for line in stdout.splitlines() if line.startswith("ran ")}


EVERYTHING = {f"ran task {n}" for n in range(20)} | {f"ran child {n}" for n in range(20)}


def run_child(code: str, *args: str) -> str:
    done = run_python(QUEUED + textwrap.dedent(code), *args, timeout=90)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_drain_in_a_script_waits_for_what_was_queued_and_what_it_forked():
    out = run_child(
        """
        drained = aiopar.drain()
        assert isinstance(drained, aiopar.Future) and not drained.done()  # the gate holds it
        gate.set()
        assert drained.wait(timeout=60) is None
        print("drained", flush=True)
        os._exit(0)  # no exit hook: only the drain ran them
        """
    )
    assert ran(out) == EVERYTHING
    assert out.splitlines()[-1] == "drained"


@pytest.mark.parametrize("backend", ["asyncio", "uvloop", "trio"])
def test_await_drain_suspends_only_the_awaiting_coroutine(backend):
    out = run_child(
        """
        import anyio

        async def main():
            drained = aiopar.drain()
            for _ in range(10):
                await anyio.sleep(0)  # the loop runs on while the drain waits
            assert not drained.done()
            gate.set()  # from the loop's own thread
            with anyio.fail_after(60):
                assert await drained is None
            print("drained", flush=True)

        name = sys.argv[1]
        options = {"use_uvloop": True} if name == "uvloop" else {}
        anyio.run(main, backend=name.replace("uvloop", "asyncio"), backend_options=options)
        os._exit(0)
        """,
        backend,
    )
    assert ran(out) == EVERYTHING
    assert out.splitlines()[-1] == "drained"


# uvicorn's way out: once its graceful shutdown (the lifespan's end) is
# done, it raises SIGTERM again with the default action, which ends the
# process without any exit hook.
SIGTERM_AFTER_SHUTDOWN = """
import asyncio, contextlib

@contextlib.asynccontextmanager
async def lifespan():
    yield
    {shutdown}

async def serve():
    async with lifespan():
        gate.set()  # requests forked their work and were answered

asyncio.run(serve())
print("stopping", flush=True)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
os.kill(os.getpid(), signal.SIGTERM)
"""


def test_work_queued_when_a_signal_stops_the_app_runs_if_its_shutdown_drains():
    done = run_python(
        QUEUED + SIGTERM_AFTER_SHUTDOWN.format(shutdown="await aiopar.drain()"), timeout=90
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert ran(done.stdout) == EVERYTHING
    assert done.stdout.splitlines()[-1] == "stopping"


def test_without_the_drain_a_signal_loses_the_queued_work():
    # What the test above guards against: no exit hook runs.
    done = run_python(QUEUED + SIGTERM_AFTER_SHUTDOWN.format(shutdown="pass"), timeout=90)
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert len(ran(done.stdout)) < len(EVERYTHING)


def test_drain_waits_for_the_process_backend():
    out = run_child(
        """
        procs = aiopar.get_backend("process", max_workers=1)
        futs = [procs.fork(time.sleep, 0.2) for _ in range(3)]
        gate.set()
        aiopar.drain().wait(timeout=60)
        print(sum(f.done() for f in futs), flush=True)
        """
    )
    assert out.splitlines()[-1] == "3"


def test_drain_waits_for_process_results_unpickled_aside_and_what_their_callbacks_fork():
    # A Fraction's pickle names its class, so an unpickler thread, not the
    # manager, loads it and runs the callback, which forks on the default pool.
    out = run_child(
        """
        from fractions import Fraction
        procs = aiopar.get_backend("process", max_workers=2)
        for n in range(6):
            fut = procs.fork(Fraction, n, 7)
            fut.add_done_callback(lambda f: aiopar.fork(say, f"result {f.result()}"))
        gate.set()
        aiopar.drain().wait(timeout=60)
        print("drained", flush=True)
        os._exit(0)  # no exit hook: only the drain ran them
        """
    )
    assert ran(out) == EVERYTHING | {f"ran result {n}/7" if n else "ran result 0" for n in range(6)}
    assert out.splitlines()[-1] == "drained"


# -- where it cannot run ---------------------------------------------------------


def on_a_worker(fn: Callable[[], object]) -> aiopar.Future[object]:
    """The future of ``fn()``, run by a pool's worker (not by whoever waits)."""
    started, go = threading.Event(), threading.Event()

    def then_fn() -> object:
        started.set()
        go.wait(30)
        return fn()

    fut = aiopar.fork(then_fn)
    assert started.wait(30)
    go.set()
    return fut


def test_drain_in_a_pool_task_or_its_callback_raises_at_once():
    with pytest.raises(RuntimeError, match=r"aiopar\.drain\(\) was called in .*would never end"):
        on_a_worker(aiopar.drain).wait(timeout=30)

    opened: aiopar.Future[None] = aiopar.Future()
    raised = opened.then(lambda _: aiopar.drain())  # runs in the thread that settles it
    on_a_worker(lambda: opened.set_result(None)).wait(timeout=30)
    with pytest.raises(RuntimeError, match="a thread that runs aiopar tasks"):
        raised.wait(timeout=30)


def test_drain_in_a_process_future_s_callback_raises_at_once():
    # A Fraction's pickle names its class, so an unpickler thread loads it
    # and runs the callback: there the drain waited for itself.
    procs = aiopar.get_backend("process", max_workers=1)
    for value in (3, fractions.Fraction(1, 3)):  # settled by the manager, by an unpickler
        raised = procs.fork(abs, value).then(lambda _: aiopar.drain())
        with pytest.raises(RuntimeError, match="a thread that runs aiopar tasks"):
            raised.wait(timeout=30)


def test_drain_in_a_coroutine_on_aiopar_s_own_loop_or_a_loop_in_a_task_raises():
    async def drain_here() -> None:
        await aiopar.drain()

    def loop_in_a_task() -> None:
        import asyncio

        asyncio.run(drain_here())

    for fut in (aiopar.fork(drain_here), on_a_worker(loop_in_a_task)):
        with pytest.raises(RuntimeError, match="outside any forked task"):
            fut.wait(timeout=30)
