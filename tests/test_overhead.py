"""What fork/wait costs in Python calls, counted (not timed) against
``concurrent.futures``: speed itself lives in ``benchmarks/overhead.py``."""

from __future__ import annotations

import sys

import pytest
from helpers import run_python

import aiopar

pytestmark = pytest.mark.timeout(60)

# Counts the Python calls of every thread while ``counting`` is set: the
# pools' threads start after this, with the profile.
COUNTING = """
import concurrent.futures, statistics, sys, threading, time
if sys.argv[1] == "numpy":
    import numpy  # loads BLAS: the budget listens to the pools from now on
import aiopar
from aiopar import _budget_slots
from aiopar._budget import budget

# Every wait is "at once" (rule 3 of aiopar._budget), however loaded the
# machine: this thread forks and waits, and never counts beside its forks.
_budget_slots.WAITS_AT_ONCE = 1.0

def f():
    return 1

counting = False
calls = 0

def profile(frame, event, arg):
    global calls
    if counting and event == "call":
        calls += 1

threading.setprofile(profile)
sys.setprofile(profile)
pool = aiopar.get_backend("thread", max_workers=2)

def python_calls(run, all_asleep):
    global counting, calls
    while not all_asleep():
        time.sleep(0.0005)
    calls, counting = 0, True
    run()
    while not all_asleep():
        time.sleep(0.0005)
    counting = False
    return calls - 1  # less the call of run itself
"""

COUNT_CALLS = (
    COUNTING
    + """
executor = concurrent.futures.ThreadPoolExecutor(2)

def executor_asleep():
    return executor._idle_semaphore._value == len(executor._threads)

def pool_asleep():
    # The libraries have every core back too: in the tenth of a second after
    # two threads last counted (rule 4 of aiopar._budget), each worker that
    # starts looks again whether they may have them.
    return len(pool._idle) == len(pool._workers) and budget.applied in (None, budget.target())

for _ in range(100):  # workers started, caches warm
    executor.submit(f).result()
    pool.fork(f).wait()
assert ("numpy" in sys.modules) == (sys.argv[1] == "numpy")
# Taking turns, so that both see the machine as it is: on a busy one, a
# worker that runs late makes other calls than one that is there at once.
counts = {"executor": [], "aiopar": []}
for _ in range(51):
    counts["executor"].append(
        python_calls(lambda: executor.submit(f).result(timeout=5), executor_asleep)
    )
    counts["aiopar"].append(python_calls(lambda: pool.fork(f).wait(timeout=5), pool_asleep))
print(statistics.median(counts["executor"]), statistics.median(counts["aiopar"]))
"""
)


@pytest.mark.parametrize("program", ["pure Python", "numpy"])
def test_fork_wait_makes_no_more_python_calls_than_submit_result_across_all_threads(program):
    # With a timeout neither side runs the task in the caller: a worker is
    # woken for it, runs it and goes back to sleep, each counted. With numpy
    # loaded the budget listens to those transitions, and costs no more.
    done = run_python(COUNT_CALLS, program, timeout=50)
    assert done.returncode == 0, done.stderr
    executor, aiopar_calls = map(float, done.stdout.split())
    assert aiopar_calls <= executor, done.stdout


COUNT_BATCH_CALLS = (
    COUNTING
    + """
def asleep():
    return len(pool._idle) == len(pool._workers)

def batch():
    aiopar.wait_all([pool.fork(f) for _ in range(1000)])

batch()  # workers started, caches warm
print(statistics.median(python_calls(batch, asleep) / 1000 for _ in range(5)))
"""
)


@pytest.mark.parametrize("program", ["pure Python", "numpy"])
def test_a_batch_of_forks_makes_eight_python_calls_per_task_across_all_threads(program):
    # Per task: fork, Future(), the task, enqueue; on the worker, the run,
    # the claim, f itself and the settle. Waking and idling workers, and
    # wait_all itself, add a few per batch, not per task.
    done = run_python(COUNT_BATCH_CALLS, program, timeout=50)
    assert done.returncode == 0, done.stderr
    assert float(done.stdout) < 8.5, done.stdout


def python_calls_per_read(read, futures):
    calls = 0

    def profile(frame, event, arg):
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        for fut in futures:
            read(fut)
    finally:
        sys.setprofile(None)
    return calls / len(futures)


@pytest.mark.parametrize("read", ["result", "wait"])
def test_reading_a_done_future_skips_the_blocking_path(read):
    # map and as_completed read thousands of done futures: the state is
    # looked at first, and the blocking path never entered (result ->
    # wait -> value; concurrent.futures' result() is two calls).
    futures = [aiopar.fork(abs, -i) for i in range(200)]
    aiopar.wait_all(futures)
    assert python_calls_per_read(getattr(aiopar.Future, read), futures) <= (
        3 if read == "result" else 2
    )
