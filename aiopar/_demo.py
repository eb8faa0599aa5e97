"""``aiopar demo``: the tutorial's LSTM ensemble timed in rounds, a verdict, and the report.

The demo and ``benchmarks/lstm.py`` measure the same way, with the pieces here:

* **rounds**: every row runs once per round, in turn, the order reversed
  every other round, so drift on a shared machine (other programs, turbo)
  hits every row alike and no row always follows the same neighbour;
* **a pause before each timed run**: BLAS and OpenMP pools keep their
  threads spinning for a while after their last call, and would slow
  whichever row came next;
* **wall and CPU time of every run**: the CPU time of this process (all its
  threads) holds steady when the machine is busy, while the wall time grows
  by the time the threads waited for a core;
* **speed-ups paired by round**: a row's time divided into its anchor's time
  of the same round (above 1: faster), reported as the median and range over
  the rounds, which cancels most drift and shows what is left of it;
* **no verdict on a busy machine**: when the run's own figures show that
  other programs took the cores, the demo names what showed it instead of a
  winner, since every speed-up then measures the other programs as much as
  the forks.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

import aiopar
from aiopar import profiler

if TYPE_CHECKING:
    import numpy as np

    from aiopar.nn import LSTMEnsemble

__all__ = [
    "DURATION",
    "GEMM_SIZE",
    "QUICK_ROUNDS",
    "ROUNDS",
    "ROUND_SECONDS",
    "SIZES",
    "VARIANTS",
    "CpuClock",
    "Demo",
    "Row",
    "Run",
    "Sizes",
    "Spread",
    "TraceError",
    "available_cores",
    "busy_signs",
    "conclusions",
    "cpu_clock",
    "ensemble_flops",
    "ensemble_run",
    "explain",
    "gemm_peak",
    "other_programs",
    "plan_text",
    "rounds_left",
    "run",
    "spin_pause",
    "timed_round",
    "verdict",
]


class Sizes(NamedTuple):
    """The ensemble's sizes: input ``(seq_len, batch, input_size)``, and its models' width."""

    seq_len: int
    batch: int
    input_size: int
    hidden_size: int
    models: int


#: the sizes of each kind of run: the default is the tutorial's model at a
#: quarter of its width (1/16 of its FLOPs)
SIZES = {
    "default": Sizes(50, 50, 256, 256, 4),
    "full": Sizes(50, 50, 1024, 1024, 4),  # the tutorial's sizes exactly
    "quick": Sizes(10, 4, 8, 16, 2),  # a smoke test: its times mean little
}
#: seconds of timed rounds to aim for, after the warm-up run of every row;
#: the number of rounds is what fits, within ROUNDS (--quick: QUICK_ROUNDS)
ROUND_SECONDS = {"default": 15.0, "full": 40.0}
ROUNDS = (3, 10)
QUICK_ROUNDS, QUICK_PAUSE = 2, 0.01
#: what the header promises, measured on 2 cores
DURATION = {"default": "about 20 s", "full": "about a minute on 2 cores", "quick": "about 2 s"}
#: the side of the matrix product that measures the float32 GEMM peak: small
#: enough to take a fraction of a second, large enough for BLAS to come close
#: to its peak (per CPU-second, 1024 ran within about 5% of 2048 on 2 cores)
GEMM_SIZE = {"default": 1024, "full": 2048, "quick": 512}

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


# -- measuring ---------------------------------------------------------------


def available_cores() -> int:
    """The cores this process may run on (``os.process_cpu_count()`` from Python 3.13)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
    import numpy as np

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
    ens: LSTMEnsemble,
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
                return ens(x)
            # the runner's own context predates use_backend: pass this one
            return runner.run(_awaited(ens, x), context=contextvars.copy_context())

    return run


async def _awaited(ens: LSTMEnsemble, x: np.ndarray) -> np.ndarray:
    return await aiopar.fork(ens, x)


