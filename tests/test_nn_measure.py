"""The measuring helper of `aiopar demo` and benchmarks/lstm.py, fed controlled figures."""

from __future__ import annotations

import numpy as np
import pytest

import aiopar
from aiopar.nn import LSTMEnsemble
from aiopar.nn._measure import (
    Row,
    Spread,
    busy_signs,
    ensemble_flops,
    ensemble_run,
    explain,
    gemm_peak,
    timed_round,
    verdict,
)


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
    assert anchor.speedup() is None
    assert row.speedup().ratios == tuple(
        a / b for a, b in zip(anchor.times, row.times, strict=True)
    )


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
