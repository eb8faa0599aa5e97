"""The "process" backend against concurrent.futures.ProcessPoolExecutor and loky.

Rows, each measured in this one run; the contenders take turns round by
round (so they see the same machine load) and each gets its median:

- small tasks, batched: submit N tiny calls, then wait for all of them;
- small tasks, sequential: submit one, wait for it, repeat;
- a 100 MB float64 array as the argument (the result is a number);
- a 100 MB array argument and a 100 MB array result (the task returns its
  argument, so only the transport is measured);
- what travels in the pickle: an 80 MB ``bytes`` argument, and a 64 MB
  ``bytes`` result;
- arrays where a plain pickle keeps them in-band: a 100 MB array captured by
  the function (a closure for aiopar and loky; ``functools.partial`` for
  ProcessPoolExecutor, whose pickle cannot carry a closure), and a strided
  (non-contiguous) 100 MB slice;
- map of 10,000 small calls, against ProcessPoolExecutor.map with its own
  default chunksize (1) and with aiopar's (four chunks per worker);
- a plain 100 MB memcpy (``np.copyto`` into a warm buffer) as the anchor.

Every pool has two workers and is warmed up before it is timed. The task
functions are defined in this script (``__main__``), as in a user's script:
aiopar sends them by value (cloudpickle), ProcessPoolExecutor by reference
(its workers are forked from this process). loky's row is skipped when it is
not installed.

Each row shows the median wall time and CPU time per task; CPU time is
this process's (every thread) plus that of every worker process, so it
counts the work a round trip costs wherever it runs, and holds steady on a
busy machine where wall time does not. The last columns are each contender's time over
aiopar's, wall and CPU (above 1: aiopar is faster), the median of the
ratios of neighbouring turns; or aiopar's wall time in memcpys of the same
size.

Run: ``python benchmarks/process.py [--rounds 5] [--small 2000]``
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any, NamedTuple

import numpy as np

import aiopar

MB = 1_000_000


def small(x: int) -> int:
    return x + 1


def first_item(a: np.ndarray) -> float:
    return float(a[0])


def echo(a: np.ndarray) -> np.ndarray:
    return a


def make_bytes(n: int) -> bytes:
    return b"x" * n


def batched(submit: Callable[..., Any], n: int) -> Callable[[], None]:
    def run() -> None:
        futures = [submit(small, i) for i in range(n)]
        for fut in futures:
            fut.result()

    return run


def sequential(submit: Callable[..., Any], n: int) -> Callable[[], None]:
    def run() -> None:
        for i in range(n):
            submit(small, i).result()

    return run


def one_call(submit: Callable[..., Any], fn: Callable[..., Any], *args: Any) -> Callable[[], None]:
    def run() -> None:
        result = submit(fn, *args).result()
        del result

    return run


def child_pids() -> list[int]:
    """This process's children (the pools' workers)."""
    me, pids = str(os.getpid()), []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and f.read().rsplit(")", 1)[1].split()[1] == me:
                    pids.append(int(entry))
        except (OSError, IndexError):
            continue
    return pids


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds used so far by this process and by the processes ``pids``
    (every thread of each; nanosecond counts from /proc/PID/task/TID/schedstat)."""
    total = time.process_time()
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
        except OSError:
            continue  # gone meanwhile
    return total


class Timing(NamedTuple):
    """One contender's median seconds in a row, and the median over rounds of
    its time over aiopar's in the same round (pairs of neighbours in time:
    drift on a shared machine cancels out)."""

    wall: float
    cpu: float
    wall_ratio: float
    cpu_ratio: float


def median_times(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, Timing]:
    """Time each run ``rounds`` times after one warm-up call each, the runs
    taking turns round by round."""
    for run in runs.values():
        run()
    pids = child_pids()
    walls: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            cpu = cpu_seconds(pids)
            start = time.perf_counter()
            run()
            walls[name].append(time.perf_counter() - start)
            cpus[name].append(cpu_seconds(pids) - cpu)
    ours_wall, ours_cpu = walls.get("aiopar"), cpus.get("aiopar")

    def ratio(mine: list[float], ours: list[float] | None) -> float:
        if ours is None:
            return math.nan
        return statistics.median(m / o for m, o in zip(mine, ours, strict=True))

    return {
        name: Timing(
            statistics.median(walls[name]),
            statistics.median(cpus[name]),
            ratio(walls[name], ours_wall),
            ratio(cpus[name], ours_cpu),
        )
        for name in runs
    }


