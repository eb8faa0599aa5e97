"""What the benchmark scripts here share: runs that take turns, round by round."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple


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


class Measured(NamedTuple):
    """Seconds a contender measured itself (one that runs in another process)."""

    wall: float
    cpu: float


class ChildRounds:
    """A contender that runs in a fresh Python process, one round per call.

    ``code`` defines ``run()``; each call of :meth:`run` runs it once there
    and returns its wall and CPU seconds (every thread of that process) as
    :class:`Measured`. The process lives across calls, so its rounds take
    turns with this process's own. ``modules`` is what it had imported when
    it started its first round.
    """

    def __init__(self, code: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", code + _CHILD_LOOP],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.modules = set(self._read().split())

    def _read(self) -> str:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the child contender exited with {self.process.wait()}")
        return line

    def run(self) -> Measured:
        assert self.process.stdin is not None
        self.process.stdin.write("run\n")
        self.process.stdin.flush()
        wall, cpu = map(float, self._read().split())
        return Measured(wall, cpu)

    def __enter__(self) -> ChildRounds:
        return self

    def __exit__(self, *exc_info: object) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(timeout=60)


_CHILD_LOOP = """
import sys as _sys, time as _time
print(*_sys.modules, flush=True)
for _line in _sys.stdin:
    _wall, _cpu = _time.perf_counter(), _time.process_time()
    run()
    print(_time.perf_counter() - _wall, _time.process_time() - _cpu, flush=True)
"""
