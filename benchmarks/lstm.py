"""The TorchScript parallelism tutorial's LSTM ensemble: aiopar.nn beside TorchScript, one run.

    python benchmarks/lstm.py            # T, B, C = 50, 50, 1024, 4 models, 5 rounds
    python benchmarks/lstm.py --quick    # small sizes, a smoke test
    python benchmarks/lstm.py --engines  # only the engines and TorchScript's forked ensemble

It measures the way `aiopar demo` does, with the same helper
(``aiopar/_demo.py``): every row runs once per round, in turn, after a
pause for the BLAS/OpenMP threads of the row before to stop spinning; each
row's speed-up is its anchor's time divided by its own in the same round
(above 1x: faster), shown as the median and range over the rounds. The
anchors are aiopar's sequential run, TorchScript's, and aiopar's sequential
run at 1 BLAS thread for the rows that isolate inter-op parallelism (every
task pinned to 1 BLAS thread with ``aiopar.set_num_threads(1)``). The float32
GEMM peak is measured in every round and the best is used for "of peak".
TorchScript's variants (the tutorial's modules, scripted, run under
``torch.no_grad()``) are included when torch is importable; aiopar's run on
the "thread" backend and on "openmp" when it is available. aiopar's default
configuration runs once per LSTM engine that loads here (numpy, and oneDNN
with ``aiopar[onednn]``), right after TorchScript's rows and against its
forked ensemble, and oneDNN's against numpy's too; the other aiopar rows
run on the engine ``auto`` picks. Odd rounds run the rows last to first, so
no row always follows the same one.
Every row shows CPU time beside wall time: on a busy machine wall time
swings with what else runs, CPU time much less.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
from rich.console import Console
from rich.table import Table
from threadpoolctl import threadpool_info, threadpool_limits

import aiopar
from aiopar._demo import (
    VARIANTS,
    Row,
    Spread,
    available_cores,
    busy_signs,
    ensemble_flops,
    ensemble_run,
    explain,
    gemm_peak,
    spin_pause,
    timed_round,
    verdict,
)
from aiopar.nn import LSTMEnsemble, set_lstm_engine

# --quick: a token pause, the runs are tiny.
QUICK_SPIN_PAUSE = 0.01


def effective_cores(n: int = 768, reps: int = 12) -> float:
    """How many cores this process gets right now: two single-threaded GEMM loops
    side by side against one alone (2.0 on an idle 2-core machine)."""
    rng = np.random.default_rng(1)
    a = rng.random((n, n), dtype=np.float32)

    def work() -> None:
        for _ in range(reps):
            np.matmul(a, a)

    with threadpool_limits(1):
        work()
        start = time.perf_counter()
        work()
        alone = time.perf_counter() - start
        threads = [threading.Thread(target=work) for _ in range(2)]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        together = time.perf_counter() - start
    return 2 * alone / together


def torch_rows(n_models: int, size: int, x: np.ndarray, ens: LSTMEnsemble) -> list[Row]:
    """The tutorial's modules scripted with TorchScript, weights copied into `ens`."""
    try:
        import torch
    except ImportError:
        return []

    class BidirectionalRecurrentLSTM(torch.nn.Module):
        def __init__(self, fork: bool) -> None:
            super().__init__()
            self.fork = fork
            self.cell_f = torch.nn.LSTM(input_size=size, hidden_size=size)
            self.cell_b = torch.nn.LSTM(input_size=size, hidden_size=size)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.fork:
                future_f = torch.jit.fork(self.cell_f, x)
                output_b, _ = self.cell_b(torch.flip(x, dims=[0]))
                output_b_rev = torch.flip(output_b, dims=[0])
                output_f, _ = torch.jit.wait(future_f)
            else:
                output_f, _ = self.cell_f(x)
                output_b, _ = self.cell_b(torch.flip(x, dims=[0]))
                output_b_rev = torch.flip(output_b, dims=[0])
            return torch.cat((output_f, output_b_rev), dim=2)

    class LSTMEnsembleTorch(torch.nn.Module):
        def __init__(self, fork_models: bool, fork_directions: bool) -> None:
            super().__init__()
            self.fork_models = fork_models
            self.models = torch.nn.ModuleList(
                [BidirectionalRecurrentLSTM(fork_directions) for _ in range(n_models)]
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            results: list[torch.Tensor] = []
            if self.fork_models:
                futures: list[torch.jit.Future[torch.Tensor]] = []
                for model in self.models:
                    futures.append(torch.jit.fork(model, x))
                for future in futures:
                    results.append(torch.jit.wait(future))
            else:
                for model in self.models:
                    results.append(model(x))
            return torch.stack(results).sum(dim=0)

    import warnings

    torch.manual_seed(0)
    x_t = torch.from_numpy(x)
    rows = []
    state = None
    for label, (fork_models, fork_directions) in VARIANTS.items():
        module = LSTMEnsembleTorch(fork_models, fork_directions)
        if state is None:
            state = module.state_dict()
            ens.load_state_dict({k: v.numpy() for k, v in state.items()})
        module.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(module)

        def run(scripted=scripted) -> np.ndarray:
            with torch.no_grad():
                return scripted(x_t).numpy()

        rows.append(Row(f"TorchScript {label}", run, anchor=rows[0] if rows else None))
    return rows


def on_engine(engine: str, run: Callable[[], np.ndarray]) -> Callable[[], np.ndarray]:
    """`run` with the LSTM engine `engine` (chosen once, so switching costs nothing)."""

    def on() -> np.ndarray:
        set_lstm_engine(engine)  # type: ignore[arg-type]
        return run()

    return on


def engine_rows(ens: LSTMEnsemble, x: np.ndarray, anchor: Row | None) -> list[Row]:
    """aiopar's default configuration (models forked, thread backend) on each
    LSTM engine that loads here, against `anchor`."""
    engines = ["numpy"]
    if set_lstm_engine("onednn") == "onednn":  # it loaded and passed its self-test
        engines.append("onednn")
    default = ensemble_run(ens, x, "models forked")
    return [
        Row(f"aiopar default, {engine} engine", on_engine(engine, default), anchor=anchor)
        for engine in engines
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5)")
    parser.add_argument("--no-torch", action="store_true", help="skip TorchScript")
    parser.add_argument(
        "--engines",
        action="store_true",
        help="only aiopar's default on each LSTM engine and TorchScript's forked ensemble",
    )
    args = parser.parse_args()
    steps, batch, size, n_models = (10, 8, 64, 2) if args.quick else (50, 50, 1024, 4)
    rounds = args.rounds or (2 if args.quick else 5)
    peak_n = 512 if args.quick else 4096

    console = Console(width=None if sys.stdout.isatty() else 140)
    x = np.random.default_rng(0).random((steps, batch, size), dtype=np.float32)
    ens = LSTMEnsemble(n_models, size, size, seed=0)
    torch_variants = [] if args.no_torch else torch_rows(n_models, size, x, ens)
    if args.engines and torch_variants:  # the anchor only: its forked ensemble
        torch_variants = [dataclasses.replace(torch_variants[-1], anchor=None)]
    # torch loads an OpenMP runtime, whose threads spin longer: measure the pause after it
    spin = QUICK_SPIN_PAUSE if args.quick else spin_pause()

    # aiopar's default on each engine right after TorchScript's rows, against
    # its forked ensemble: the contenders alternate within every round.
    engines = engine_rows(ens, x, torch_variants[-1] if torch_variants else None)
    sequential = Row("aiopar sequential", on_engine("auto", ensemble_run(ens, x, "sequential")))
    rows = [*torch_variants, *engines, sequential]
    backends = [b for b in ("thread", "openmp") if b in aiopar.available_backends()]
    forked = list(VARIANTS)[1:]
    for backend in [] if args.engines else backends:
        for label in forked:
            run = on_engine("auto", ensemble_run(ens, x, label, backend=backend))
            rows.append(Row(f"aiopar {label} on {backend}", run, anchor=sequential))
    # Inter-op alone: with every task at 1 BLAS thread, only the forks use more cores.
    single = Row(
        "aiopar sequential, 1 BLAS thread",
        on_engine("auto", ensemble_run(ens, x, "sequential")),
        blas_threads=1,
    )
    if not args.engines:
        rows.append(single)
        for label in forked:
            run = on_engine("auto", ensemble_run(ens, x, label))
            rows.append(Row(f"aiopar {label}, 1 BLAS thread", run, anchor=single, blas_threads=1))

    # Warm up (scripting, allocator, packed weights) and check every variant agrees.
    outputs = [row.call()[0] for row in rows]
    reference = outputs[len(torch_variants) + len(engines)]
    worst = max(float(np.abs(out - reference).max()) for out in outputs)
    for row in torch_variants:  # TorchScript's profiling executor optimises on the second run
        row.call()

    peaks, cores = [], []
    for r in range(rounds):
        peaks.append(gemm_peak(peak_n))
        cores.append(effective_cores())
        for _ in timed_round(rows, spin, reverse=r % 2 == 1):
            pass
        console.print(f"round {r + 1}/{rounds} done", style="dim")

    peak = max(peaks)
    flops = ensemble_flops(n_models, steps, batch, size, size)
    torch_sequential = torch_variants[0] if torch_variants and not args.engines else None

    table = Table(
        title=(
            f"LSTM ensemble: {n_models} models, T, B, C = {steps}, {batch}, {size}; "
            f"{flops / 1e9:.1f} GFLOP; {rounds} rounds"
        ),
        caption="speed-up: the anchor's time / the row's in the same round (above 1x: "
        "faster), median and range over the rounds; each section's first row is its anchor "
        "(aiopar's default on each engine: TorchScript's forked ensemble); CPU s: median CPU "
        "seconds of this process, CPU speed-up: the anchor's / the row's, median",
    )
    table.add_column("variant", no_wrap=True)
    table.add_column("best s", justify="right")
    table.add_column("median s", justify="right")
    table.add_column("GFLOP/s", justify="right")
    table.add_column("of peak", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("range", justify="right")
    table.add_column("CPU s", justify="right")
    table.add_column("CPU speed-up", justify="right")
    if torch_sequential is not None:
        table.add_column("vs TorchScript sequential", justify="right")
    for row in rows:
        if row.anchor is None and row is not rows[0]:
            table.add_section()
        best = min(row.times)
        speedup = row.speedup()
        cells = [
            row.name,
            f"{best:.3f}",
            f"{statistics.median(row.times):.3f}",
            f"{flops / best / 1e9:.0f}",
            f"{flops / best / peak:.0%}",
            "anchor" if speedup is None else str(speedup),
            "" if speedup is None else speedup.range,
            f"{statistics.median(row.cpu_times):.3f}",
            "" if row.anchor is None else str(Spread.paired(row.anchor.cpu_times, row.cpu_times)),
        ]
        if torch_sequential is not None:
            cells.append(str(Spread.paired(torch_sequential.times, row.times)))
        table.add_row(*cells)
    console.print(table)
    pairs = [(row, row.anchor) for row in engines if row.anchor is not None]
    pairs += [(row, engines[0]) for row in engines[1:]]  # oneDNN's against numpy's
    for row, anchor in pairs:
        wall = Spread.paired(anchor.times, row.times)
        console.print(
            f"{row.name} vs {anchor.name}: {wall} wall ({wall.range}), "
            f"{Spread.paired(anchor.cpu_times, row.cpu_times)} CPU time"
        )
    if not args.engines:
        aiopar_forked = {r.name: r.speedup() for r in rows if r.anchor is sequential}
        console.print(verdict(aiopar_forked, anchor="aiopar sequential"))
        if torch_variants:
            torch_forked = {r.name: r.speedup() for r in torch_variants[1:]}
            console.print(verdict(torch_forked, anchor="TorchScript sequential"))
        interop = next(r for r in rows if r.anchor is single and "models" in r.name)
        blas = Spread.paired(single.times, sequential.times)
        speedups = [spread for spread in (r.speedup() for r in rows) if spread is not None]
        of_peak = [flops / min(r.times) / peak for r in rows]
        busy = busy_signs(speedups, available_cores(), peaks, of_peak)
        console.print(
            explain(interop.speedup(), blas, available_cores(), tasks=2 * n_models, busy=busy)
        )

    blas_libraries = ", ".join(
        f"{i['internal_api']} {i['version']} ({i['num_threads']} threads)"
        for i in threadpool_info()
    )
    console.print(
        f"float32 GEMM peak ({peak_n}^3 matmul, best of {rounds} rounds): "
        f"{peak / 1e9:.0f} GFLOP/s; {flops / 1e9:.1f} GFLOP need at least "
        f"{flops / peak:.2f} s at peak"
    )
    console.print(
        "cores available to this run (two 1-thread GEMM loops vs one), per round: "
        + ", ".join(f"{c:.2f}" for c in cores)
    )
    console.print(f"max |difference| between variants: {worst:.2e}")
    console.print(
        f"{platform.processor() or platform.machine()}, {aiopar.get_num_interop_threads()} "
        f"interop workers, numpy {np.__version__}, BLAS: {blas_libraries}"
    )
    if torch_variants:
        import torch

        console.print(
            f"torch {torch.__version__}: {torch.get_num_threads()} intra-op threads, "
            f"{torch.get_num_interop_threads()} interop threads"
        )
    missing = [b for b in ("openmp",) if b not in backends]
    if missing and not args.engines:
        console.print(f"backends not available, rows skipped: {', '.join(missing)}")


if __name__ == "__main__":
    main()
