"""The sessions of the README's test command, ``python -m nox``.

``tests`` and ``plugins`` run aiopar's suite and its plugins' in the
environment the command installed them into; ``core`` runs aiopar's suite
again on the newest Python CI has, in a fresh environment. On a machine
without that Python, ``core`` is skipped, and nox says so. ``lint`` runs
ruff (lint and format check), the import-linter contracts and mypy --strict
on aiopar and the plugin. The four run at once: the suites spend much of
their time waiting for the processes they start, and ``lint`` takes under a
minute of one core.

The plugins' suite takes about as much CPU time as the other two together,
so it runs in two pytest-xdist workers, a test file to each at a time (a
file's cluster fixtures start once): four pytest processes share the cores,
and no session is left running alone at the end.

The tests that check aiopar against torch need ``torch``, which is no
dependency of aiopar. Before those two suites start, the ``torch`` session
installs it where pip finds a file of ``TORCH`` on this machine for the
Python at hand (a CPU wheel in pip's ``find-links``, say), which takes half
a minute, not a download; ``core`` does the same in its environment.
Elsewhere those tests skip, saying torch is not installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import nox
from nox.command import CommandFailed

NEWEST_PYTHON = "3.13"
PLUGIN_WORKERS = ("--numprocesses", "2", "--dist", "loadfile")
PLUGIN = "backends/aiopar-dask"
TORCH = "torch==2.13.0"

nox.options.sessions = ["tests", "plugins", "core", "lint"]
nox.options.parallel = 4
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


def _install_local_torch(session: nox.Session, python: str) -> None:
    """Install ``TORCH`` into ``python``'s environment if it has no torch and
    pip finds a file of it on this machine for that Python; otherwise say why
    the tests that need torch skip.

    pip runs from this interpreter (``--python`` points it at the
    environment), so an environment without pip of its own is served too; its
    configuration says where the local files are. The probe is offline
    (``--no-index``), so a machine with no such file never starts a download.
    """
    find = "import sys, importlib.util as u; sys.exit(u.find_spec('torch') is None)"
    has_torch = [python, "-c", find]
    if subprocess.run(has_torch, capture_output=True).returncode == 0:
        session.log("torch is installed already: the tests that need it run")
        return
    pip = [sys.executable, "-m", "pip", "--python", python, "install"]
    probe = [*pip, "--dry-run", "--no-deps", "--no-index", "--ignore-installed", TORCH]
    if subprocess.run(probe, capture_output=True).returncode != 0:
        session.log(f"no local file of {TORCH} for this Python: the tests that need torch skip")
        return
    session.run(*pip, "--quiet", TORCH, external=True)


@nox.session(python=False, allow_parallel=True)
def torch(session: nox.Session) -> None:
    """torch into the test command's environment, where this machine has a file of it."""
    _install_local_torch(session, sys.executable)


@nox.session(python=False, allow_parallel=True, requires=["torch"])
def tests(session: nox.Session) -> None:
    """aiopar's own suite, in the environment the test command installed."""
    _pytest(session, "tests")


@nox.session(python=False, allow_parallel=True, requires=["torch"])
def plugins(session: nox.Session) -> None:
    """The aiopar-dask plugin's suite, in the same environment."""
    _pytest(session, f"{PLUGIN}/tests", *PLUGIN_WORKERS)


@nox.session(python=NEWEST_PYTHON, allow_parallel=True)
def core(session: nox.Session) -> None:
    """aiopar's own suite on the newest Python, in a fresh environment."""
    # The plugin too: the core's tests check the layering across both, and
    # run the docs' distributed examples.
    session.install("-e", ".[test]", "-e", f"./{PLUGIN}")
    _install_local_torch(session, str(Path(session.bin, "python")))
    _pytest(session, "tests")


@nox.session(python=False, allow_parallel=True)
def lint(session: nox.Session) -> None:
    """ruff and the import contracts on the checkout, mypy --strict on both packages.

    Every check runs, even after one fails, so one run shows every problem.
    mypy runs once per package, from the directory whose pyproject.toml
    holds that package's settings (the plugin's allows calls into
    dask.distributed's untyped parts); its cache lives in nox's, not in the
    checkout."""
    cache = (session.cache_dir / "mypy").resolve()
    mypy = ["python", "-m", "mypy", "--strict", "--cache-dir"]
    checks = {
        "ruff check": (".", ["python", "-m", "ruff", "check", "."]),
        "ruff format --check": (".", ["python", "-m", "ruff", "format", "--check", "."]),
        "lint-imports": (".", ["lint-imports", "--no-cache"]),
        "mypy aiopar": (".", [*mypy, str(cache), "aiopar"]),
        "mypy aiopar_dask": (PLUGIN, [*mypy, f"{cache}-plugin", "aiopar_dask"]),
    }
    failed = []
    for name, (where, command) in checks.items():
        with session.chdir(where):
            try:
                session.run(*command)
            except CommandFailed:
                failed.append(name)
    if failed:
        session.error(f"failed: {', '.join(failed)}")
