"""CPython's own test_concurrent_futures, unchanged, with aiopar.Executor in
place of both executors (tests/cf_suite.py): every test that fails is one
docs/async.md lists, with its reason, among the differences."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import sys
from pathlib import Path

import cf_suite
import pytest
from helpers import python

HERE = Path(__file__).parent
DOCS = HERE.parent / "docs" / "async.md"
MEASURED_ON = (3, 13)

pytestmark = pytest.mark.timeout(cf_suite.MODULE_TIMEOUT + 120)


def listed_differences() -> list[str]:
    """The patterns of the tests column of docs/async.md's table of what
    still differs, e.g. ``test_map_timeout`` or ``ProcessPoolFork*.test_initializer``."""
    text = DOCS.read_text()
    section = text[text.index("## What still differs from concurrent.futures") :]
    table = section[: section.find("\n## ")]
    patterns = []
    for row in table.splitlines():
        cells = row.split(" | ")
        if row.startswith("|") and len(cells) >= 3:
            patterns += re.findall(r"`([\w*.\[\]]+)`", cells[-1])
    return [p for p in patterns if "test_" in p]


def unlisted(failed: list[str], patterns: list[str]) -> list[str]:
    """The failed test ids (package.module.Class.test) no pattern matches:
    a pattern matches the id's end, ``Class.test`` or ``test``."""
    return [
        test
        for test in failed
        if not any(
            fnmatch.fnmatchcase(test, f"*.{pattern}") or fnmatch.fnmatchcase(test, pattern)
            for pattern in patterns
        )
    ]


def test_the_differences_table_names_tests():
    assert len(listed_differences()) > 10
    assert unlisted(["a.test_init.ProcessPoolForkFoo.test_x"], ["ProcessPoolFork*.test_x"]) == []
    assert unlisted(["a.test_init.ThreadFoo.test_x"], ["ProcessPoolFork*.test_x"]) != []


@pytest.mark.skipif(
    sys.version_info[:2] < MEASURED_ON
    or importlib.util.find_spec("test.test_concurrent_futures") is None,
    reason="CPython's test_concurrent_futures is measured on Python 3.13 with its test "
    "package (the core nox session runs it there)",
)
@pytest.mark.parametrize("module", cf_suite.MODULES)
def test_cpython_s_own_executor_tests_fail_only_where_the_docs_say_why(module):
    done = python(str(HERE / "cf_suite.py"), module, timeout=cf_suite.MODULE_TIMEOUT + 60)
    assert done.returncode == 0, done.stderr[-5000:]
    counts = json.loads(done.stdout.splitlines()[-1])[module]
    assert "failed" in counts, f"{module} did not finish: {counts}"
    assert unlisted(counts["failed"], listed_differences()) == [], counts
