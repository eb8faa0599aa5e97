"""The `aiopar` command: info, demo, bench, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

import aiopar
from aiopar.cli import main


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiopar", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_demo_quick_in_a_subprocess():
    done = run_cli("demo", "--quick")
    assert done.returncode == 0, done.stderr
    for text in ("sequential", "directions forked", "models forked", "await", "speedup"):
        assert text in done.stdout
    assert "GEMM peak" in done.stdout
    assert "matches the sequential run" in done.stdout
    assert "Traceback" not in done.stderr


def test_demo_quick_in_process(capsys):
    assert main(["demo", "--quick", "--backend", "thread,inline", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if "forked" in line]
    assert sum("inline" in row for row in rows) == 4  # 2 variants x sync, await
    assert sum("thread" in row for row in rows) == 4
    assert "best of 2" in out


@pytest.mark.parametrize("backend", aiopar.available_backends())
def test_demo_quick_on_every_backend(backend, capsys):
    assert main(["demo", "--quick", "--backend", backend]) == 0
    if backend not in ("inline", "thread", "process", "openmp"):
        aiopar.get_backend(backend).shutdown()  # a plugin's cluster (dask's) must not outlive it
    out = capsys.readouterr().out
    assert sum(backend in line for line in out.splitlines() if "forked" in line) == 4
    assert "matches the sequential run" in out


def test_demo_forks_every_row_on_the_chosen_backend(capsys):
    from aiopar.profiler import profile

    with profile() as prof:
        assert main(["demo", "--quick", "--backend", "inline"]) == 0
    backends = {record.backend for record in prof.records}
    assert backends == {"inline"}  # awaited rows too, not the default "thread"
    # awaited: the whole ensemble is one forked task per run (warm-up + 1 repeat)
    assert sum(r.name == "LSTMEnsemble" for r in prof.records) == 3 * 2


def test_demo_sizes_are_options(capsys):
    argv = ["demo", "--quick", "--seq-len", "3", "--batch", "2", "--input-size", "5"]
    assert main([*argv, "--hidden-size", "7", "--models", "3"]) == 0
    assert "3 bidirectional LSTMs, input (3, 2, 5), hidden 7" in capsys.readouterr().out


def test_demo_trace_writes_a_chrome_trace(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--quick", "--trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in slices}
    assert "BidirectionalRecurrentLSTM" in names  # the forked models
    assert len(slices) >= 4  # 2 models, each forking its forward direction
    assert all({"ts", "dur", "pid", "tid"} <= e.keys() for e in slices)
    assert any(e["ph"] == "s" for e in trace["traceEvents"])
    out = capsys.readouterr().out
    assert str(path) in out
    assert "aiopar profile" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["demo", "--batch", "0"], "argument --batch: must be a whole number >= 1, got '0'"),
        (["demo", "--models", "-3"], "argument --models: must be a whole number >= 1"),
        (["demo", "--seq-len", "ten"], "argument --seq-len: must be a whole number >= 1"),
        (["demo", "--backend", "gpu"], "unknown backend 'gpu'; available: inline, thread"),
        (["demo", "--backend", ","], "name at least one backend"),
        (["demo", "--trace", "/nonexistent-dir/x/trace.json"], "cannot write"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["frobnicate"], "invalid choice"),
        (["info", "--", "x"], "only 'aiopar bench' takes arguments after '--'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("error: aiopar")
    assert message in lines[0]


def test_trace_path_that_is_a_directory(tmp_path, capsys):
    assert main(["demo", "--quick", "--trace", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_bad_input_in_a_subprocess_has_no_traceback():
    done = run_cli("demo", "--hidden-size", "-1", timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1
    assert "--hidden-size" in done.stderr
    assert "Traceback" not in done.stderr


def test_info(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in aiopar.available_backends():
        assert name in out


def test_version_and_help(capsys):
    assert main(["--version"]) == 0
    assert aiopar.__version__ in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0
    assert "--trace" in capsys.readouterr().out
    assert main([]) == 2  # no command: usage on stdout


@pytest.fixture
def suites(tmp_path):
    (tmp_path / "overhead.py").write_text(
        textwrap.dedent(
            """
            import sys
            print("overhead table", *sys.argv[1:])
            """
        )
    )
    (tmp_path / "broken.py").write_text("raise SystemExit(3)\n")
    (tmp_path / "_helpers.py").write_text("raise SystemExit('not a suite')\n")
    return tmp_path


def test_bench_runs_the_chosen_suites_with_arguments(suites, capfd):
    assert main(["bench", "overhead", "--dir", str(suites), "--", "--rounds", "1"]) == 0
    out = capfd.readouterr().out
    assert "overhead table --rounds 1" in out
    assert "ok" in out


def test_bench_reports_a_failing_suite(suites, capfd):
    assert main(["bench", "--dir", str(suites)]) == 1
    out = capfd.readouterr().out
    assert "overhead table" in out
    assert "failed (exit 3)" in out
    assert "not a suite" not in out


def test_bench_unknown_suite_or_dir(suites, tmp_path, capsys):
    assert main(["bench", "nosuch", "--dir", str(suites)]) == 2
    assert "no suite 'nosuch'" in capsys.readouterr().err
    assert main(["bench", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
