"""aiopar._demo: how `aiopar demo` and benchmarks/lstm.py measure and judge, on made-up figures."""

from __future__ import annotations

import sys
import time

import numpy as np
import pytest

import aiopar
from aiopar._demo import (
    ROUND_SECONDS,
    ROUNDS,
    SIZES,
    CpuClock,
    Row,
    Spread,
    busy_signs,
    conclusions,
    cpu_clock,
    ensemble_flops,
    ensemble_run,
    explain,
    gemm_peak,
    other_programs,
    plan_text,
    rounds_left,
    timed_round,
    verdict,
)
from aiopar.nn import LSTMEnsemble


def spread(*ratios: float) -> Spread:
    return Spread(tuple(ratios))


def test_speedups_are_paired_by_round_and_read_the_same_way_round():
    # the anchor took 2, 4, 2 s; the row 1, 4, 4 s: 2x, level, half as fast
    s = Spread.paired([2.0, 4.0, 2.0], [1.0, 4.0, 4.0])
    assert s.ratios == (2.0, 1.0, 0.5)
    assert (s.median, s.low, s.high, s.wins) == (1.0, 0.5, 2.0, 1)
    assert str(s) == "1.00x"
    assert s.range == "0.50\N{EN DASH}2.00x"


def test_paired_needs_one_time_per_round_for_both():
    with pytest.raises(ValueError, match="one time per round"):
        Spread.paired([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="one time per round"):
        Spread.paired([], [])


@pytest.mark.parametrize(
    ("ratios", "outcome"),
    [
        ((1.2, 1.1, 1.3), "faster"),
        ((0.9, 0.8, 0.95), "slower"),
        ((1.5, 0.99, 1.4), "level"),  # one round the other way is noise, not a win
        ((1.0, 1.0, 1.0), "level"),
        ((1.2, 1.004, 1.3), "level"),  # a round printed as 1.00x is no win
        ((0.9, 0.996, 0.8), "level"),
    ],
)
def test_outcome_needs_every_round(ratios, outcome):
    assert spread(*ratios).outcome == outcome


def test_verdict_names_the_winner_and_by_how_much():
    line = verdict(
        {
            "directions forked": spread(0.9, 1.05, 1.0),
            "models forked": spread(1.4, 1.5, 1.6),
        }
    )
    assert line.startswith("Verdict: models forked won, 1.50x as fast as sequential")
    assert "faster in all 3 rounds: 1.40\N{EN DASH}1.60x" in line


def test_verdict_follows_the_medians():
    # a's median is higher than b's steady win: the verdict names a, and as
    # a's lost round makes it no clear win, calls the run level.
    line = verdict({"a": spread(2.0, 0.9, 2.0), "b": spread(1.1, 1.2, 1.15)})
    assert line.startswith("Verdict: level within noise; the fastest other variant, a, ")
    assert "faster in only 2 of 3 rounds" in line
    line = verdict({"a": spread(1.1, 1.2, 1.15), "b": spread(1.3, 0.99, 1.4)})
    assert line.startswith("Verdict: level within noise; the fastest other variant, b, ")


def test_verdict_says_sequential_won_only_if_every_variant_lost_every_round():
    line = verdict({"a": spread(0.6, 0.7), "b": spread(0.8, 0.9)})
    assert line.startswith("Verdict: sequential won; the fastest other variant, b, ran at 0.85x")
    assert "slower in both rounds" in line
    line = verdict({"a": spread(0.6, 0.7), "b": spread(0.8, 1.1)})
    assert line.startswith("Verdict: level within noise")


def test_verdict_level_within_noise_says_how_often_it_won():
    line = verdict({"models forked": spread(1.3, 0.95, 1.2, 1.1, 0.9)})
    assert line == (
        "Verdict: level within noise; the fastest other variant, models forked, ran at "
        "1.10x but was faster in only 3 of 5 rounds (0.90\N{EN DASH}1.30x)."
    )


def test_verdict_needs_a_variant():
    with pytest.raises(ValueError, match="at least one"):
        verdict({})


def test_explain_when_inter_op_works_but_blas_took_the_cores():
    line = explain(spread(1.9, 1.85, 1.95), spread(1.5, 1.5, 1.5), cores=2, tasks=8)
    assert line.startswith("Why: forking alone (1 BLAS thread each) ran 1.90x")
    assert "of an ideal 2x on 2 cores" in line
    assert "BLAS already spreads each matrix product over the cores" in line
    assert "1.50x as fast with its default threads" in line


def test_explain_when_inter_op_gains_little_calls_the_figures_noisy():
    line = explain(spread(1.2, 1.1, 1.3), spread(1.5, 1.5, 1.5), cores=2, tasks=8)
    assert "less than half the gain" in line and "noisy" in line
    assert "slowest thread" not in line
    # BLAS's threads made sequential slower: they wait for busy cores
    line = explain(spread(1.0, 0.5, 1.3), spread(0.36, 0.4, 0.3), cores=2, tasks=8)
    assert "sequential ran only 0.36x as fast with its default BLAS threads as with 1" in line
    assert "a multi-threaded product waits for its slowest thread" in line
    # on 8 cores, 4 tasks at a time: the ideal is 4x, and 2.4x is more than half the gain
    line = explain(spread(2.6, 2.5, 2.7), spread(3.0, 3.0, 3.0), cores=8, tasks=4)
    assert "of an ideal 4x on 8 cores" in line and "noisy" not in line


def test_explain_when_blas_threads_gained_little_or_lost():
    line = explain(spread(1.9, 1.85, 1.95), spread(1.0, 1.05, 1.02), cores=2, tasks=8)
    assert "BLAS already" not in line
    assert "BLAS's own threads gained little here (sequential ran 1.02x" in line
    # slower with every BLAS thread than with 1: they wait for busy cores
    line = explain(spread(1.9, 1.85, 1.95), spread(0.6, 0.7, 0.9), cores=2, tasks=8)
    assert "but sequential ran only 0.70x as fast with its default BLAS threads" in line
    assert "the forked rows look better than the cores allow" in line


def test_busy_signs_find_nothing_in_a_quiet_run():
    speedups = [spread(1.8, 1.9, 1.85), spread(0.95, 1.02, 1.0)]
    assert busy_signs(speedups, cores=2, peaks=[100e9, 115e9], of_peak=[0.4, 0.9]) == []


def test_busy_signs_a_speed_up_beyond_the_cores():
    # the reported run: ranges up to 5.40x and 8.58x on 2 cores
    signs = busy_signs(
        [spread(1.2, 5.4, 1.9), spread(1.5, 8.58, 2.0)], cores=2, peaks=[100e9], of_peak=[]
    )
    assert signs == ["a speed-up of 8.58x on 2 cores"]


def test_busy_signs_a_peak_that_moved_by_more_than_a_fifth():
    assert busy_signs([], cores=2, peaks=[100e9, 119e9], of_peak=[]) == []
    assert busy_signs([], cores=2, peaks=[195e9, 88e9], of_peak=[]) == [
        "the GEMM peak measured 195 then 88 GFLOP/s"
    ]


def test_busy_signs_a_row_above_the_peak():
    assert busy_signs([], cores=2, peaks=[100e9], of_peak=[0.5, 1.31]) == [
        "a row at 131% of that peak"
    ]


def test_explain_says_the_machine_was_busy_before_anything_else():
    busy = ["a speed-up of 8.58x on 2 cores", "the GEMM peak measured 195 then 88 GFLOP/s"]
    line = explain(spread(1.9, 1.85, 1.95), spread(1.5, 1.5, 1.5), cores=2, tasks=8, busy=busy)
    assert line == (
        "Why: the machine was busy while this ran (a speed-up of 8.58x on 2 cores; the GEMM "
        "peak measured 195 then 88 GFLOP/s), so these figures are not to be trusted; run it "
        "again when the machine is idle."
    )


def test_explain_on_one_core():
    line = explain(spread(0.9), spread(1.0), cores=1, tasks=8)
    assert "nothing can run side by side" in line


def test_timed_rounds_go_round_robin_and_pair_with_their_anchor():
    calls: list[str] = []
    anchor = Row("a", lambda: calls.append("a"))
    row = Row("b", lambda: calls.append("b"), anchor=anchor)
    for _ in range(3):
        assert [r.name for r in timed_round([anchor, row], pause=0)] == ["a", "b"]
    assert calls == ["a", "b"] * 3
    assert len(anchor.times) == len(row.times) == 3
    assert len(anchor.cpu_times) == len(row.cpu_times) == 3
    assert anchor.speedup() is None
    assert row.speedup().ratios == tuple(
        a / b for a, b in zip(anchor.times, row.times, strict=True)
    )


def test_a_reversed_round_runs_the_rows_last_to_first():
    calls: list[str] = []
    rows = [Row(name, lambda name=name: calls.append(name)) for name in "abc"]
    assert [r.name for r in timed_round(rows, pause=0, reverse=True)] == ["c", "b", "a"]
    assert calls == ["c", "b", "a"]


def test_a_call_reports_its_wall_and_cpu_time():
    row = Row("sleeps", lambda: time.sleep(0.05) or "done")
    result, wall, cpu = row.call()
    assert result == "done"
    assert wall >= 0.05
    assert 0 <= cpu < wall  # asleep, it burned next to no CPU
    assert row.times == [] and row.cpu_times == []  # call() records nothing
    row.times, row.cpu_times = [2.0, 1.0], [1.0, 1.0]
    assert row.cores_used == [0.5, 1.0]


def test_a_row_with_blas_threads_sets_them_only_for_its_call():
    seen = []
    row = Row("one thread", lambda: seen.append(aiopar.get_num_threads()), blas_threads=1)
    before = aiopar.get_num_threads()
    row.call()
    assert seen == [1]
    assert aiopar.get_num_threads() == before


def test_ensemble_run_gives_every_variant_the_same_output():
    ens = LSTMEnsemble(2, 3, 4, seed=0)
    x = np.random.default_rng(0).random((5, 2, 3), dtype=np.float32)
    reference = ensemble_run(ens, x, "sequential")()
    for variant in ("directions forked", "models forked"):
        np.testing.assert_allclose(ensemble_run(ens, x, variant)(), reference, rtol=1e-5)
    with pytest.raises(KeyError):
        ensemble_run(ens, x, "everything forked")


def test_flops_and_gemm_peak():
    # 1 model, 2 directions, 1 step, batch 1, 4 gates of 1 unit over 1 input + 1 hidden
    assert ensemble_flops(1, 1, 1, 1, 1) == 2 * 2 * 4 * 2
    assert ensemble_flops(4, 50, 50, 1024, 1024) == pytest.approx(3.36e11, rel=0.01)
    assert gemm_peak(64, runs=1) > 0


def test_busy_signs_other_programs_on_these_cores():
    assert busy_signs([], cores=2, peaks=[], of_peak=[], others=0.25) == []
    assert busy_signs([], cores=2, peaks=[], of_peak=[], others=None) == []
    assert busy_signs([], cores=2, peaks=[], of_peak=[], others=1.78) == [
        "other programs kept 1.78 of the 2 cores busy"
    ]


def test_busy_signs_a_single_thread_that_waited_for_a_core():
    # judged on the median round: one round cut short by a scheduler hiccup is not busy
    assert busy_signs([], cores=2, peaks=[], of_peak=[], single_thread=[0.5, 0.97, 0.99]) == []
    assert busy_signs([], cores=2, peaks=[], of_peak=[], single_thread=[0.6, 0.64, 0.95]) == [
        "the single-threaded sequential run got 0.64 of a core"
    ]


def test_verdict_on_a_busy_machine_names_no_winner():
    line = verdict(
        {"models forked": spread(6.1, 6.42, 6.6)}, busy=["a speed-up of 6.60x on 2 cores"]
    )
    assert line == (
        "No verdict: the machine was busy while this ran (a speed-up of 6.60x on 2 cores); "
        "run it again when it is idle."
    )


def timed(name: str, times: list[float], cpu: list[float] | None = None, anchor=None) -> Row:
    """A row that never ran, with made-up wall (and CPU) times per round."""
    row = Row(name, lambda: None, anchor=anchor)
    row.times, row.cpu_times = times, times if cpu is None else cpu
    return row


def demo_rows(
    sequential: list[float],
    models: list[float],
    single: list[float],
    interop: list[float],
    single_cpu: list[float] | None = None,
) -> list[Row]:
    """The rows as the demo makes them: sequential first, the inter-op pair last."""
    seq = timed("sequential", sequential)
    one = timed("sequential, 1 BLAS thread", single, single_cpu)
    return [
        seq,
        timed("models forked", models, anchor=seq),
        one,
        timed("models forked, 1 BLAS thread", interop, anchor=one),
    ]


QUIET_TIMES = {
    "sequential": [1.0, 1.02, 0.98],
    "models": [0.7, 0.72, 0.69],
    "single": [1.5, 1.52, 1.49],
    "interop": [0.8, 0.81, 0.79],
}
QUIET = demo_rows(**QUIET_TIMES)


def test_conclusions_of_a_quiet_run_name_the_winner_and_why():
    verdict_line, why = conclusions(QUIET, cores=2, flops=1e9, peak=10e9, others=0.02, tasks=8)
    assert verdict_line.startswith("Verdict: models forked won, 1.42x as fast as sequential")
    assert why.startswith("Why: forking alone (1 BLAS thread each) ran 1.88x")
    assert "BLAS already spreads each matrix product" in why


def test_conclusions_without_psutil_still_judge_a_quiet_run():
    lines = conclusions(QUIET, cores=2, flops=1e9, peak=10e9, others=None, tasks=8)
    assert lines[0].startswith("Verdict: models forked won")


def test_conclusions_never_print_a_headline_the_figures_contradict():
    # The reported run, on a busy 2-core machine: models forked "won, 6.42x as
    # fast as sequential" (which ran at 8% of peak) while the pair at 1 BLAS
    # thread showed forking at 0.91-1.10x; psutil was not there to tell.
    rows = demo_rows(
        sequential=[2.0, 1.9, 2.1],
        models=[0.312, 0.296, 0.33],
        single=[0.33, 0.31, 0.35],
        interop=[0.36, 0.28, 0.35],
    )
    peak = 1e9 / 2.0 / 0.08  # sequential at 8% of it
    lines = conclusions(rows, cores=2, flops=1e9, peak=peak, others=None, tasks=8)
    assert lines == [
        "No verdict: the machine was busy while this ran (a speed-up of 6.42x on 2 cores); "
        "run it again when it is idle."
    ]


def test_conclusions_when_other_programs_took_the_cores():
    lines = conclusions(QUIET, cores=2, flops=1e9, peak=10e9, others=1.17, tasks=8)
    assert lines == [
        "No verdict: the machine was busy while this ran (other programs kept 1.17 of the "
        "2 cores busy); run it again when it is idle."
    ]


def test_conclusions_when_the_single_thread_waited_for_a_core():
    # Two loops beside a 2-core run: every thread gets about 2/3 of a core,
    # and no speed-up goes beyond the cores to show it.
    rows = demo_rows(**QUIET_TIMES, single_cpu=[1.0, 1.0, 1.0])
    [line] = conclusions(rows, cores=2, flops=1e9, peak=10e9, others=None, tasks=8)
    assert line.startswith("No verdict: the machine was busy")
    assert "the single-threaded sequential run got 0.67 of a core" in line


def test_other_programs_are_the_busy_time_this_process_did_not_take():
    before = CpuClock(wall=10.0, busy=100.0, ours=5.0)
    # 2 s: the cores were busy 3 s, this process (and its children) 1 s of it
    assert other_programs(before, CpuClock(wall=12.0, busy=103.0, ours=6.0)) == 1.0
    # tick granularity can make this process look busier than the cores: none
    assert other_programs(before, CpuClock(wall=12.0, busy=100.5, ours=6.0)) == 0.0
    assert other_programs(None, before) is None
    assert other_programs(before, None) is None


def test_cpu_clock_needs_psutil(monkeypatch):
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil raises ImportError
    assert cpu_clock() is None


def test_cpu_clock_counts_a_worker_process_as_this_program():
    # The process backend's workers are this program's: their CPU time is
    # not "other programs" (a busy verdict on every --backend process run).
    pytest.importorskip("psutil")
    from aiopar.backends.process import ProcessBackend

    def burn(seconds: float) -> float:
        start = time.process_time()
        while time.process_time() - start < seconds:
            pass
        return time.process_time() - start

    with ProcessBackend(max_workers=1) as pool:
        pool.fork(int).wait()  # the worker is up
        before = cpu_clock()
        burned = pool.fork(burn, 0.3).wait()
        after = cpu_clock()
    assert after.ours - before.ours >= burned - 0.02  # psutil reads 10 ms ticks


def test_plan_says_how_long_the_demo_takes():
    assert "2 rounds" in plan_text("quick", None, resized=False)
    assert "about 20 s" in plan_text("default", None, resized=False)
    assert "--full" in plan_text("default", None, resized=False)
    assert "about a minute" in plan_text("full", None, resized=False)
    assert "5 rounds" in plan_text("default", 5, resized=False)
    assert "time left" in plan_text("default", None, resized=True)  # no promise it can't keep


def test_full_runs_the_tutorials_sizes_and_the_default_fits_a_budget():
    assert SIZES["full"] == (50, 50, 1024, 1024, 4)  # T, B, C, hidden, models
    budget = ROUND_SECONDS["default"]
    assert rounds_left(0, 1.5, budget) == int(budget / 1.5)
    assert rounds_left(0, 0.001, budget) == ROUNDS[1]
    assert rounds_left(0, 60.0, budget) == ROUNDS[0]  # a slow machine still gets a spread
    # re-planned after each round: a busy machine stops at the budget, not before ROUNDS[0]
    assert rounds_left(4, 3.0, 2.0) == 4
    assert rounds_left(1, 3.0, -5.0) == ROUNDS[0]
    assert rounds_left(2, 1.0, 3.5) == 5
