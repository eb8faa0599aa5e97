"""CPython's own ``test_concurrent_futures``, unchanged, with aiopar.Executor
standing in for ThreadPoolExecutor and ProcessPoolExecutor.

Run as ``python tests/cf_suite.py [module ...]`` on a Python that ships the
``test`` package (3.13 is the one measured; see docs/async.md): each of the
suite's modules runs in a child of its own, so a test that hangs costs its
module and no other; the last line of output is JSON, a module's counts and
the ids of the tests that failed, per module. A child runs one module with
``--module NAME``. A test still running after TEST_TIMEOUT seconds fails
with TimeoutError (raised on the main thread, again every ten seconds while
its clean-up hangs too), so one that hangs costs itself and not the tests
after it.

The shim is the two classes below. The modules build their executors from
``concurrent.futures``' names (``futures.ThreadPoolExecutor``), so replacing
those names before the modules are imported is all it takes. Tests that
start a Python of their own (``assert_python_ok``) run the standard
library's executors there.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import os
import signal
import subprocess
import sys
import time
import unittest

import aiopar

MODULES = [
    "test_future",
    "test_wait",
    "test_as_completed",
    "test_init",
    "test_thread_pool",
    "test_process_pool",
    "test_shutdown",
    "test_deadlock",
]
PACKAGE = "test.test_concurrent_futures"
#: seconds a module may take before it counts as hung
MODULE_TIMEOUT = 1800
TEST_TIMEOUT = 60
MARK = "counts: "


class ThreadPoolExecutor(aiopar.Executor):
    __init__ = functools.partialmethod(aiopar.Executor.__init__, "thread")


class ProcessPoolExecutor(aiopar.Executor):
    __init__ = functools.partialmethod(aiopar.Executor.__init__, "process")


class _Deadlines(unittest.TextTestResult):
    """Fails a test that runs longer than TEST_TIMEOUT seconds."""

    def startTest(self, test: unittest.TestCase) -> None:
        signal.setitimer(signal.ITIMER_REAL, TEST_TIMEOUT)
        super().startTest(test)

    def stopTest(self, test: unittest.TestCase) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        super().stopTest(test)


def _too_long(signum: int, frame: object) -> None:
    signal.setitimer(signal.ITIMER_REAL, 10)
    raise TimeoutError(f"the test ran longer than {TEST_TIMEOUT} s (cf_suite's limit)")


def run_module(name: str) -> dict[str, object]:
    """Run one module of the suite with the shim in place; its counts."""
    concurrent.futures.ThreadPoolExecutor = ThreadPoolExecutor  # type: ignore[misc]
    concurrent.futures.ProcessPoolExecutor = ProcessPoolExecutor  # type: ignore[misc]
    signal.signal(signal.SIGALRM, _too_long)
    suite = unittest.defaultTestLoader.loadTestsFromName(f"{PACKAGE}.{name}")
    runner = unittest.TextTestRunner(stream=sys.stderr, verbosity=2, resultclass=_Deadlines)
    result = runner.run(suite)
    signal.setitimer(signal.ITIMER_REAL, 0)
    failed = [test.id() for test, _ in (*result.failures, *result.errors)]
    failed += [test.id() for test in result.unexpectedSuccesses]
    return {
        "run": result.testsRun,
        "skipped": len(result.skipped),
        "failed": sorted(set(failed)),  # a test and its clean-up may both fail
    }


def run_modules(names: list[str]) -> dict[str, object]:
    """Run each module in a child of its own; the counts, per module."""
    counts: dict[str, object] = {}
    for name in names:
        started = time.monotonic()
        try:
            done = subprocess.run(
                [sys.executable, __file__, "--module", name],
                stdout=subprocess.PIPE,
                text=True,
                timeout=MODULE_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            counts[name] = {"hung": MODULE_TIMEOUT}
            continue
        # The tests print too, without ending their lines: the counts
        # follow the last MARK.
        _, found, counts_json = done.stdout.rpartition(MARK)
        counts[name] = json.loads(counts_json) if found else {"exit": done.returncode}
        print(f"{name}: {counts[name]} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("modules", nargs="*", default=MODULES)
    parser.add_argument("--module", help="run this module here (what each child does)")
    args = parser.parse_args()
    if args.module:
        print(MARK + json.dumps(run_module(args.module)), flush=True)
        # Exit waits for the tasks a failed test left blocked, for ever: the
        # counts are in.
        os._exit(0)
    else:
        print(json.dumps(run_modules(args.modules)), flush=True)


if __name__ == "__main__":
    main()
