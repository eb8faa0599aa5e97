"""Where the time of a batched fork goes, taken apart in one run.

``fork 10,000 then wait all`` on the thread backend, as in overhead.py, four
ways; each takes one cost away from the way above it:

1. as it is;
2. the garbage collector paused: what collecting the held futures costs;
3. the switch interval raised, so the forking thread keeps the GIL, and it
   waits for each future in turn, which runs the task in the waiter: what
   handing tasks to a worker costs;
4. a backend whose ``submit`` does nothing, waited for the same way: the
   same futures, tasks and calls without the pool, so what the pool's queue
   and budget cost (its ``submit`` shows in the fork loop, its task wrapper
   in the wait).

numpy is imported, as in every program of this library's users: it loads a
BLAS, and the thread budget listens to the pools from then on
(``--no-blas`` measures a program that never loads one). The ways take
turns, round by round, and each keeps its best round, in wall time and in
CPU time (every thread of the process).

    python benchmarks/fork_cost.py [--rounds 15] [--batch 10000] [--no-blas]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import threading
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.table import Table

if "--no-blas" not in sys.argv:
    import numpy  # noqa: F401 - loads a BLAS, as users' programs do: the budget listens

import aiopar
from aiopar.backends import Backend, Task


def noop() -> None:
    pass


def ran_on(threads: list[threading.Thread]) -> None:
    threads.append(threading.current_thread())


class NoPool(Backend):
    """Queues nothing: a waiter runs each task (the pool's work, minus the pool)."""

    stealable = True

    name = "no-pool"

    @property
    def max_workers(self) -> int:
        return 1

    def enqueue(self, task: Task) -> None:
        pass

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        pass


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@contextlib.contextmanager
def gc_paused_forker_keeps_gil() -> Iterator[None]:
    # A thread already waiting for the GIL asks for it after the interval it
    # began waiting with: sleeping at each change lets every worker take it,
    # finish what is queued and go idle, so none runs a task of this way and
    # none waits the long interval after it.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # a worker gets the GIL only when this thread blocks
    time.sleep(0.05)
    try:
        with gc_paused():
            yield
    finally:
        sys.setswitchinterval(previous)
        time.sleep(0.05)


def wait_all(futures: list[aiopar.Future[None]]) -> None:
    aiopar.wait_all(futures)


def wait_each(futures: list[aiopar.Future[None]]) -> None:
    """Each future's wait(), in turn: a task that has not started runs here."""
    for fut in futures:
        fut.wait()


Way = tuple[str, str, Callable[[], contextlib.AbstractContextManager[None]], Callable[..., None]]

WAYS: list[Way] = [
    ("thread", "1. thread backend", contextlib.nullcontext, wait_all),
    ("thread", "2. + GC paused", gc_paused, wait_all),
    ("thread", "3. + the forker runs all", gc_paused_forker_keeps_gil, wait_each),
    ("no-pool", "4. + no pool", gc_paused_forker_keeps_gil, wait_each),
]


def one_round(
    backend: Backend, batch: int, wait: Callable[[list[aiopar.Future[None]]], None]
) -> tuple[float, float, float]:
    """Seconds per task of the fork loop and of the wait, and CPU seconds per task."""
    fork = backend.fork
    cpu = time.process_time()
    start = time.perf_counter()
    futures = [fork(noop) for _ in range(batch)]
    forked = time.perf_counter()
    wait(futures)
    done = time.perf_counter()
    cpu = time.process_time() - cpu
    return (forked - start) / batch, (done - forked) / batch, cpu / batch


def share_run_by_forker(backend: Backend, batch: int) -> float:
    """The share of a batch's tasks that ran on the thread that forked them
    (an untimed round: recording the thread costs as much as a task)."""
    threads: list[threading.Thread] = []
    wait_each([backend.fork(ran_on, threads) for _ in range(batch)])
    return threads.count(threading.current_thread()) / batch


#: a way's label, its best round's fork, wait and CPU seconds per task, and
#: the share of its tasks that ran on the forking thread
Row = tuple[str, float, float, float, float]


def measure(rounds: int, batch: int) -> list[Row]:
    """Every way's row, the ways taking turns round by round."""
    backends: dict[str, Backend] = {"thread": aiopar.get_backend("thread"), "no-pool": NoPool()}
    times: dict[str, list[tuple[float, float, float]]] = {label: [] for _, label, *_ in WAYS}
    for _ in range(rounds + 1):
        for kind, label, conditions, wait in WAYS:
            with conditions():
                times[label].append(one_round(backends[kind], batch, wait))
    rows = []
    for kind, label, conditions, _ in WAYS:
        best = min(times[label][1:], key=lambda t: t[0] + t[1])  # the first round warms up
        with conditions():
            rows.append((label, *best, share_run_by_forker(backends[kind], batch)))
    return rows


def report(rows: list[Row], console: Console) -> None:
    blas = "no BLAS loaded" if "numpy" not in sys.modules else "numpy loaded: the budget listens"
    table = Table(title=f"fork then wait all: µs per task, best round of each way ({blas})")
    for column in ("way", "fork", "wait", "total", "cpu", "taken away", "on the forker"):
        table.add_column(column, justify="left" if column == "way" else "right")
    above = None
    for label, fork_s, wait_s, cpu_s, ran_here in rows:
        total = fork_s + wait_s
        taken = "" if above is None else f"{(above - total) * 1e6:.2f}"
        table.add_row(
            label,
            f"{fork_s * 1e6:.2f}",
            f"{wait_s * 1e6:.2f}",
            f"{total * 1e6:.2f}",
            f"{cpu_s * 1e6:.2f}",
            taken,
            f"{ran_here:.0%}",
        )
        above = total
    console.print(table)
    as_is, gc_off, forker_only, no_pool = ((fork_s, wait_s) for _, fork_s, wait_s, *_ in rows)
    whole = sum(as_is)

    def share(name: str, seconds: float) -> None:
        console.print(f"  {name:<40} {seconds * 1e6:5.2f} µs  {seconds / whole:4.0%}")

    console.print(f"Of {whole * 1e6:.2f} µs per task:")
    share("the garbage collector (1 - 2)", whole - sum(gc_off))
    share("the hand-off to a worker (2 - 3)", sum(gc_off) - sum(forker_only))
    share("the pool's submit (3 - 4, fork)", forker_only[0] - no_pool[0])
    share("the pool's task wrapper (3 - 4, wait)", forker_only[1] - no_pool[1])
    share("future, task and call (4)", sum(no_pool))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument(
        "--no-blas", action="store_true", help="never import numpy: the budget does not listen"
    )
    args = parser.parse_args()
    report(measure(args.rounds, args.batch), Console())


if __name__ == "__main__":
    main()
