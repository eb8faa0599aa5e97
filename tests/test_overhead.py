"""What fork/wait costs in Python calls, counted (not timed) against
``concurrent.futures``: speed itself lives in ``benchmarks/overhead.py``."""

from __future__ import annotations

import pytest
from helpers import run_python

pytestmark = pytest.mark.timeout(60)

COUNT_CALLS = """
import concurrent.futures, statistics, sys
import aiopar

def f():
    return 1

def python_calls(run):
    # Only this thread's calls: sys.setprofile is per thread.
    counts = []
    for _ in range(51):
        calls = 0

        def profile(frame, event, arg):
            nonlocal calls
            if event == "call":
                calls += 1

        sys.setprofile(profile)
        run()
        sys.setprofile(None)
        counts.append(calls - 1)  # less the call of run itself
    return statistics.median(counts)

executor = concurrent.futures.ThreadPoolExecutor(2)
pool = aiopar.get_backend("thread", max_workers=2)
for _ in range(100):  # workers started, caches warm
    executor.submit(f).result()
    pool.fork(f).wait()
assert "numpy" not in sys.modules  # a pure-Python program: the budget is not listening
print(python_calls(lambda: executor.submit(f).result()), python_calls(lambda: pool.fork(f).wait()))
"""


def test_fork_wait_makes_no_more_python_calls_than_submit_result():
    done = run_python(COUNT_CALLS, timeout=50)
    assert done.returncode == 0, done.stderr
    executor, aiopar_calls = map(float, done.stdout.split())
    assert aiopar_calls <= executor, done.stdout