class Run(NamedTuple):
    """One call of a row: what it returned, and the wall and CPU seconds it took."""

    result: object
    wall: float
    #: CPU time of this process, all its threads (work in other processes is not in it)
    cpu: float


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
    #: wall seconds of each timed run
    times: list[float] = field(default_factory=list)
    #: CPU seconds of each timed run
    cpu_times: list[float] = field(default_factory=list)

    def call(self) -> Run:
        """Run once, without recording the times."""
        blas = self.blas_threads
        with contextlib.nullcontext() if blas is None else aiopar.num_threads(blas):
            cpu, start = time.process_time(), time.perf_counter()
            result = self.run()
            wall = time.perf_counter() - start
            return Run(result, wall, time.process_time() - cpu)

    def speedup(self) -> Spread | None:
        """This row's speed-ups over its anchor, round by round (None for an anchor)."""
        return None if self.anchor is None else Spread.paired(self.anchor.times, self.times)

    @property
    def cores_used(self) -> list[float]:
        """CPU time over wall time of each timed run: how many cores this process kept busy."""
        return [cpu / wall for cpu, wall in zip(self.cpu_times, self.times, strict=True)]


def timed_round(rows: Sequence[Row], pause: float, *, reverse: bool = False) -> Iterator[Row]:
    """Run every row once, in turn (last to first with `reverse`), each after
    `pause` seconds, appending its wall and CPU time to the row.

    Yields each row after its timed run, for a progress display.
    """
    for row in reversed(rows) if reverse else rows:
        time.sleep(pause)
        _, wall, cpu = row.call()
        row.times.append(wall)
        row.cpu_times.append(cpu)
        yield row


class CpuClock(NamedTuple):
    """A reading of the clocks :func:`other_programs` compares."""

    wall: float
    #: seconds the cores this process may run on were busy, whoever kept them so
    busy: float
    #: CPU seconds of this process and its child processes (a process backend's workers)
    ours: float


def cpu_clock() -> CpuClock | None:
    """The clocks now; None when psutil, which reads them, is not installed."""
    try:
        import psutil  # type: ignore[import-untyped]
    except ImportError:
        return None
    me = psutil.Process()
    cores = sorted(getattr(me, "cpu_affinity", list)())
    per_core = psutil.cpu_times(percpu=True)
    if cores and cores[-1] < len(per_core):
        per_core = [per_core[i] for i in cores]
    # steal: the hypervisor ran another machine on the core
    fields = ("user", "nice", "system", "irq", "softirq", "steal")
    busy = sum(getattr(times, name, 0.0) for times in per_core for name in fields)
    ours = 0.0
    for process in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):  # a child that has just exited
            times = process.cpu_times()
            ours += times.user + times.system
    return CpuClock(time.perf_counter(), busy, ours)


def other_programs(before: CpuClock | None, after: CpuClock | None) -> float | None:
    """How many cores other programs kept busy, on average, from `before` to
    `after` (:func:`cpu_clock` readings); None if either is unknown."""
    if before is None or after is None:
        return None
    others = (after.busy - before.busy) - (after.ours - before.ours)
    return max(0.0, others) / max(after.wall - before.wall, 1e-9)


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


# -- the verdict -------------------------------------------------------------

#: a GEMM peak that moved by more than this fraction within one run shows a busy machine
PEAK_DRIFT = 0.2
#: a run of one thread that kept less than this of a core busy (median over
#: the rounds) spent the rest waiting for one
STARVED = 0.9
#: other programs that kept more cores than this busy, on average, took them from the rows
OTHERS = 0.25


def busy_signs(
    speedups: Iterable[Spread],
    cores: int,
    peaks: Sequence[float],
    of_peak: Iterable[float],
    *,
    single_thread: Sequence[float] = (),
    others: float | None = None,
) -> list[str]:
    """What in a run's own figures shows the machine was busy, one phrase each (none: []).

    `others` is how many cores other programs kept busy meanwhile (from
    :func:`other_programs`; None: not known), more than `OTHERS` is busy.
    `single_thread` is the cores a single-threaded row kept busy in each
    round (:attr:`Row.cores_used`): less than `STARVED` (median) means it
    waited for a core. A speed-up beyond `cores` cannot come from running
    side by side. A GEMM peak (`peaks`, measured in the run, in order) that
    moved by more than `PEAK_DRIFT` of the lower, or a row above the peak
    (`of_peak`, fractions of the highest), shows the cores' speed changed
    under the run.
    """
    signs = []
    if others is not None and others > OTHERS:
        signs.append(f"other programs kept {others:.2f} of the {cores} cores busy")
    if single_thread and (share := statistics.median(single_thread)) < STARVED:
        signs.append(f"the single-threaded sequential run got {share:.2f} of a core")
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


