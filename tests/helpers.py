"""Helpers for tests that run Python in a child process, so a hang fails the
test (by its timeout) instead of stalling the suite, and for tests that wait
until another thread or process has got somewhere.

Both suites use them: the aiopar-dask plugin's ``dask_helpers`` re-exports
them, and its conftest the fixtures."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def python(
    *argv: str,
    timeout: float = 60,
    input: str | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess[str]:
    """Run this Python with ``argv`` and return what it did, its output
    captured as text unless ``kwargs`` sends it elsewhere.

    The child leads a process group of its own: on timeout, or anything else
    that ends the call, the whole group is killed, so neither a hung child
    nor a grandchild it forked can keep the call from returning.
    """
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    proc = subprocess.Popen([sys.executable, *argv], text=True, start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except BaseException:  # the timeout, or the test's own (pytest-timeout)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def run_python(code: str, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a fresh interpreter; keywords as :func:`python`."""
    return python("-c", textwrap.dedent(code), *args, **kwargs)


def start_python(code: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``code`` (dedented) in a fresh interpreter, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def wait_until(condition: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Call ``condition`` every ``interval`` seconds until it is true (True)
    or ``timeout`` seconds have passed (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def eventually(predicate: Callable[[], object], timeout: float = 30) -> None:
    """Return once ``predicate()`` is true; fail the test after ``timeout``
    seconds. For state no event tells of: another thread's or process's."""
    assert wait_until(predicate, timeout, interval=0.005), f"timed out waiting for {predicate}"


@pytest.fixture
def gc_off() -> Iterator[None]:
    """The garbage collector off during the test: what a reference cycle holds stays."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()
