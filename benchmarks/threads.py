"""Inter-op vs intra-op threads: the tutorial's LSTM ensemble and parallel_for.

Runs, side by side in one process, the TorchScript tutorial's ensemble
(8 bidirectional LSTMs, T=50, B=50, C=1024 by default) in four thread
configurations:

* sequential, 2 BLAS threads (no forks; BLAS splits each product);
* 2 interop workers x 1 BLAS thread (the best manual split on 2 cores);
* 8 interop workers x 2 BLAS threads (a naive executor: oversubscribed);
* aiopar's default (forks on, nothing set: the thread budget decides);

then ``parallel_for`` over a 50M-element ``np.tanh`` against plain numpy, and
``parallel_for`` with one of two threads three times slower than the other
(chunks that sleep in proportion to their length) against the same work cut
into fixed halves and against the serial sleep.
Configurations alternate round by round so drift hits them alike; the table
shows the median of the rounds.

    python benchmarks/threads.py [--small] [--rounds N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import numpy as np
from _timing import round_times
from threadpoolctl import threadpool_info

import aiopar
from aiopar._budget import cores


def blas_threads() -> int:
    return max((lib["num_threads"] for lib in threadpool_info()), default=0)


def ensemble_configs(n_cores: int) -> list[tuple[str, dict]]:
    return [
        (f"sequential, {n_cores} BLAS threads", dict(fork=False, interop=n_cores, intra=n_cores)),
        (f"{n_cores} interop x 1 BLAS thread", dict(fork=True, interop=n_cores, intra=1)),
        (
            f"8 interop x {n_cores} BLAS threads (naive)",
            dict(fork=True, interop=8, intra=n_cores),
        ),
        ("aiopar default", dict(fork=True, interop=n_cores, intra=None)),
    ]


def run_ensemble(ens, x, *, fork: bool, interop: int, intra: int | None) -> float:
    ens.fork_models = fork
    ens.fork_directions = fork
    aiopar.set_num_interop_threads(interop)
    aiopar.set_num_threads(intra)
    start = time.perf_counter()
    ens(x)
    return time.perf_counter() - start


def bench_ensemble(size: tuple[int, int, int, int], rounds: int) -> None:
    n_models, steps, batch, channels = size
    ens = aiopar.nn.LSTMEnsemble(n_models, channels, channels, seed=0)
    x = np.random.default_rng(1).standard_normal((steps, batch, channels), dtype=np.float32)
    n_cores = cores()
    configs = ensemble_configs(n_cores)

    reference = None
    for _name, cfg in configs:  # warm up, and check every configuration agrees
        run_ensemble(ens, x, **cfg)
        out = ens(x)
        if reference is None:
            reference = out
        np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4)

    times: dict[str, list[float]] = {name: [] for name, _ in configs}
    for _ in range(rounds):
        for name, cfg in configs:
            times[name].append(run_ensemble(ens, x, **cfg))
    aiopar.set_num_threads(None)
    aiopar.set_num_interop_threads(n_cores)

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    best_manual = min(v for k, v in medians.items() if k != "aiopar default")
    naive = medians[configs[2][0]]
    default = medians["aiopar default"]
    print(
        f"\nLSTM ensemble: {n_models} models, T={steps}, B={batch}, C={channels}, "
        f"{n_cores} cores, median of {rounds} rounds"
    )
    print(f"  {'configuration':<36}{'time':>9}{'vs best manual':>16}")
    for name, t in medians.items():
        print(f"  {name:<36}{t:>8.3f}s{t / best_manual:>15.2f}x")
    print(f"  default / best manual: {default / best_manual:.3f} (target <= 1.05)")
    print(f"  naive / default:       {naive / default:.2f}x faster (target >= 1.5)")


def bench_parallel_for(n: int, rounds: int) -> None:
    x = np.random.default_rng(2).standard_normal(n)
    y = np.zeros_like(x)  # touched now, so no page faults inside the timings
    grain = 1 << 16

    def tanh_chunk(b: int, e: int) -> None:
        np.tanh(x[b:e], out=y[b:e])

    def serial() -> None:
        np.tanh(x, out=y)

    def parallel() -> None:
        aiopar.parallel_for(0, n, grain, tanh_chunk)

    serial()
    parallel()
    times: dict[str, list[float]] = {"numpy, 1 thread": [], "parallel_for": []}
    for _ in range(rounds):
        for name, fn in (("numpy, 1 thread", serial), ("parallel_for", parallel)):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    np.testing.assert_array_equal(y, np.tanh(x))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    threads = aiopar.get_num_threads()
    print(f"\nnp.tanh over {n / 1e6:g}M float64, grain {grain}, {threads} intra-op threads")
    for name, t in medians.items():
        print(f"  {name:<36}{t:>8.3f}s")
    speedup = medians["numpy, 1 thread"] / medians["parallel_for"]
    print(f"  parallel_for speed-up: {speedup:.2f}x (target >= 1.7 on 2 cores)")


def bench_slow_thread(serial: float, rounds: int) -> None:
    """One thread 3x slower than the other: taking chunks as threads finish vs fixed halves."""
    n = 1 << 12
    caller = threading.get_ident()

    def sleepy_chunk(b: int, e: int) -> None:
        slowdown = 1 if threading.get_ident() == caller else 3
        time.sleep(serial * (e - b) / n * slowdown)

    runs = {
        "serial sleep (anchor)": lambda: sleepy_chunk(0, n),
        "fixed halves (grain n/2)": lambda: aiopar.parallel_for(0, n, n // 2, sleepy_chunk),
        "parallel_for": lambda: aiopar.parallel_for(0, n, 1, sleepy_chunk),
    }
    aiopar.set_num_threads(2)  # two threads even where the budget would give one
    medians = {
        name: statistics.median(ts) for name, ts in round_times(runs, rounds, warm_up=False).items()
    }
    aiopar.set_num_threads(None)
    anchor = medians["serial sleep (anchor)"]
    print(f"\nparallel_for, 2 threads, the helper 3x slower (sleeps; {serial:g} s serial)")
    print(f"  {'run':<36}{'time':>9}{'vs serial':>11}")
    for name, t in medians.items():
        print(f"  {name:<36}{t:>8.3f}s{t / anchor:>10.2f}x")
    print("  ideal 0.75x (the fast thread does 3/4 of the range); fixed halves 1.50x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="quick sizes for development")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import aiopar.nn

    print(aiopar.parallel_info())
    size = (8, 20, 50, 256) if args.small else (8, 50, 50, 1024)
    bench_ensemble(size, args.rounds)
    bench_parallel_for(5_000_000 if args.small else 50_000_000, args.rounds)
    bench_slow_thread(0.2 if args.small else 0.8, args.rounds)


if __name__ == "__main__":
    main()
