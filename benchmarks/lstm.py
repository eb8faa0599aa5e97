"""The TorchScript parallelism tutorial's LSTM ensemble: aiopar.nn beside TorchScript, one run.

    python benchmarks/lstm.py            # T, B, C = 50, 50, 1024, 4 models, 5 rounds
    python benchmarks/lstm.py --quick    # small sizes, a smoke test

Every variant runs once per round, round-robin, and the best round counts, so
a machine whose speed drifts (shared cores, turbo) treats all variants alike;
the last column pairs each variant with aiopar's sequential run of the same
round (the median of those ratios), which cancels most of that drift. Each
timed run starts after a pause of 0.3 s: the BLAS and OpenMP pools of the
previous variant spin for up to about 0.2 s after their last call (OpenBLAS
0.1 s, Intel's OpenMP 0.2 s), and would otherwise slow whichever variant
came next.
The float32 GEMM peak is measured in every round with a large numpy matmul
and the best is used for "of peak". TorchScript's variants (the tutorial's
modules, scripted, run under ``torch.no_grad()``) are included when torch is
importable; aiopar's run on the "thread" backend and on "openmp" when it is
available. Forked aiopar variants use the library's default intra-op thread
budget; two more rows pin every task to one BLAS thread with
``aiopar.set_num_threads(1)`` for comparison.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from rich.console import Console
from rich.table import Table
from threadpoolctl import threadpool_info, threadpool_limits

import aiopar
from aiopar.nn import LSTMEnsemble

# Seconds to wait before each timed run, for the BLAS threads of the run
# before to stop spinning (--quick: a token pause, the runs are tiny).
SPIN_PAUSE, QUICK_SPIN_PAUSE = 0.3, 0.05

# The tutorial's three variants: (fork_models, fork_directions).
VARIANTS = {
    "sequential": (False, False),
    "directions forked": (False, True),
    "models forked": (True, True),
}


@dataclass
class Row:
    name: str
    run: Callable[[], object]
    times: list[float] = field(default_factory=list)
    torch: bool = False


def ensemble_flops(n_models: int, steps: int, batch: int, size: int) -> float:
    """Multiply-adds x 2 of the ensemble: input and recurrent products of 2 LSTMs per model."""
    per_lstm = steps * 2 * batch * 4 * size * (size + size)
    return float(n_models * 2 * per_lstm)


def gemm_peak(n: int) -> float:
    """float32 GEMM GFLOP/s of numpy's BLAS on an n x n product, best of 3."""
    rng = np.random.default_rng(0)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    out = np.empty_like(a)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best / 1e9


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

        rows.append(Row(f"TorchScript {label}", run, torch=True))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 2 rounds")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5)")
    parser.add_argument("--no-torch", action="store_true", help="skip TorchScript")
    args = parser.parse_args()
    steps, batch, size, n_models = (10, 8, 64, 2) if args.quick else (50, 50, 1024, 4)
    rounds = args.rounds or (2 if args.quick else 5)
    spin_pause = QUICK_SPIN_PAUSE if args.quick else SPIN_PAUSE
    peak_n = 512 if args.quick else 4096

    console = Console(width=None if sys.stdout.isatty() else 140)
    x = np.random.default_rng(0).random((steps, batch, size), dtype=np.float32)
    ens = LSTMEnsemble(n_models, size, size, seed=0)
    rows = [] if args.no_torch else torch_rows(n_models, size, x, ens)

    def aiopar_run(
        backend: str, fork_models: bool, fork_directions: bool, threads: int | None = None
    ) -> Callable[[], object]:
        def run() -> np.ndarray:
            ens.fork_models, ens.fork_directions = fork_models, fork_directions
            if threads is not None:
                aiopar.set_num_threads(threads)
            try:
                with aiopar.use_backend(backend):
                    return ens(x)
            finally:
                if threads is not None:
                    aiopar.set_num_threads(None)

        return run

    rows.append(Row("aiopar sequential", aiopar_run("thread", False, False)))
    backends = [b for b in ("thread", "openmp") if b in aiopar.available_backends()]
    for backend in backends:
        for label, flags in list(VARIANTS.items())[1:]:
            rows.append(Row(f"aiopar {label}, {backend}", aiopar_run(backend, *flags)))

    # For comparison with the automatic budget: every task limited to 1 BLAS thread.
    for label, flags in list(VARIANTS.items())[1:]:
        rows.append(Row(f"aiopar {label}, thread, 1 BLAS thread", aiopar_run("thread", *flags, 1)))

    # Warm up (scripting, allocator, packed weights) and check every variant agrees.
    outputs = {row.name: row.run() for row in rows}
    reference = outputs[next(r.name for r in rows if not r.torch)]
    worst = max(float(np.abs(out - reference).max()) for out in outputs.values())
    for row in rows:
        if row.torch:
            row.run()

    peaks, cores = [], []
    for r in range(rounds):
        peaks.append(gemm_peak(peak_n))
        cores.append(effective_cores())
        for row in rows:
            time.sleep(spin_pause)
            start = time.perf_counter()
            row.run()
            row.times.append(time.perf_counter() - start)
        console.print(f"round {r + 1}/{rounds} done", style="dim")

    peak = max(peaks)
    flops = ensemble_flops(n_models, steps, batch, size)
    torch_best = min((min(r.times) for r in rows if r.torch), default=None)
    sequential_times = next(r for r in rows if r.name == "aiopar sequential").times
    sequential = min(sequential_times)

    table = Table(
        title=(
            f"LSTM ensemble: {n_models} models, T, B, C = {steps}, {batch}, {size}; "
            f"{flops / 1e9:.1f} GFLOP; best of {rounds}"
        )
    )
    table.add_column("variant")
    table.add_column("best s", justify="right")
    table.add_column("median s", justify="right")
    table.add_column("GFLOP/s", justify="right")
    table.add_column("of peak", justify="right")
    table.add_column("/ TorchScript best", justify="right")
    table.add_column("/ aiopar sequential", justify="right")
    table.add_column("/ sequential, paired", justify="right")
    for row in rows:
        best = min(row.times)
        paired = statistics.median(t / s for t, s in zip(row.times, sequential_times, strict=True))
        table.add_row(
            row.name,
            f"{best:.3f}",
            f"{statistics.median(row.times):.3f}",
            f"{flops / best / 1e9:.0f}",
            f"{flops / best / 1e9 / peak:.0%}",
            "-" if torch_best is None else f"{best / torch_best:.2f}x",
            "-" if row.torch else f"{best / sequential:.2f}x",
            f"{paired:.2f}x",
        )
    console.print(table)

    blas = ", ".join(
        f"{i['internal_api']} {i['version']} ({i['num_threads']} threads)"
        for i in threadpool_info()
    )
    console.print(
        f"float32 GEMM peak ({peak_n}^3 matmul, best of {rounds} rounds): {peak:.0f} GFLOP/s; "
        f"{flops / 1e9:.1f} GFLOP need at least {flops / 1e9 / peak:.2f} s at peak"
    )
    console.print(
        "cores available to this run (two 1-thread GEMM loops vs one), per round: "
        + ", ".join(f"{c:.2f}" for c in cores)
    )
    console.print(f"max |difference| between variants: {worst:.2e}")
    console.print(
        f"{platform.processor() or platform.machine()}, {aiopar.get_num_interop_threads()} "
        f"interop workers, numpy {np.__version__}, BLAS: {blas}"
    )
    if any(r.torch for r in rows):
        import torch

        console.print(
            f"torch {torch.__version__}: {torch.get_num_threads()} intra-op threads, "
            f"{torch.get_num_interop_threads()} interop threads"
        )
    missing = [b for b in ("openmp",) if b not in backends]
    if missing:
        console.print(f"backends not available, rows skipped: {', '.join(missing)}")


if __name__ == "__main__":
    main()
