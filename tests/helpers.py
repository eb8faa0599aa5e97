"""Helpers for tests that run Python in a child process, so a hang fails the
test (by its timeout) instead of stalling the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any


def run_python(
    code: str, *args: str, timeout: float = 60, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """Run ``code`` (dedented) in a fresh interpreter and return what it did."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


def start_python(code: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``code`` (dedented) in a fresh interpreter, its output piped."""
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )
