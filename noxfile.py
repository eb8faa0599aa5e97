"""The sessions of the README's test command, ``python -m nox``.

``tests`` and ``plugins`` run aiopar's suite and its plugins' in the
environment the command installed them into; ``core`` runs aiopar's suite
again on the newest Python CI has, in a fresh environment. On a machine
without that Python, ``core`` is skipped, and nox says so. The three run at
once: each spends much of its time waiting for the processes it starts.

The plugins' suite takes about as much CPU time as the other two together,
so it runs in two pytest-xdist workers, a test file to each at a time (a
file's cluster fixtures start once): four pytest processes share the cores,
and no session is left running alone at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import nox

NEWEST_PYTHON = "3.13"
PLUGIN_WORKERS = ("--numprocesses", "2", "--dist", "loadfile")

nox.options.sessions = ["tests", "plugins", "core"]
nox.options.parallel = 3
nox.options.error_on_missing_interpreters = False  # even with CI set, as CI runs it
nox.options.download_python = "never"
nox.options.default_venv_backend = "uv|virtualenv"


def _every_pyenv_python() -> None:
    """Let nox find each Python that pyenv installed, not only the active ones.

    pyenv's shims (``python3.13``) run only the versions it has active, and
    nox looks a Python up through them; the other versions are made active
    after the current ones, which still come first for ``python``."""
    if shutil.which("pyenv") is None:
        return
    pyenv = ["pyenv", "version-name"], ["pyenv", "versions", "--bare", "--skip-aliases"]
    active, installed = (subprocess.run(cmd, capture_output=True, text=True) for cmd in pyenv)
    if active.returncode or installed.returncode:
        return
    current = active.stdout.strip().split(":")
    others = [v for v in installed.stdout.split() if v not in current and "/" not in v]
    os.environ["PYENV_VERSION"] = ":".join(current + others)


_every_pyenv_python()


def _pytest(session: nox.Session, *args: str) -> None:
    """Run pytest with ``args``, then the command line's.

    Where the environment forbids bytecode beside the sources
    (PYTHONDONTWRITEBYTECODE, which CI sets), the suite keeps it in nox's
    cache instead: every interpreter the suite starts, hundreds of them,
    would compile each module it imports, and uv installs the fresh
    environment without compiling any (its session took 8.5 minutes beside
    the others instead of 5)."""
    env: dict[str, str | None] = {}
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        prefix = str((session.cache_dir / "pycache").resolve())
        env = {"PYTHONDONTWRITEBYTECODE": None, "PYTHONPYCACHEPREFIX": prefix}
    session.run("python", "-m", "pytest", *args, *session.posargs, env=env)


@nox.session(python=False, allow_parallel=True)
def tests(session: nox.Session) -> None:
    """aiopar's own suite, in the environment the test command installed."""
    _pytest(session, "tests")


@nox.session(python=False, allow_parallel=True)
def plugins(session: nox.Session) -> None:
    """The aiopar-dask plugin's suite, in the same environment."""
    _pytest(session, "backends/aiopar-dask/tests", *PLUGIN_WORKERS)


@nox.session(python=NEWEST_PYTHON, allow_parallel=True)
def core(session: nox.Session) -> None:
    """aiopar's own suite on the newest Python, in a fresh environment."""
    # The plugin too: the core's tests check the layering across both, and
    # run the docs' distributed examples.
    session.install("-e", ".[test]", "-e", "./backends/aiopar-dask")
    _pytest(session, "tests")
