"""Blocking calls never starve the pool: a worker blocked outside aiopar (a
sleep, a socket, a lock) is compensated as one blocked in ``wait`` is, and
one that computes is not. Each program runs in a child process with a
timeout: without compensation it would hang (its barrier never fills)."""

from __future__ import annotations

import pytest
from helpers import run_python

from aiopar.backends import _stall

pytestmark = pytest.mark.skipif(
    not _stall.SUPPORTED, reason="this system has no per-thread CPU clocks"
)


def runs_ok(program: str, *args: str, timeout: float) -> None:
    """Run ``program`` in a fresh interpreter: it must exit 0 having printed "ok"."""
    done = run_python(program, *args, timeout=timeout)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout


# Twenty calls that each block until all twenty have started: a pool of two
# workers gets through them only if it adds workers for the blocked ones.
BARRIER = """
import sys, threading, time, aiopar
from aiopar.backends.thread import COMPENSATION_LIMIT

kind = sys.argv[1]
n = 20
barrier = threading.Barrier(n, timeout=30)
peak = 0

def counted() -> None:
    global peak
    peak = max(peak, sum(t.name.startswith("aiopar-thread-") for t in threading.enumerate()))

def on_barrier(i):
    counted()
    barrier.wait()
    return i

def on_socket(i):
    import socket
    counted()
    a, b = socket.socketpair()
    with a, b:
        a.settimeout(30)
        barrier.wait()  # everyone is in: now a blocking read, answered at once
        b.send(b"x")
        return i if a.recv(1) == b"x" else -1

def on_sleep(i):
    counted()
    time.sleep(0.2)
    barrier.wait()
    return i

fn = {"lock": on_barrier, "socket": on_socket, "sleep": on_sleep}[kind]
pool = aiopar.get_backend("thread", max_workers=2)
futures = [pool.fork(fn, i) for i in range(n)]
assert [f.wait(timeout=40) for f in futures] == list(range(n))
assert peak <= 2 + COMPENSATION_LIMIT, peak
pool.shutdown()
print("ok", peak)
"""


@pytest.mark.parametrize("kind", ["lock", "sleep", "socket"])
def test_calls_blocked_outside_aiopar_get_workers_of_their_own(kind):
    runs_ok(BARRIER, kind, timeout=60)


ASYNC_SLEEPS = """
import asyncio, threading, time, aiopar

async def main():
    # 100 concurrent blocking calls, the way an async app offloads them: all
    # of them must overlap, which two workers could not do.
    inside = threading.Semaphore(0)
    everyone = threading.Event()
    count = [0]
    lock = threading.Lock()

    def call():
        with lock:
            count[0] += 1
            if count[0] == 60:
                everyone.set()
        return everyone.wait(30)

    results = await asyncio.gather(*(aiopar.fork(call) for _ in range(60)))
    assert all(results), results.count(False)

asyncio.run(main())
print("ok")
"""


def test_awaited_blocking_calls_all_overlap():
    runs_ok(ASYNC_SLEEPS, timeout=60)


# A CPU-bound batch (pure Python, which holds the GIL, and numpy, which
# releases it) never runs on more workers than the pool's size.
CPU_BATCH = """
import sys, threading, aiopar
import numpy as np

kind = sys.argv[1]
running = 0
peak = 0
lock = threading.Lock()

def python_work():
    total = 0
    for i in range(400_000):
        total += i * i
    return total

a = np.ones((200, 200), dtype=np.float32)
def numpy_work():
    for _ in range(40):
        a @ a
    return 1

def task(work):
    # The pool's workers only: a thread that waits may run a task itself.
    global running, peak
    worker = threading.current_thread().name.startswith("aiopar-thread-")
    with lock:
        running += worker
        peak = max(peak, running)
    try:
        return work()
    finally:
        with lock:
            running -= worker

work = python_work if kind == "python" else numpy_work
pool = aiopar.get_backend("thread", max_workers=2)
futures = [pool.fork(task, work) for _ in range(24)]
[f.wait(timeout=60) for f in futures]
pool.shutdown()
assert peak <= 2, peak
print("ok", peak)
"""


