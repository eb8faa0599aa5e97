"""The nn examples and benchmark run end to end at small sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import python

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str) -> str:
    result = python(*args, cwd=ROOT, timeout=90)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_lstm_ensemble_example() -> None:
    out = run("examples/lstm_ensemble.py", "--quick")
    for label in ("sequential", "directions forked", "models and directions forked"):
        assert f"{label}: inference took" in out


def test_async_inference_example() -> None:
    out = run("examples/async_inference.py", "--quick")
    assert "requests/s" in out
    assert "p99" in out


@pytest.mark.parametrize("torch", [False, True], ids=["numpy-only", "with-torch"])
def test_lstm_benchmark_quick(torch: bool) -> None:
    if torch:
        pytest.importorskip("torch")
    out = run("benchmarks/lstm.py", "--quick", *([] if torch else ["--no-torch"]))
    assert "aiopar sequential" in out
    assert "GEMM peak" in out
    assert ("TorchScript sequential" in out) == torch
    # the demo's measuring: speed-ups the same way round, the inter-op pair, a verdict
    assert "speed-up" in out and "range" in out
    assert "aiopar sequential, 1 BLAS thread" in out
    lines = out.splitlines()
    assert any(line.startswith("Verdict: ") for line in lines)
    assert any(line.startswith("Why: ") for line in lines)