def _every(n: int) -> str:
    return {1: "the 1 round", 2: "both rounds"}.get(n, f"all {n} rounds")


def verdict(
    speedups: Mapping[str, Spread], anchor: str = "sequential", busy: Sequence[str] = ()
) -> str:
    """One line naming the fastest of `speedups` (each over `anchor`) by median, and whether it won.

    The row named is always the one with the highest median. It won if it was
    faster than `anchor` in every round; `anchor` won if every variant was
    slower in every round; anything else is level within noise. With `busy`
    (what :func:`busy_signs` found) there is no winner: the line says what
    showed the machine was busy instead.
    """
    if not speedups:
        raise ValueError("verdict needs at least one variant's speed-ups")
    if busy:
        return (
            f"No verdict: the machine was busy while this ran ({'; '.join(busy)}); "
            f"run it again when it is idle."
        )
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


# -- the run -----------------------------------------------------------------


class TraceError(Exception):
    """The trace could not be written (the message says why)."""


@dataclass(frozen=True)
class Demo:
    """What to run: a kind of `SIZES` (resized by the user or not), the
    backends to fork on, the rounds (None: as many as fit), a trace path."""

    kind: str
    sizes: Sizes
    backends: Sequence[str]
    rounds: int | None = None
    trace: Path | None = None
    resized: bool = False


def plan_text(kind: str, rounds: int | None, resized: bool) -> str:
    """What the demo is about to do, and how long it takes."""
    if kind == "quick":
        return (
            f"--quick: tiny sizes and {rounds or QUICK_ROUNDS} rounds, "
            f"a smoke test whose times mean little."
        )
    if rounds:
        what = f"{rounds} rounds"
    else:
        low, high = ROUNDS
        what = f"rounds ({low} to {high}, as many as fit in about {ROUND_SECONDS[kind]:.0f} s)"
    plan = f"one warm-up run of each row, then {what} of every row in turn"
    if rounds or resized:
        return f"Plan: {plan}; the progress bar shows the time left."
    if kind == "full":
        return f"The tutorial's sizes take {DURATION[kind]}: {plan}."
    return f"Takes {DURATION[kind]}: {plan}. --full runs the tutorial's sizes ({DURATION['full']})."


def rounds_left(done: int, round_seconds: float, seconds_left: float) -> int:
    """How many rounds to run in all, `done` of them run, if one takes `round_seconds`
    and the budget has `seconds_left`: as many as fit, within ROUNDS."""
    low, high = ROUNDS
    fit = done + int(max(seconds_left, 0.0) / max(round_seconds, 1e-9))
    return max(done, low, min(high, fit))