def closure_over(array: np.ndarray) -> Callable[[], float]:
    def first() -> float:
        return float(array[0])

    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per row")
    parser.add_argument("--small", type=int, default=2000, help="small tasks per round")
    parser.add_argument("--map", type=int, default=10_000, help="items mapped per round")
    options = parser.parse_args()
    rounds, n = options.rounds, options.small

    array = np.random.default_rng(0).random(100 * MB // 8)  # 100 MB of float64
    target = np.empty_like(array)
    strided = np.random.default_rng(1).random(200 * MB // 8)[::2]  # 100 MB, every other item
    arg_bytes = b"y" * (80 * MB)

    pools: dict[str, Any] = {}
    pools["ProcessPoolExecutor"] = ProcessPoolExecutor(2)
    try:
        import loky

        pools["loky"] = loky.get_reusable_executor(max_workers=2)
    except ImportError:
        pass
    backend = aiopar.get_backend("process", max_workers=2)
    submits: dict[str, Callable[..., Any]] = {name: pool.submit for name, pool in pools.items()}
    submits["aiopar"] = backend.fork
    for submit in submits.values():  # start every worker before timing
        for fut in [submit(small, i) for i in range(4)]:
            fut.result()

    rows: list[tuple[str, str, Timing]] = []  # (row, contender, per task)
    # The small-task rows compare with the standard library only; their
    # rounds are short, so there are more of them.
    small_submits = {name: submit for name, submit in submits.items() if name != "loky"}
    small_rows = [
        ("small tasks, batched", batched, n),
        ("small tasks, sequential", sequential, n // 2),
    ]
    for row, shape, count in small_rows:
        runs = {name: shape(submit, count) for name, submit in small_submits.items()}
        for name, t in median_times(runs, 3 * rounds).items():
            rows.append((row, name, t._replace(wall=t.wall / count, cpu=t.cpu / count)))
    # map: ProcessPoolExecutor.map's own default chunksize (1), and aiopar's
    # (four chunks per worker, as multiprocessing.Pool.map picks it).
    chunk = -(-options.map // (4 * 2))  # as aiopar picks it for two workers
    mapped = range(options.map)
    maps: dict[str, Callable[[], Any]] = {
        "aiopar": lambda: [f.result() for f in backend.map(small, mapped)],
        "ProcessPoolExecutor": lambda: list(pools["ProcessPoolExecutor"].map(small, mapped)),
        f"ProcessPoolExecutor, chunksize {chunk}": lambda: list(
            pools["ProcessPoolExecutor"].map(small, mapped, chunksize=chunk)
        ),
    }
    row = f"map of {options.map:,} small items"
    for name, t in median_times(maps, rounds).items():
        rows.append((row, name, t._replace(wall=t.wall / options.map, cpu=t.cpu / options.map)))
    calls: list[tuple[str, dict[str, Callable[[], None]]]] = [
        (row, {name: one_call(submit, fn, arg) for name, submit in submits.items()})
        for row, fn, arg in [
            ("100 MB argument", first_item, array),
            ("100 MB argument + 100 MB result", echo, array),
            ("80 MB bytes argument", len, arg_bytes),
            ("64 MB bytes result", make_bytes, 64 * MB),
            ("100 MB strided slice argument", first_item, strided),
        ]
    ]
    captured = {
        name: one_call(submit, closure_over(array))
        for name, submit in submits.items()
        if name != "ProcessPoolExecutor"
    }
    captured["ProcessPoolExecutor"] = one_call(
        pools["ProcessPoolExecutor"].submit, functools.partial(first_item, array)
    )
    calls.append(("100 MB array the function captures", captured))
    for row, runs in calls:
        for name, t in median_times(runs, rounds).items():
            rows.append((row, name, t))
    memcpy = median_times({"memcpy": lambda: np.copyto(target, array)}, rounds)["memcpy"]
    rows.append(("memcpy 100 MB (anchor)", "numpy.copyto", memcpy))

    backend.shutdown()
    for pool in pools.values():
        pool.shutdown()

    print(f"{'row':34} {'contender':35} {'wall':>10} {'CPU':>10}  aiopar speed-up")
    print("-" * 118)
    for row, name, t in rows:
        if not math.isnan(t.wall_ratio) and name != "aiopar":
            ratio = f"{t.wall_ratio:9.2f}x {t.cpu_ratio:6.2f}x"
        elif row.startswith("100 MB") and name == "aiopar":
            ratio = f"{t.wall / memcpy.wall:9.1f} memcpy"
        else:
            ratio = ""
        print(f"{row:34} {name:35} {_duration(t.wall)} {_duration(t.cpu)}  {ratio}")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:7.1f} us" if seconds < 0.01 else f"{seconds * 1e3:7.1f} ms"


if __name__ == "__main__":
    main()
