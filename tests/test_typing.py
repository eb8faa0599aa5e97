"""aiopar is a typed package: the wheel ships py.typed, and mypy --strict checks
a user's program against aiopar's annotations and infers its types."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAM = Path(__file__).with_name("typed_user_program.py")

pytestmark = pytest.mark.timeout(120)


def test_the_wheel_ships_py_typed(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "hatchling", "build", "--target", "wheel", "-d", str(tmp_path)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    [wheel] = tmp_path.glob("aiopar-*.whl")
    assert "aiopar/py.typed" in zipfile.ZipFile(wheel).namelist()


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory) -> Path:
    """One mypy cache for the module's runs: the standard library's stubs
    are read once (mypy's incremental mode gives the verdict a fresh run would)."""
    return tmp_path_factory.mktemp("mypy-cache")


def test_mypy_strict_accepts_a_user_program_and_infers_its_types(tmp_path, mypy_cache):
    # Run from a directory holding only the program, so mypy finds aiopar as
    # an installed package, which it reads only if the package has py.typed.
    shutil.copy(PROGRAM, tmp_path / "program.py")
    mypy = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(mypy_cache)]
    result = subprocess.run(
        [*mypy, "program.py"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_user_program_runs(tmp_path):
    subprocess.run([sys.executable, str(PROGRAM)], cwd=tmp_path, check=True, timeout=60)


def test_aiopar_itself_passes_mypy_strict(mypy_cache):
    # Run from the checkout, so mypy reads pyproject.toml's settings.
    mypy = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(mypy_cache)]
    result = subprocess.run(
        [*mypy, "aiopar"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
