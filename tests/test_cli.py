"""The `aiopar` command: info, demo, bench, and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
from helpers import python

import aiopar
from aiopar import cli
from aiopar.cli import main


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return python("-m", "aiopar", *args, timeout=timeout)


def test_demo_quick_in_a_subprocess():
    done = run_cli("demo", "--quick")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for text in ("directions forked", "models forked", "models forked (awaited)", "speed-up"):
        assert text in out
    assert "best" in out and "CPU" in out  # wall time, and CPU time beside it
    # the inter-op pair: sequential and forked at 1 BLAS thread each
    assert "sequential, 1 BLAS thread" in out and "models forked, 1 BLAS thread" in out
    assert "GEMM peak" in out
    assert "matches the sequential run" in out
    lines = out.splitlines()
    verdicts = [line for line in lines if line.startswith(("Verdict: ", "No verdict: "))]
    assert len(verdicts) == 1
    # a Why line follows a verdict; a busy machine gets neither
    why = [line for line in lines if line.startswith("Why: ")]
    assert len(why) == (0 if verdicts[0].startswith("No verdict") else 1)
    assert "Traceback" not in done.stderr


def test_demo_says_how_long_it_takes_before_it_starts(capsys):
    assert main(["demo", "--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "--quick" in lines[1] and "2 rounds" in lines[1]


def test_demo_quick_in_process(capsys):
    assert main(["demo", "--quick", "--backend", "thread,inline", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if " forked" in line and "BLAS" not in line]
    assert sum(" on inline" in row for row in rows if "Verdict" not in row) == 3
    assert sum(" on thread" in row for row in rows if "Verdict" not in row) == 3
    assert "over 3 rounds" in out


# The built-in backends; a plugin's backend (one that starts a cluster, say)
# would outlive this in-process run, and its own tests cover it.
@pytest.mark.parametrize("backend", ["inline", "thread", "process", "openmp"])
def test_demo_quick_on_every_backend(backend, capsys):
    assert main(["demo", "--quick", "--backend", backend]) == 0
    if backend not in ("inline", "thread", "process", "openmp"):
        aiopar.get_backend(backend).shutdown()  # a plugin's cluster (dask's) must not outlive it
    out = capsys.readouterr().out
    assert "forks on " + backend in out
    assert "matches the sequential run" in out


def test_demo_forks_every_row_on_the_chosen_backend(capsys):
    from aiopar.profiler import profile

    with profile() as prof:
        assert main(["demo", "--quick", "--backend", "inline"]) == 0
    runs = 1 + 2  # warm-up + 2 rounds
    by_backend: dict[str, int] = {}
    for record in prof.records:
        by_backend[record.backend] = by_backend.get(record.backend, 0) + 1
    # the forked variants fork on inline; the inter-op pair forks on thread
    # whatever --backend says; every run forks the same tasks
    assert by_backend.keys() == {"inline", "thread"}
    assert all(count % runs == 0 for count in by_backend.values())
    awaited = [r for r in prof.records if r.name == "LSTMEnsemble"]
    assert len(awaited) == runs and {r.backend for r in awaited} == {"inline"}


def test_demo_sizes_are_options(capsys):
    argv = ["demo", "--quick", "--seq-len", "3", "--batch", "2", "--input-size", "5"]
    assert main([*argv, "--hidden-size", "7", "--models", "3"]) == 0
    out = capsys.readouterr().out
    assert "3 bidirectional LSTMs, input (T, B, C) = (3, 2, 5), hidden 7" in out


def test_demo_trace_writes_a_chrome_trace(tmp_path, capsys):
    path = tmp_path / "demo.json"
    assert main(["demo", "--quick", "--trace", str(path)]) == 0
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "profile"]
    assert slices  # the models forked: at least one task
    assert all({"ts", "dur", "pid", "tid"} <= e.keys() for e in slices)
    assert any(e["ph"] == "s" for e in trace["traceEvents"])  # a fork's arrow
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
        (["demo", "--full", "--quick"], "argument --quick: not allowed with argument --full"),
        (["demo", "--rounds", "0"], "argument --rounds: must be a whole number >= 1"),
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


def test_a_trace_that_cannot_be_written_after_the_run_is_one_line_and_exit_2(
    tmp_path, capsys, monkeypatch
):
    from aiopar.profiler import Profile

    def no_space(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Profile, "export_chrome_trace", no_space)
    assert main(["demo", "--quick", "--trace", str(tmp_path / "trace.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "error: aiopar demo: cannot write the trace to" in err
    assert "No space left on device" in err


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


def test_info_into_a_closed_pipe_stops_quietly():
    """`aiopar info | head`: the reader is gone before we write (Python's docs on SIGPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = python("-m", "aiopar", "info", stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert "BrokenPipeError" not in done.stderr
    assert "Traceback" not in done.stderr
    assert done.returncode == 1


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


def test_bench_says_how_long_it_takes_before_it_starts(suites, capfd):
    assert main(["bench", "overhead", "--dir", str(suites)]) == 0
    out = capfd.readouterr().out
    assert out.index("Running 1 suite: overhead.") < out.index("overhead table")


def test_bench_plan_adds_up_the_suites_times(monkeypatch):
    monkeypatch.setattr(cli, "SUITE_SECONDS", {"a": 30, "b": 150})
    assert cli.bench_plan(["a", "b"], []) == (
        "Running 2 suites: a, b. On 2 cores at their default rounds they took about 3 min "
        "(a ~30 s, b ~2 min). Fewer rounds take less: aiopar bench -- --rounds 1."
    )
    plan = cli.bench_plan(["a", "new"], ["--rounds", "2"])
    assert "about 30 s (a ~30 s), plus 1 not timed yet." in plan
    assert "--rounds changes that" in plan


def test_bench_help_lists_the_suites_and_their_time(capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # a checkout: ./benchmarks
    assert main(["bench", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "overhead (~30 s), threads (~4 min), process (~25 s), lstm (~5 min)" in out
    assert "about 10 min on 2 cores" in out


def test_bench_unknown_suite_or_dir(suites, tmp_path, capsys):
    assert main(["bench", "nosuch", "--dir", str(suites)]) == 2
    assert "no suite 'nosuch'" in capsys.readouterr().err
    assert main(["bench", "--dir", str(tmp_path / "missing")]) == 2
    assert "is not a directory" in capsys.readouterr().err