def run(demo: Demo, out: Console) -> int:
    """Run `demo`, reporting on `out`; the exit status (1: a row's output was wrong).

    Raises :class:`TraceError` if the trace cannot be written.
    """
    import numpy as np

    from aiopar.nn import LSTMEnsemble

    seq_len, batch, input_size, hidden, models = demo.sizes
    cores = available_cores()
    quick = demo.kind == "quick"
    pause = QUICK_PAUSE if quick else spin_pause()
    flops = ensemble_flops(models, seq_len, batch, input_size, hidden)
    out.print(
        f"[bold]aiopar demo[/]: the LSTM ensemble of the TorchScript parallelism tutorial, in "
        f"numpy: {models} bidirectional LSTMs, input (T, B, C) = ({seq_len}, {batch}, "
        f"{input_size}), hidden {hidden}; {_flop_text(flops)} a run; "
        f"forks on {', '.join(demo.backends)}; {cores} cores."
    )
    out.print(plan_text(demo.kind, demo.rounds, demo.resized))

    ens = LSTMEnsemble(models, input_size, hidden, seed=0)
    x = np.random.default_rng(0).random((seq_len, batch, input_size), dtype=np.float32)
    prof = None
    with asyncio.Runner() as loop, _progress() as progress:
        rows = _rows(ens, x, demo.backends, loop)
        bar = progress.add_task("GEMM peak", total=None)
        before = cpu_clock()
        peak = gemm_peak(GEMM_SIZE[demo.kind])
        # The warm-up starts threads and workers, gives every row's output
        # for the check, and tells how long a round may take.
        progress.update(bar, description="warm-up: one run of each row")
        start = time.perf_counter()
        outputs = []
        for row in rows:
            time.sleep(pause)
            outputs.append(np.asarray(row.call().result))
        rounds = _run_rounds(
            rows,
            pause,
            progress,
            bar,
            rounds=demo.rounds or (QUICK_ROUNDS if quick else None),
            seconds=ROUND_SECONDS.get(demo.kind, 0.0),
            warm_up=time.perf_counter() - start,
        )
        others = other_programs(before, cpu_clock())
        if demo.trace is not None:
            progress.update(bar, description="a traced models-forked run")
            with profiler.profile() as prof:
                ensemble_run(ens, x, "models forked", backend=demo.backends[0])()

    matches = [bool(np.allclose(o, outputs[0], rtol=1e-4, atol=1e-5)) for o in outputs]
    out.print(_table(rows, matches, rounds, flops, peak, others, cores))
    status = 0
    if all(matches):
        out.print("Every row's output matches the sequential run.")
    else:
        out.print("[bold red]Outputs differ from the sequential run (marked ✗).[/]")
        status = 1
    verdict_line, *why = conclusions(rows, cores, flops, peak, others, tasks=2 * models)
    out.print(verdict_line, style="bold")
    for line in why:
        out.print(line)
    if prof is not None and demo.trace is not None:
        try:
            prof.export_chrome_trace(demo.trace)
        except OSError as exc:
            raise TraceError(f"cannot write the trace to {str(demo.trace)!r}: {exc}") from None
        out.print(prof.rich_table())
        out.print(
            f"Trace of a models-forked run on {demo.backends[0]}: {demo.trace} "
            f"({len(prof.records)} tasks); open it in https://ui.perfetto.dev or chrome://tracing",
            soft_wrap=True,
        )
    return status


def conclusions(
    rows: Sequence[Row],
    cores: int,
    flops: float,
    peak: float,
    others: float | None,
    tasks: int,
) -> list[str]:
    """The verdict on the timed `rows` (as :func:`run` makes them: sequential
    first, the inter-op pair last), then why, unless the machine was busy.

    `flops` is what one run computes, `peak` the GEMM peak measured in the
    run, `others` the cores other programs kept busy meanwhile (None: not
    known), `tasks` how many forked tasks could run at once.
    """
    sequential, single, interop = rows[0], rows[-2], rows[-1]
    speedups = {row.name: s for row in rows if (s := row.speedup()) is not None}
    busy = busy_signs(
        speedups.values(),
        cores,
        [peak],
        [flops / min(row.times) / peak for row in rows],
        single_thread=single.cores_used,
        others=others,
    )
    forked = {row.name: speedups[row.name] for row in rows if row.anchor is sequential}
    lines = [verdict(forked, busy=busy)]
    if not busy:
        pair = Spread.paired(single.times, interop.times)
        blas = Spread.paired(single.times, sequential.times)
        lines.append(explain(pair, blas, cores, tasks))
    return lines


