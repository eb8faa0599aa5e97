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
not installed. The last column is each contender's time over aiopar's (above
1: aiopar is faster), or aiopar's time in memcpys of the same size.

Run: ``python benchmarks/process.py [--rounds 5] [--small 2000]``
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np
from _timing import median_times

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

    rows: list[tuple[str, str, float]] = []  # (row, contender, seconds per task)
    # The small-task rows compare with the standard library only.
    small_submits = {name: submit for name, submit in submits.items() if name != "loky"}
    for name, t in median_times(
        {name: batched(submit, n) for name, submit in small_submits.items()}, rounds
    ).items():
        rows.append(("small tasks, batched", name, t / n))
    for name, t in median_times(
        {name: sequential(submit, n // 2) for name, submit in small_submits.items()}, rounds
    ).items():
        rows.append(("small tasks, sequential", name, t / (n // 2)))
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

    print(f"{'row':36} {'contender':22} {'per task':>12} {'aiopar speed-up':>16}")
    print("-" * 89)
    ours = {row: t for row, name, t in rows if name == "aiopar"}
    for row, name, seconds in rows:
        per_task = f"{seconds * 1e6:9.1f} us" if seconds < 0.01 else f"{seconds * 1e3:9.1f} ms"
        if row in ours and name != "aiopar":
            ratio = f"{seconds / ours[row]:14.1f}x"
        elif row.startswith("100 MB") and name == "aiopar":
            ratio = f"{seconds / memcpy:9.1f} memcpy"
        else:
            ratio = ""
        print(f"{row:36} {name:22} {per_task:>12} {ratio:>16}")


if __name__ == "__main__":
    main()