@pytest.mark.parametrize("kind", ["python", "numpy"])
def test_a_cpu_bound_batch_runs_on_no_more_workers_than_the_pool_has(kind):
    runs_ok(CPU_BATCH, kind, timeout=90)


LEARNED = """
import threading, time, aiopar
from aiopar.backends import _stall

pool = aiopar.get_backend("thread", max_workers=1)
first = pool.fork(time.sleep, 0.3)
deadline = time.monotonic() + 20
while not _stall.presumed(time.sleep):
    assert time.monotonic() < deadline, "the watcher never found the sleep blocked"
    time.sleep(0.005)
first.wait(timeout=20)
# From now on the watcher judges nobody: only what it learned counts.
_stall.QUICK_WINDOW = _stall.LOCK_WINDOW = float("inf")
# time.sleep blocked before, so its next call is counted out as it starts:
# the pool's one slot stays free, and a task forked after it runs before
# the sleep ends.
second = pool.fork(time.sleep, 2)
third = pool.fork(lambda: "ran")
assert third.wait(timeout=10) == "ran"
assert not second.done()
second.wait(timeout=10)
pool.shutdown()
print("ok")
"""


def test_a_function_that_blocked_is_counted_out_from_its_next_start():
    runs_ok(LEARNED, timeout=60)


IDLE_RETIRE = """
import threading, time, aiopar

pool = aiopar.get_backend("thread", max_workers=2)
pool.idle_retire = 0.2
n = 12
barrier = threading.Barrier(n, timeout=30)
[f.wait(timeout=40) for f in [pool.fork(barrier.wait) for _ in range(n)]]
def workers():
    return sum(t.name.startswith("aiopar-thread-") for t in threading.enumerate())
deadline = time.monotonic() + 20
while workers() > 2:
    assert time.monotonic() < deadline, workers()
    time.sleep(0.01)
# the pool still works, and grows again for blocked calls
barrier = threading.Barrier(n, timeout=30)
[f.wait(timeout=40) for f in [pool.fork(barrier.wait) for _ in range(n)]]
pool.shutdown()
print("ok")
"""


def test_the_extra_workers_retire_once_idle():
    runs_ok(IDLE_RETIRE, timeout=60)


SHUTDOWN = """
import threading, time, aiopar

pool = aiopar.get_backend("thread", max_workers=1)
pool.fork(time.sleep, 0.05).wait(timeout=10)
watchers = [t for t in threading.enumerate() if t.name.startswith("aiopar-watcher-")]
assert len(watchers) == 1, watchers
pool.shutdown(wait=True)
assert not watchers[0].is_alive()
print("ok")
"""


def test_the_watcher_stops_with_its_pool():
    runs_ok(SHUTDOWN, timeout=60)


INITIALIZER = """
import threading, aiopar
from concurrent.futures.thread import BrokenThreadPool

seen = []
pool = aiopar.get_backend("thread", max_workers=2, thread_name_prefix="Special",
                          initializer=seen.append, initargs=("hello",))
name = pool.fork(lambda: threading.current_thread().name).result(timeout=10)  # not run here
assert name.startswith("Special_"), name
assert seen and set(seen) == {"hello"}, seen
pool.shutdown()

def fails():
    raise ValueError("no database")
broken = aiopar.get_backend("thread", max_workers=1, initializer=fails)
fut = broken.fork(print, "never")
# aiopar's own wait, which runs a task that has not started in the waiting
# thread, but not one whose pool initializes its workers: only they run it.
try:
    fut.wait()
except BrokenThreadPool as exc:
    assert "no database" in str(exc), exc
else:
    raise AssertionError("the task ran")
try:
    broken.fork(print, "never")
except BrokenThreadPool:
    pass
else:
    raise AssertionError("a broken pool took a fork")
broken.shutdown()
print("ok")
"""


def test_thread_name_prefix_and_initializer_as_concurrent_futures_has_them():
    runs_ok(INITIALIZER, timeout=60)
