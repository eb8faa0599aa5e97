"""Timing the LSTM ensemble: the method `aiopar demo` and ``benchmarks/lstm.py`` share.

Both measure the same way, so their figures compare:

* **rounds**: every row runs once per round, in turn, so a machine whose
  speed drifts (shared cores, turbo) slows all rows alike;
* **a pause before each timed run**: BLAS and OpenMP pools keep their threads
  spinning for a while after their last call, and would slow whichever row
  came next;
* **speed-ups paired by round**: a row's time divided into its anchor's time
  of the same round (above 1: faster), reported as the median and range over
  the rounds, which cancels most drift and shows what is left of it;
* **the FLOP count and the float32 GEMM peak** measured in the same run, for
  the fraction of the hardware a row uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import aiopar

from .._budget import cores as available_cores

__all__ = [
    "VARIANTS",
    "Row",
    "Spread",
    "available_cores",
    "busy_signs",
    "ensemble_flops",
    "ensemble_run",
    "explain",
    "gemm_peak",
    "spin_pause",
    "timed_round",
    "verdict",
]

#: The tutorial's three variants: label -> (fork_models, fork_directions).
VARIANTS: dict[str, tuple[bool, bool]] = {
    "sequential": (False, False),
    "directions forked": (False, True),
    "models forked": (True, True),
}

# OpenBLAS's threads spin about 0.1 s after their last call; an OpenMP
# runtime's spin longer (Intel's 0.2 s: KMP_BLOCKTIME).
_BLAS_SPIN, _OPENMP_SPIN = 0.15, 0.3

# Below this speed-up from its own threads, BLAS leaves the cores to the forks.
_BLAS_GAIN = 1.1


def spin_pause() -> float:
    """Seconds to pause before a timed run: longer once an OpenMP runtime is loaded (torch)."""
    from threadpoolctl import threadpool_info

    openmp = any(lib["user_api"] == "openmp" for lib in threadpool_info())
    return _OPENMP_SPIN if openmp else _BLAS_SPIN


def ensemble_flops(
    n_models: int, seq_len: int, batch: int, input_size: int, hidden_size: int
) -> float:
    """FLOPs of one ensemble run: per model, direction and step, the input and
    recurrent products of 4 gates (2 FLOPs per multiply-add)."""
    return float(n_models * 2 * seq_len * 2 * batch * 4 * hidden_size * (input_size + hidden_size))


def gemm_peak(n: int = 2048, runs: int = 3) -> float:
    """FLOP/s of numpy's float32 ``n x n`` matrix product with BLAS's current threads.

    The best of `runs` products after a warm-up: on a busy machine a product
    often waits for a core, and only the fastest shows what the hardware does.
    """
    rng = np.random.default_rng(1)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    out = np.empty_like(a)
    np.matmul(a, b, out=out)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def ensemble_run(
    ens: Any,
    x: np.ndarray,
    variant: str,
    *,
    backend: str = "thread",
    runner: asyncio.Runner | None = None,
) -> Callable[[], np.ndarray]:
    """A call of `ens` on `x` as one of `VARIANTS`, forking on `backend`;
    with `runner`, the call is ``await aiopar.fork(ens, x)`` on that event loop."""
    fork_models, fork_directions = VARIANTS[variant]

    def run() -> np.ndarray:
        ens.fork_models, ens.fork_directions = fork_models, fork_directions
        with aiopar.use_backend(backend):
            if runner is None:
                result: np.ndarray = ens(x)
                return result
            # the runner's own context predates use_backend: pass this one
            return runner.run(_awaited(ens, x), context=contextvars.copy_context())

    return run


async def _awaited(ens: Any, x: np.ndarray) -> np.ndarray:
    return await aiopar.fork(ens, x)


@dataclass(eq=False)
class Row:
    """One timed row; its speed-ups are paired with `anchor`'s times (None: it is an anchor).

    With `blas_threads`, every task of the row (and its caller) uses that many
    intra-op threads; the setting is made before the timed call and undone after.
    """

    name: str
    run: Callable[[], object]
    anchor: Row | None = None
    blas_threads: int | None = None
    times: list[float] = field(default_factory=list)

    def call(self) -> tuple[object, float]:
        """Run once: the result and the seconds the call took."""
        blas = self.blas_threads
        with contextlib.nullcontext() if blas is None else aiopar.num_threads(blas):
            start = time.perf_counter()
            result = self.run()
            return result, time.perf_counter() - start

    def speedup(self) -> Spread | None:
        """This row's speed-ups over its anchor, round by round (None for an anchor)."""
        return None if self.anchor is None else Spread.paired(self.anchor.times, self.times)


def timed_round(rows: Sequence[Row], pause: float) -> Iterator[Row]:
    """Run every row once, in turn, each after `pause` seconds, appending to ``row.times``.

    Yields each row after its timed run, for a progress display.
    """
    for row in rows:
        time.sleep(pause)
        row.times.append(row.call()[1])
        yield row


