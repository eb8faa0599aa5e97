"""Helpers for tests that run Python in a child process, so a hang fails the
test (by its timeout) instead of stalling the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any


def python(*argv: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run this Python with ``argv`` and return what it did, output captured as text
    (unless ``kwargs`` sends it elsewhere)."""
    if "stdout" not in kwargs and "stderr" not in kwargs:
        kwargs["capture_output"] = True
    return subprocess.run([sys.executable, *argv], text=True, timeout=timeout, **kwargs)


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
