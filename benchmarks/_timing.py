"""What the benchmark scripts here share: runs that take turns, round by round."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def round_times(
    runs: dict[str, Callable[[], Any]], rounds: int, *, warm_up: bool = True
) -> dict[str, list[float]]:
    """Seconds of each run in each round, the runs taking turns, so drift on a
    shared machine hits them all alike."""
    if warm_up:
        for run in runs.values():
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return times


def median_times(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds of each run (after one warm-up call each), the runs taking turns."""
    return {name: statistics.median(ts) for name, ts in round_times(runs, rounds).items()}
