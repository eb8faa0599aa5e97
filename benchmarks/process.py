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
- a plain 100 MB memcpy (``np.copyto`` into a warm buffer) as the anchor.

Every pool has two workers and is warmed up before it is timed. The task
functions are defined in this script (``__main__``), as in a user's script:
aiopar sends them by value (cloudpickle), ProcessPoolExecutor by reference
(its workers are forked from this process). loky's row is skipped when it is
not installed.

Each row shows wall time and CPU time per task; CPU time is this process's
(every thread) plus that of every worker process, so it counts the work a
round trip costs wherever it runs, and holds steady on a busy machine where
wall time does not. The last columns are each contender's time over
aiopar's, wall and CPU (above 1: aiopar is faster), or aiopar's wall time
in memcpys of the same size.

Run: ``python benchmarks/process.py [--rounds 5] [--small 2000]``
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

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


def median_times(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) seconds of each run, after one warm-up call each,
    the runs taking turns round by round so drift on a shared machine hits
    them all alike."""
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
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in runs}


def closure_over(array: np.ndarray) -> Callable[[], float]:
    def first() -> float:
        return float(array[0])

    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per row")
    parser.add_argument("--small", type=int, default=2000, help="small tasks per round")
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

    rows: list[tuple[str, str, float, float]] = []  # (row, contender, wall and CPU per task)
    # The small-task rows compare with the standard library only.
    small_submits = {name: submit for name, submit in submits.items() if name != "loky"}
    for name, (wall, cpu) in median_times(
        {name: batched(submit, n) for name, submit in small_submits.items()}, rounds
    ).items():
        rows.append(("small tasks, batched", name, wall / n, cpu / n))
    for name, (wall, cpu) in median_times(
        {name: sequential(submit, n // 2) for name, submit in small_submits.items()}, rounds
    ).items():
        rows.append(("small tasks, sequential", name, wall / (n // 2), cpu / (n // 2)))
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
        for name, (wall, cpu) in median_times(runs, rounds).items():
            rows.append((row, name, wall, cpu))
    memcpy, memcpy_cpu = median_times({"memcpy": lambda: np.copyto(target, array)}, rounds)[
        "memcpy"
    ]
    rows.append(("memcpy 100 MB (anchor)", "numpy.copyto", memcpy, memcpy_cpu))

    backend.shutdown()
    for pool in pools.values():
        pool.shutdown()

    print(f"{'row':36} {'contender':20} {'wall':>10} {'CPU':>10}  aiopar speed-up (wall, CPU)")
    print("-" * 108)
    ours = {row: (wall, cpu) for row, name, wall, cpu in rows if name == "aiopar"}
    for row, name, wall, cpu in rows:
        if row in ours and name != "aiopar":
            ratio = f"{wall / ours[row][0]:9.2f}x {cpu / ours[row][1]:6.2f}x"
        elif row.startswith("100 MB") and name == "aiopar":
            ratio = f"{wall / memcpy:9.1f} memcpy"
        else:
            ratio = ""
        print(f"{row:36} {name:20} {_duration(wall)} {_duration(cpu)}  {ratio}")


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:7.1f} us" if seconds < 0.01 else f"{seconds * 1e3:7.1f} ms"


if __name__ == "__main__":
    main()