def _rows(
    ens: LSTMEnsemble, x: np.ndarray, backends: Sequence[str], loop: asyncio.Runner
) -> list[Row]:
    """The rows: sequential (the anchor), the forked variants on each backend,
    then the inter-op pair, sequential (its anchor) and models forked, at 1
    BLAS thread each, where only the forks can use more than one core."""
    sequential = Row("sequential", ensemble_run(ens, x, "sequential"))
    rows = [sequential]
    for backend in backends:
        on = f" on {backend}" if len(backends) > 1 else ""
        for variant, runner, how in (
            ("directions forked", None, ""),
            ("models forked", None, ""),
            ("models forked", loop, " (awaited)"),
        ):
            run = ensemble_run(ens, x, variant, backend=backend, runner=runner)
            rows.append(Row(variant + on + how, run, anchor=sequential))
    single = Row("sequential, 1 BLAS thread", ensemble_run(ens, x, "sequential"), blas_threads=1)
    run = ensemble_run(ens, x, "models forked")
    rows += [single, Row("models forked, 1 BLAS thread", run, anchor=single, blas_threads=1)]
    return rows


def _run_rounds(
    rows: list[Row],
    pause: float,
    progress: Progress,
    bar: TaskID,
    *,
    rounds: int | None,
    seconds: float,
    warm_up: float,
) -> int:
    """Time rounds of `rows` and return how many ran: `rounds` if given, else as
    many as fit in `seconds` (within ROUNDS), judged from the `warm_up` at first
    and then from each round just timed, as the machine may be busy."""
    deadline = time.perf_counter() + seconds
    planned = rounds or rounds_left(0, warm_up, seconds)
    done = 0
    while done < planned:
        progress.update(
            bar, description=f"round {done + 1} of {planned}", total=planned * len(rows)
        )
        start = time.perf_counter()
        for _ in timed_round(rows, pause, reverse=done % 2 == 1):
            progress.advance(bar)
        done += 1
        if rounds is None:
            took, left = time.perf_counter() - start, deadline - time.perf_counter()
            planned = rounds_left(done, took, left)
    return done


def _progress() -> Progress:
    """A progress bar on stderr that leaves no trace once done (nothing when not a terminal)."""
    console = Console(stderr=True)
    return Progress(
        TextColumn("{task.description:<30}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=console,
        transient=True,
        disable=not console.is_terminal,
    )


def _flop_text(flops: float) -> str:
    return f"{flops / 1e9:.1f} GFLOP" if flops >= 1e8 else f"{flops / 1e6:.2f} MFLOP"


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _table(
    rows: list[Row],
    matches: list[bool],
    rounds: int,
    flops: float,
    peak: float,
    others: float | None,
    cores: int,
) -> Table:
    notes = [
        "best: the fastest round's wall time; CPU: that run's CPU time in this process, "
        "all threads; cores: CPU / wall",
        f"speed-up per round: the anchor's time / the row's (above 1x: faster); its median and "
        f"range over {rounds} rounds",
        f"float32 GEMM peak: {peak / 1e9:.0f} GFLOP/s",
    ]
    if others is not None:
        notes.append(f"other programs kept {others:.2f} of the {cores} cores busy meanwhile")
    table = Table(
        box=box.SIMPLE_HEAD, pad_edge=False, caption=". ".join(notes) + ".", caption_justify="left"
    )
    table.add_column("row", no_wrap=True)
    for column in ("best", "CPU", "cores", "speed-up", "range", "of peak"):
        table.add_column(column, justify="right")
    for row, ok in zip(rows, matches, strict=True):
        if row.anchor is None and row is not rows[0]:
            table.add_row("[dim italic]inter-op alone, on thread:[/]")
        spread = row.speedup()
        if spread is None:
            speedup, spread_text = "[dim]anchor[/]", ""
        else:
            style = {"faster": "green", "slower": "red", "level": ""}[spread.outcome]
            speedup = f"[{style}]{spread}[/]" if style else str(spread)
            spread_text = spread.range
        best = min(range(len(row.times)), key=row.times.__getitem__)
        wall, cpu = row.times[best], row.cpu_times[best]
        table.add_row(
            row.name + ("" if ok else " ✗"),
            _seconds(wall),
            _seconds(cpu),
            f"{cpu / wall:.2f}",
            speedup,
            spread_text,
            f"{flops / wall / peak:.0%}",
        )
    return table