@dataclass(frozen=True)
class Spread:
    """Speed-ups over an anchor, one per round: anchor's time / row's time, above 1 is faster."""

    ratios: tuple[float, ...]

    @classmethod
    def paired(cls, anchor: Sequence[float], times: Sequence[float]) -> Spread:
        if not times or len(anchor) != len(times):
            raise ValueError(
                f"need one time per round for the row and its anchor, "
                f"got {len(times)} and {len(anchor)}"
            )
        return cls(tuple(a / t for a, t in zip(anchor, times, strict=True)))

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    @property
    def low(self) -> float:
        return min(self.ratios)

    @property
    def high(self) -> float:
        return max(self.ratios)

    @property
    def wins(self) -> int:
        """Rounds in which the row was faster than its anchor, as printed (to 2 decimals)."""
        return sum(round(r, 2) > 1 for r in self.ratios)

    @property
    def outcome(self) -> str:
        """`faster` or `slower` if every round says so as printed, else `level` (within noise).

        Judged on the printed figures (2 decimals), so a round shown as 1.00x
        never counts for either side.
        """
        if round(self.low, 2) > 1:
            return "faster"
        if round(self.high, 2) < 1:
            return "slower"
        return "level"

    @property
    def range(self) -> str:
        return f"{self.low:.2f}\N{EN DASH}{self.high:.2f}x"

    def __str__(self) -> str:
        return f"{self.median:.2f}x"


def _every(n: int) -> str:
    return {1: "the 1 round", 2: "both rounds"}.get(n, f"all {n} rounds")


def verdict(speedups: Mapping[str, Spread], anchor: str = "sequential") -> str:
    """One line naming the fastest of `speedups` (each over `anchor`) by median, and whether it won.

    The row named is always the one with the highest median. It won if it was
    faster than `anchor` in every round; `anchor` won if every variant was
    slower in every round; anything else is level within noise.
    """
    if not speedups:
        raise ValueError("verdict needs at least one variant's speed-ups")
    name, s = max(speedups.items(), key=lambda item: item[1].median)
    n = max(len(s.ratios) for s in speedups.values())
    if s.outcome == "faster":
        return f"Verdict: {name} won, {s} as fast as {anchor} (faster in {_every(n)}: {s.range})."
    if all(other.outcome == "slower" for other in speedups.values()):
        return (
            f"Verdict: {anchor} won; the fastest other variant, {name}, ran at {s} "
            f"(slower in {_every(n)}: {s.range})."
        )
    return (
        f"Verdict: level within noise; the fastest other variant, {name}, ran at {s} "
        f"but was faster in only {s.wins} of {n} rounds ({s.range})."
    )


#: a GEMM peak that moved by more than this fraction within one run shows a busy machine
PEAK_DRIFT = 0.2


def busy_signs(
    speedups: Iterable[Spread], cores: int, peaks: Sequence[float], of_peak: Iterable[float]
) -> list[str]:
    """What in a run's own figures shows the machine was busy, one phrase each (none: []).

    A speed-up beyond `cores` cannot come from running side by side; a GEMM
    peak (`peaks`, measured in the run, in order) that moved by more than
    `PEAK_DRIFT` of the lower, or a row above the peak (`of_peak`, fractions
    of the highest), shows the cores' speed changed under the run.
    """
    signs = []
    beyond = max((s.high for s in speedups), default=0.0)
    if beyond > cores:
        signs.append(f"a speed-up of {beyond:.2f}x on {cores} cores")
    if peaks and max(peaks) > min(peaks) * (1 + PEAK_DRIFT):
        shown = " then ".join(f"{p / 1e9:.0f}" for p in peaks)
        signs.append(f"the GEMM peak measured {shown} GFLOP/s")
    above = max(of_peak, default=0.0)
    if above > 1:
        signs.append(f"a row at {above:.0%} of that peak")
    return signs


def explain(interop: Spread, blas: Spread, cores: int, tasks: int, busy: Sequence[str] = ()) -> str:
    """Why the forks gained what they did, from the rows at 1 BLAS thread each.

    `interop` is the forked run over the sequential one, both at 1 BLAS
    thread; `blas` is the sequential run with the default BLAS threads over
    the one with 1; `tasks` is how many forked tasks could run at once;
    `busy` is what `busy_signs` found, and if anything, it is the reason given.
    """
    if busy:
        return (
            f"Why: the machine was busy while this ran ({'; '.join(busy)}), so these figures "
            f"are not to be trusted; run it again when the machine is idle."
        )
    ideal = min(cores, tasks)
    if ideal <= 1:
        return (
            f"Why: with {cores} core{'s' if cores != 1 else ''} and {tasks} task(s) at a "
            f"time nothing can run side by side, so forking only adds its overhead here."
        )
    alone = (
        f"forking alone (1 BLAS thread each) ran {interop} as fast as sequential "
        f"({interop.range}), of an ideal {ideal}x on {cores} cores"
    )
    if interop.median < 1 + (ideal - 1) / 2:
        if blas.median >= 1:
            return (
                f"Why: {alone}, less than half the gain: other programs are probably busy on "
                f"these cores (or the runs are too short to pay for a fork), so every figure "
                f"here is noisy; run it again when the machine is idle."
            )
        return (
            f"Why: {alone}, less than half the gain, and sequential ran only {blas} as fast "
            f"with its default BLAS threads as with 1: other programs are probably busy on "
            f"these cores, and a multi-threaded product waits for its slowest thread, so "
            f"every figure here is noisy; run it again when the machine is idle."
        )
    if blas.median > _BLAS_GAIN:
        return (
            f"Why: {alone}; but BLAS already spreads each matrix product over the cores "
            f"(sequential ran {blas} as fast with its default threads as with 1), so the "
            f"forks win only what BLAS leaves idle."
        )
    if blas.median >= 1:
        return (
            f"Why: {alone}; BLAS's own threads gained little here (sequential ran {blas} as "
            f"fast with its default threads as with 1), so the cores are the forks' to use."
        )
    return (
        f"Why: {alone}; but sequential ran only {blas} as fast with its default BLAS threads "
        f"as with 1: other programs are probably busy on these cores, and a multi-threaded "
        f"product waits for its slowest thread, so the forked rows look better than the "
        f"cores allow; run it again when the machine is idle."
    )
