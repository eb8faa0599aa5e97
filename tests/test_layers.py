"""DESIGN.md section 4's layering, as import-linter contracts (pyproject.toml's
[tool.importlinter]): no import cycle of any kind, arrows one way, public
names only where the design says so."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import python

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(120)


def lint_imports(cwd: Path, **kwargs) -> tuple[int, str]:
    """import-linter's verdict on the aiopar importable from ``cwd``, under
    the repository's contracts."""
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
            "_budget.py",
            "from . import _loop",
            "aiopar._budget is not allowed to import aiopar._loop",
        ),
        # an import inside a function that closes a cycle counts too
        (
            "_future.py",
            "def _late():\n    from . import _api",
            "No import cycle of any kind BROKEN",
        ),
        # the models use public names only
        (
            "nn/module.py",
            "from .. import _future",
            "aiopar.nn is not allowed to import aiopar._future",
        ),
        # a new module takes its place in the layers
        ("_newcomer.py", "x = 1", "aiopar._newcomer"),
    ],
)
def test_an_import_against_the_design_breaks_a_contract(tmp_path, module, line, broken):
    copy = tmp_path / "aiopar"
    shutil.copytree(ROOT / "aiopar", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / module, "a") as source:  # or a new module
        source.write(f"\n\n{line}  # noqa\n")
    status, report = lint_imports(tmp_path)  # the copy shadows the checkout
    assert status != 0 and broken in report, report
