"""The layering of docs/design.md, as import-linter contracts (pyproject.toml's
[tool.importlinter]): no import cycle of any kind, arrows one way in aiopar
and in the plugin, public names only where the design says so, and each
package's private modules its own."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import python

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"aiopar": ROOT / "aiopar", "aiopar_dask": ROOT / "backends/aiopar-dask/aiopar_dask"}

pytestmark = pytest.mark.timeout(120)


def lint_imports(cwd: Path, **kwargs) -> tuple[int, str]:
    """import-linter's verdict on the aiopar and aiopar_dask importable from
    ``cwd``, under the repository's contracts."""
    done = python(
        "-c",
        "from importlinter.cli import lint_imports_command; lint_imports_command()",
        "--config",
        str(ROOT / "pyproject.toml"),
        "--no-cache",
        cwd=cwd,
        **kwargs,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_import_contracts_hold():
    status, report = lint_imports(ROOT)
    assert status == 0 and " BROKEN" not in report, report


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        # the budget knows no event loop
        (
            "aiopar/_budget.py",
            "from . import _loop",
            "aiopar._budget is not allowed to import aiopar._loop",
        ),
        # an import inside a function that closes a cycle counts too
        (
            "aiopar/_future.py",
            "def _late():\n    from . import _api",
            "No import cycle of any kind BROKEN",
        ),
        # the models use public names only
        (
            "aiopar/nn/module.py",
            "from .. import _future",
            "aiopar.nn is not allowed to import aiopar._future",
        ),
        # a new module takes its place in the layers
        ("aiopar/_newcomer.py", "x = 1", "aiopar._newcomer"),
        # another package's private modules are its own
        (
            "aiopar_dask/_backend.py",
            "from aiopar.rpc import _rref",
            "aiopar_dask._backend -> aiopar.rpc._rref",
        ),
        # the plugin is layered too: its errors know nothing of its backend
        (
            "aiopar_dask/_errors.py",
            "from . import _backend",
            "aiopar_dask._errors is not allowed to import aiopar_dask._backend",
        ),
        ("aiopar_dask/_newcomer.py", "x = 1", "aiopar_dask._newcomer"),
    ],
)
def test_an_import_against_the_design_breaks_a_contract(tmp_path, module, line, broken):
    for name, package in PACKAGES.items():
        shutil.copytree(package, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / module, "a") as source:  # or a new module
        source.write(f"\n\n{line}  # noqa\n")
    status, report = lint_imports(tmp_path)  # the copies shadow the checkout
    assert status != 0 and broken in report, report
