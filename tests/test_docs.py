"""Every ```python block of README.md and docs/ runs, and the site builds with --strict.

The blocks of one file run in order as one script, the way a reader runs
what they saved: ``python page_md.py`` in an empty working directory, each
block at its own line numbers, so a traceback points at the right line of
the page. Blocks that start processes (a dask cluster, rpc peers) run there
exactly as in a user's unguarded script. A block right after an
``<!-- skip -->`` line is not run (for snippets that are not Python a reader
can run here, such as a plugin's packaging).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from helpers import python

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^\n]*)$")


def python_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block not marked to skip."""
    blocks: list[tuple[int, str]] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if match is None:
            i += 1
            continue
        fence, indent = match["fence"], len(match["indent"])
        language = match["info"].split()[0] if match["info"].split() else ""
        skip = i > 0 and lines[i - 1].strip() == "<!-- skip -->"
        body_start = i + 1
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            i += 1
        body = [line[indent:] for line in lines[body_start:i]]
        i += 1
        if language in ("python", "py") and not skip:
            blocks.append((body_start + 1, "\n".join(body) + "\n"))
    return blocks


def test_the_docs_have_python_blocks():
    assert sum(len(python_blocks(path)) for path in DOC_FILES) >= 20


PAGES_WITH_CODE = [path for path in DOC_FILES if python_blocks(path)]


def page_script(path: Path) -> str:
    """The page's python blocks as one script, each block at its line numbers."""
    lines = [f"# the python blocks of {path.name}, at their lines there"]
    for line, source in python_blocks(path):
        lines += [""] * (line - 1 - len(lines))
        lines += source.splitlines()
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", PAGES_WITH_CODE, ids=lambda p: str(p.relative_to(ROOT)))
def test_code_blocks_run(path: Path, tmp_path: Path) -> None:
    script = tmp_path / f"{path.stem.replace('-', '_')}_md.py"
    script.write_text(page_script(path), encoding="utf-8")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = python(script.name, cwd=tmp_path, env=env, timeout=240)
    assert done.returncode == 0, f"a block of {path.name} failed:\n{done.stderr[-4000:]}"


def test_skip_marker_and_line_numbers(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- skip -->\n```python\nraise SystemExit\n```\n"
        "\n```bash\nls\n```\n\n- item\n\n    ```python\n    y = x\n    ```\n"
    )
    assert python_blocks(page) == [(4, "x = 1\n"), (19, "y = x\n")]
    script = page_script(page).splitlines()
    assert (script[3], script[18]) == ("x = 1", "y = x")


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    done = python(
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "--site-dir",
        str(tmp_path / "site"),
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "profiler" / "index.html").exists()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_command = next(c for c in commands if '".[test]"' in c)
    ci_lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert test_command in ci_lines
    assert any("aiopar demo" in c for c in commands), "the README names the main job"
