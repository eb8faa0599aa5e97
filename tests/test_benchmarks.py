"""The benchmarks run end to end at a small size; overhead.py judges its targets.
(lstm.py runs in test_nn_examples.py, with torch and without; async_app.py
runs here in its --quick mode, three uvicorn servers for about 20 s.)"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from helpers import python
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent


def _overhead_module():
    # It imports its neighbour _timing, as when it runs as a script.
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("overhead", ROOT / "benchmarks" / "overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overhead_benchmark_runs_and_prints_its_targets() -> None:
    result = python(
        "benchmarks/overhead.py", "--rounds", "1", "--scale", "0.05", cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "anchor / aiopar" in result.stdout
    assert "targets" in result.stdout
    assert "gather of 2,000 forks (asyncio)" in result.stdout
    assert "the floor: a minimal pool's await (MinimalPool)" in result.stdout


def _verdicts(rows: list[tuple[str, str, float, float]]) -> str:
    console = Console(width=200, record=True)
    console.print(_overhead_module().targets_table(rows))
    return console.export_text()


FLOOR = ("fork 10,000 then wait all", "the floor: the same on the inline backend (no thread)")
EXECUTOR = ("fork 10,000 then wait all", "executor: submit 10,000, result each")


def test_a_target_is_met_missed_or_beyond_reach_of_its_floor() -> None:
    # anchor / aiopar: 10 / 2 = 5x against a 3x target
    assert "met" in _verdicts([(*EXECUTOR, 2.0, 10.0), (*FLOOR, 2.0, 1.0)])
    # 2x; the floor would reach 10x: missed
    out = _verdicts([(*EXECUTOR, 5.0, 10.0), (*FLOOR, 5.0, 1.0)])
    assert "missed" in out and "beyond reach" not in out and "10.00x" in out
    # 2x; even the floor reaches only 2.5x: beyond reach
    assert "missed: beyond reach" in _verdicts([(*EXECUTOR, 5.0, 10.0), (*FLOOR, 5.0, 4.0)])


def test_a_target_is_met_only_in_both_wall_and_cpu_time() -> None:
    # 5x in wall time, 2x in CPU time, against 3x
    out = _verdicts([(*EXECUTOR, 2.0, 10.0, 5.0, 10.0), (*FLOOR, 2.0, 1.0, 2.0, 1.0)])
    assert "missed in CPU time" in out
    assert "met" in _verdicts([(*EXECUTOR, 2.0, 10.0, 2.0, 10.0), (*FLOOR, 2.0, 1.0, 2.0, 1.0)])
    # 2x in CPU time, where even the floor reaches only 2.5x
    out = _verdicts([(*EXECUTOR, 2.0, 10.0, 5.0, 10.0), (*FLOOR, 2.0, 1.0, 2.0, 4.0)])
    assert "missed in CPU time: beyond reach" in out and "2.50x" in out


def test_a_target_whose_rows_did_not_run_is_left_out() -> None:
    out = _verdicts([(*EXECUTOR, 2.0, 10.0)])  # no floor row
    assert "executor" not in out


def test_fork_cost_benchmark_runs_and_takes_the_time_apart() -> None:
    result = python(
        "benchmarks/fork_cost.py", "--rounds", "1", "--batch", "500", cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stderr
    parts = ("garbage collector", "hand-off", "submit", "task wrapper", "future, task and call")
    for part in parts:
        assert part in result.stdout


def test_async_app_benchmark_runs_and_prints_its_tables() -> None:
    for module in ("aiohttp", "uvicorn", "starlette"):
        pytest.importorskip(module)
    result = python("benchmarks/async_app.py", "--quick", cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "| work offloaded | concurrency | req/s: aiopar / anyio / run_in_executor |" in out
    for work in ("numpy 300x300 matmul", "a no-op", "`time.sleep(0.05)`"):
        assert f"| {work} | 10 |" in out
    assert "| `aiopar.fork` (default pool) |" in out
    assert "wrong responses: {'aiopar': 0, 'anyio': 0, 'run_in_executor': 0}" in out
