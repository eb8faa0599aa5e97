"""aiopar-dask passes mypy --strict, with the settings of its pyproject.toml
(dask.distributed is typed only in part)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.timeout(300)
def test_aiopar_dask_passes_mypy_strict(tmp_path):
    pytest.importorskip("mypy")
    mypy = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache")]
    result = subprocess.run(
        [*mypy, "aiopar_dask"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
