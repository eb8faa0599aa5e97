"""Per-task cost of fork/wait, map, then() and await, each against its anchor in the same run.

Every row times aiopar and its anchor alternately, several rounds each, and
keeps the best round of each, in wall time and in CPU time (every thread of
the process): on a shared, noisy machine the minimum is the most repeatable
estimate of what the code itself costs, and CPU time holds where wall time
swings with what else runs.

numpy is imported, as in every program of this library's users: it loads a
BLAS, and the thread budget listens to the pools from then on. One row
measures the same forks in a process that never loads a BLAS, taking turns
with this one, to show what listening costs.

    python benchmarks/overhead.py [--rounds 5] [--scale 1.0] [--only async]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy  # noqa: F401 - loads a BLAS, as users' programs do: the budget listens
from _timing import ChildRounds, Measured
from rich.console import Console
from rich.table import Table

import aiopar

#: a row: aiopar's name, the anchor's name, then seconds per task of each,
#: in wall time and (if measured) in CPU time
Row = tuple[str, str, float, float] | tuple[str, str, float, float, float, float]


def noop() -> None:
    pass


def timed(run: Callable[[], object]) -> tuple[float, float]:
    """Wall and CPU seconds of one call of ``run`` (CPU time of every
    thread of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    measured = run()
    if isinstance(measured, Measured):  # it ran in another process, and timed itself
        return measured
    return time.perf_counter() - wall, time.process_time() - cpu


def paired(
    ours: Callable[[], object], anchor: Callable[[], object], tasks: int, rounds: int
) -> tuple[float, float, float, float]:
    """Seconds per task of each, wall then CPU, the best of ``rounds``
    rounds: both alternately, so drift on the machine hits both alike."""
    ours(), anchor()  # warm up: threads started, caches filled
    wall_ours = wall_anchor = cpu_ours = cpu_anchor = float("inf")
    for _ in range(rounds):
        wall, cpu = timed(ours)
        wall_ours, cpu_ours = min(wall_ours, wall / tasks), min(cpu_ours, cpu / tasks)
        wall, cpu = timed(anchor)
        wall_anchor, cpu_anchor = min(wall_anchor, wall / tasks), min(cpu_anchor, cpu / tasks)
    return wall_ours, wall_anchor, cpu_ours, cpu_anchor


def sequential_forks(backend: aiopar.Backend, n: int) -> Callable[[], None]:
    """``n`` times ``fork(noop).wait()`` on ``backend``, one after another."""

    def run() -> None:
        fork = backend.fork
        for _ in range(n):
            fork(noop).wait()

    return run


def batched_forks(backend: aiopar.Backend, n: int) -> Callable[[], None]:
    """``n`` forks of ``noop`` on ``backend``, then a wait for all of them."""
    return lambda: aiopar.wait_all([backend.fork(noop) for _ in range(n)])


NO_BLAS_CHILD = """
import aiopar

def noop():
    pass

backend = aiopar.get_backend("thread", max_workers={workers})

def run():
    aiopar.wait_all([backend.fork(noop) for _ in range({batch})])
"""


def sync_rows(scale: float, rounds: int, workers: int) -> list[Row]:
    executor = concurrent.futures.ThreadPoolExecutor(workers)
    backend = aiopar.get_backend("thread", max_workers=workers)
    rows = []

    n = int(20_000 * scale)

    fork_wait = sequential_forks(backend, n)

    def submit_result() -> None:
        submit = executor.submit
        for _ in range(n):
            submit(noop).result()

    rows.append(
        (
            "sequential wait(fork(noop))",
            "executor submit().result()",
            *paired(fork_wait, submit_result, n, rounds),
        )
    )

    batch = 10_000

    fork_batch = batched_forks(backend, batch)

    def submit_batch() -> None:
        for fut in [executor.submit(noop) for _ in range(batch)]:
            fut.result()

    rows.append(
        (
            "fork 10,000 then wait all",
            "executor: submit 10,000, result each",
            *paired(fork_batch, submit_batch, batch, rounds),
        )
    )

    # What the budget's listening costs: the same in a process with no BLAS.
    with ChildRounds(NO_BLAS_CHILD.format(workers=workers, batch=batch)) as no_blas:
        rows.append(
            (
                "fork 10,000 then wait all",
                "the same in a process with no BLAS loaded (the budget not listening)",
                *paired(fork_batch, no_blas.run, batch, rounds),
            )
        )
        assert "numpy" not in no_blas.modules, "the child was to load no BLAS"

    def map_batch() -> None:
        aiopar.wait_all(backend.map(noop_item, range(batch)))

    def executor_map() -> None:
        for _ in executor.map(noop_item, range(batch)):
            pass

    rows.append(
        (
            "map of 10,000 then wait all",
            "executor.map of 10,000",
            *paired(map_batch, executor_map, batch, rounds),
        )
    )

    # The floor: the same forks on the inline backend make the same future
    # and task and run the same call, with no queue, no other thread and no
    # budget; what the pool adds is the difference.
    inline_batch = batched_forks(aiopar.get_backend("inline"), batch)

    rows.append(
        (
            "fork 10,000 then wait all",
            "the floor: the same on the inline backend (no thread)",
            *paired(fork_batch, inline_batch, batch, rounds),
        )
    )

    def concurrent_wait_forks() -> None:
        futs = [backend.fork(noop) for _ in range(batch)]
        concurrent.futures.wait(futs)

    def concurrent_wait_submits() -> None:
        futs = [executor.submit(noop) for _ in range(batch)]
        concurrent.futures.wait(futs)

    rows.append(
        (
            "concurrent.futures.wait of 10,000 forks",
            "concurrent.futures.wait of 10,000 submits",
            *paired(concurrent_wait_forks, concurrent_wait_submits, batch, rounds),
        )
    )

    # concurrent.futures runs a chain's callbacks recursively, so its chains
    # must stay short: both sides build many chains of 200 links.
    chain, chains = 200, max(1, int(250 * scale))
    links = chain * chains

    def then_chain() -> None:
        for _ in range(chains):
            root: aiopar.Future[int] = aiopar.Future()
            tail = root
            for _ in range(chain):
                tail = tail.then(_next_value)
            root.set_result(0)
            tail.wait()

    def done_callback_chain() -> None:
        for _ in range(chains):
            root: concurrent.futures.Future[int] = concurrent.futures.Future()
            tail = root
            for _ in range(chain):
                nxt: concurrent.futures.Future[int] = concurrent.futures.Future()
                tail.add_done_callback(lambda f, nxt=nxt: nxt.set_result(f.result() + 1))
                tail = nxt
            root.set_result(0)
            tail.result()

    rows.append(
        (
            "then() per link",
            "concurrent.futures done-callback per link",
            *paired(then_chain, done_callback_chain, links, rounds),
        )
    )
    executor.shutdown()
    return rows


def noop_item(_: object) -> None:
    pass


def _next_value(fut: aiopar.Future[int]) -> int:
    return fut.value() + 1


def async_rows(scale: float, rounds: int, workers: int) -> list[Row]:
    backend = aiopar.get_backend("thread", max_workers=workers)
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [
        ("asyncio", asyncio.new_event_loop)
    ]
    try:
        import uvloop

        loops.append(("uvloop", uvloop.new_event_loop))
    except ImportError:
        pass
    n = int(5_000 * scale)
    gathered = 2_000

    async def await_forks() -> None:
        for _ in range(n):
            await backend.fork(noop)

    async def await_to_thread() -> None:
        for _ in range(n):
            await asyncio.to_thread(noop)

    async def gather_forks() -> None:
        await asyncio.gather(*[backend.fork(noop) for _ in range(gathered)])

    async def gather_to_thread() -> None:
        await asyncio.gather(*[asyncio.to_thread(noop) for _ in range(gathered)])

    async def gather_done() -> None:
        # asyncio wraps each awaitable that is not its own future in a Task:
        # this is that cost alone, for futures that are done already.
        await asyncio.gather(*[_done_future() for _ in range(gathered)])

    async def asyncio_wait_forks() -> None:
        await asyncio.wait([backend.fork(noop) for _ in range(gathered)])

    async def asyncio_wait_to_thread() -> None:
        await asyncio.wait(
            [asyncio.ensure_future(asyncio.to_thread(noop)) for _ in range(gathered)]
        )

    rows = []
    for loop_name, new_loop in loops:
        loop = new_loop()
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(workers))
        on_loop = functools.partial(_run_on, loop)
        round_trip = RoundTrip(loop)
        rows.append(
            (
                f"sequential await fork(noop) ({loop_name})",
                "the limit: bare loop-to-thread round trip",
                *paired(
                    on_loop(await_forks),
                    on_loop(functools.partial(round_trip.sequential, n)),
                    n,
                    rounds,
                ),
            )
        )
        round_trip.close()
        minimal = MinimalPool(loop)
        rows.append(
            (
                f"sequential await fork(noop) ({loop_name})",
                MINIMAL_POOL,
                *paired(
                    on_loop(await_forks),
                    on_loop(functools.partial(minimal.sequential, n)),
                    n,
                    rounds,
                ),
            )
        )
        minimal.close()
        rows.append(
            (
                f"sequential await fork(noop) ({loop_name})",
                "await asyncio.to_thread(noop)",
                *paired(on_loop(await_forks), on_loop(await_to_thread), n, rounds),
            )
        )
        rows.append(
            (
                f"gather of 2,000 forks ({loop_name})",
                "gather of 2,000 to_thread",
                *paired(on_loop(gather_forks), on_loop(gather_to_thread), gathered, rounds),
            )
        )
        rows.append(
            (
                f"gather of 2,000 forks ({loop_name})",
                "the floor: gather of 2,000 futures done already",
                *paired(on_loop(gather_forks), on_loop(gather_done), gathered, rounds),
            )
        )
        rows.append(
            (
                f"asyncio.wait of 2,000 forks ({loop_name})",
                "asyncio.wait of 2,000 to_thread",
                *paired(
                    on_loop(asyncio_wait_forks), on_loop(asyncio_wait_to_thread), gathered, rounds
                ),
            )
        )
        loop.close()
    return rows


def _done_future() -> aiopar.Future[None]:
    fut: aiopar.Future[None] = aiopar.Future()
    fut.set_result(None)
    return fut


class LoopWake:
    """The least a thread does to wake an event loop: one write to an
    eventfd the loop watches, whose reader reads it back and calls
    ``on_wake`` (where there is eventfd; else ``call_soon_threadsafe``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_wake: Callable[[], None]) -> None:
        self.loop = loop
        self.on_wake = on_wake
        self.fd = -1
        self.wake: Callable[[], object]
        if hasattr(os, "eventfd"):
            self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            loop.add_reader(self.fd, self._read)
            self.wake = functools.partial(os.eventfd_write, self.fd, 1)
        else:
            self.wake = functools.partial(loop.call_soon_threadsafe, on_wake)

    def _read(self) -> None:
        os.eventfd_read(self.fd)
        self.on_wake()

    def close(self) -> None:
        if self.fd >= 0:
            self.loop.remove_reader(self.fd)
            os.close(self.fd)


class RoundTrip:
    """The limit of any ``await`` on work done in another thread, with no
    library: the loop hands a job to one plain thread through a lock, the
    thread answers with one :class:`LoopWake`, and the loop awaits a plain
    future. Each await pays the two cross-thread wake-ups and nothing else.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.job = threading.Lock()
        self.job.acquire()
        self.waiter: asyncio.Future[None] | None = None
        self.answer = LoopWake(loop, self._on_answer)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            self.job.acquire()
            if self.waiter is None:
                return
            self.answer.wake()

    def _on_answer(self) -> None:
        self.waiter.set_result(None)  # type: ignore[union-attr]

    async def sequential(self, n: int) -> None:
        for _ in range(n):
            self.waiter = self.loop.create_future()
            self.job.release()
            await self.waiter

    def close(self) -> None:
        self.waiter = None
        self.job.release()
        self.thread.join()
        self.answer.close()


class MinimalPool:
    """The least a pool with futures does per await, a floor for aiopar's:
    a future with a lock, a state and its waiters; one worker that sleeps
    on a lock while its queue is empty; the loop woken by a
    :class:`LoopWake` whose reader sets every waiter posted since (one
    wake-up per batch). No budget, no stand-in workers, no cancel, no
    profiler, no error handling: each await pays the bare round trip and
    one future's making, locking and settling.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.loop_wake = LoopWake(loop, self._drain)
        self.posted: list[asyncio.Future[None]] = []
        self.tasks: collections.deque[tuple[Callable[[], Any] | None, _MinimalFuture]]
        self.tasks = collections.deque()
        self.lock = threading.Lock()
        self.wake_up = threading.Lock()
        self.wake_up.acquire()
        self.idle = True
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.thread.start()

    def fork(self, fn: Callable[[], Any] | None) -> _MinimalFuture:
        fut = _MinimalFuture(self)
        self.tasks.append((fn, fut))
        with self.lock:
            if self.idle:
                self.idle = False
                self.wake_up.release()
        return fut

    def _work(self) -> None:
        while True:
            self.wake_up.acquire()
            while True:
                try:
                    fn, fut = self.tasks.popleft()
                except IndexError:
                    with self.lock:
                        if self.tasks:
                            continue
                        self.idle = True
                    break
                if fn is None:
                    return
                fut.settle(fn())

    def post(self, waiter: asyncio.Future[None]) -> None:
        with self.lock:
            self.posted.append(waiter)
            if len(self.posted) > 1:
                return
        self.loop_wake.wake()

    def _drain(self) -> None:
        with self.lock:
            posted, self.posted = self.posted, []
        for waiter in posted:
            if not waiter.done():
                waiter.set_result(None)

    async def sequential(self, n: int) -> None:
        for _ in range(n):
            await self.fork(noop)

    def close(self) -> None:
        self.fork(None)
        self.thread.join()
        self.loop_wake.close()


class _MinimalFuture:
    __slots__ = ("done", "lock", "pool", "result", "waiters")

    def __init__(self, pool: MinimalPool) -> None:
        self.pool = pool
        self.lock = threading.Lock()
        self.done = False
        self.result: Any = None
        self.waiters: list[asyncio.Future[None]] = []

    def settle(self, result: Any) -> None:
        with self.lock:
            self.result, self.done = result, True
            waiters, self.waiters = self.waiters, []
        for waiter in waiters:
            self.pool.post(waiter)

    def __await__(self) -> Any:
        with self.lock:
            waiter = None if self.done else self.pool.loop.create_future()
            if waiter is not None:
                self.waiters.append(waiter)
        if waiter is not None:
            yield from waiter
        return self.result


def _run_on(
    loop: asyncio.AbstractEventLoop, coroutine_function: Callable[[], Any]
) -> Callable[[], None]:
    return lambda: loop.run_until_complete(coroutine_function())


def profiler_rows(scale: float, rounds: int) -> list[Row]:
    """What tracing costs: off, the two checks of ``_trace.active`` a task passes
    (in fork and in run); on, a recorded inline fork+wait."""
    from aiopar import _trace, profiler

    inline = aiopar.get_backend("inline")
    n = int(20_000 * scale)

    fork_wait = sequential_forks(inline, n)

    def flag_checks() -> None:
        trace = _trace
        for _ in range(n):
            if trace.active is not None:
                raise AssertionError("a profiler is recording")
            if trace.active is not None:
                raise AssertionError("a profiler is recording")

    def recorded_fork_wait() -> None:
        with profiler.profile():
            fork_wait()

    return [
        (
            "profiler off: its checks per task",
            "inline fork+wait (the task they sit in)",
            *paired(flag_checks, fork_wait, n, rounds),
        ),
        (
            "inline fork+wait, profiler recording",
            "inline fork+wait, profiler off",
            *paired(recorded_fork_wait, fork_wait, n, rounds),
        ),
    ]


def torch_rows(scale: float, rounds: int, workers: int) -> list[Row]:
    """TorchScript's own fork/wait, for reference, when torch is installed."""
    try:
        import torch
    except ImportError:
        return []
    with contextlib.suppress(RuntimeError):  # allowed once, before any parallel work
        torch.set_num_interop_threads(workers)

    @torch.jit.script
    def identity(x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.script
    def sequential(x: torch.Tensor, n: int) -> torch.Tensor:
        for _ in range(n):
            x = torch.jit.wait(torch.jit.fork(identity, x))
        return x

    @torch.jit.script
    def batched(x: torch.Tensor, n: int) -> torch.Tensor:
        futures = [torch.jit.fork(identity, x) for _ in range(n)]
        for fut in futures:
            x = torch.jit.wait(fut)
        return x

    x = torch.zeros(1)
    backend = aiopar.get_backend("thread", max_workers=workers)
    n = int(20_000 * scale)
    batch = 10_000

    ours_sequential = sequential_forks(backend, n)
    ours_batched = batched_forks(backend, batch)

    def ours_map() -> None:
        aiopar.wait_all(backend.map(noop_item, range(batch)))

    return [
        (
            "sequential wait(fork(noop))",
            "torch.jit.fork+wait, scripted",
            *paired(ours_sequential, lambda: sequential(x, n), n, rounds),
        ),
        (
            "fork 10,000 then wait all",
            "torch.jit.fork 10,000 then wait, scripted",
            *paired(ours_batched, lambda: batched(x, batch), batch, rounds),
        ),
        (
            "map of 10,000 then wait all",
            "torch.jit.fork 10,000 then wait, scripted",
            *paired(ours_map, lambda: batched(x, batch), batch, rounds),
        ),
    ]


#: the groups of rows, in the order they run
GROUPS = ("sync", "async", "profiler", "torch")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per row (best kept)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the task counts")
    parser.add_argument("--workers", type=int, default=2, help="pool size for both sides")
    parser.add_argument(
        "--only",
        choices=GROUPS,
        action="append",
        help="measure only this group of rows (may be given more than once); default: all",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.scale <= 0 or args.workers < 1:
        parser.error("--rounds and --workers must be >= 1 and --scale > 0")

    groups = args.only or list(GROUPS)
    rows: list[Row] = []
    if "sync" in groups:
        rows += sync_rows(args.scale, args.rounds, args.workers)
    if "async" in groups:
        rows += async_rows(args.scale, args.rounds, args.workers)
    if "profiler" in groups:
        rows += profiler_rows(args.scale, args.rounds)
    if "torch" in groups:
        rows += torch_rows(args.scale, args.rounds, args.workers)

    table = Table(
        title=f"aiopar overhead per task ({args.workers} workers, best of {args.rounds}; "
        f"µs wall, and CPU of every thread)"
    )
    for column in ("aiopar", "µs", "cpu µs", "anchor", "µs", "cpu µs", "anchor / aiopar", "cpu"):
        table.add_column(column, justify="left" if column in ("aiopar", "anchor") else "right")
    for ours_name, anchor_name, ours, anchor, *cpu in rows:
        cpu_ours, cpu_anchor = cpu or (None, None)
        table.add_row(
            ours_name,
            f"{ours * 1e6:.2f}",
            "" if cpu_ours is None else f"{cpu_ours * 1e6:.2f}",
            anchor_name,
            f"{anchor * 1e6:.2f}",
            "" if cpu_anchor is None else f"{cpu_anchor * 1e6:.2f}",
            f"{anchor / ours:.2f}x",
            "" if cpu_ours is None else f"{cpu_anchor / cpu_ours:.2f}x",
        )
    console = Console(width=160)
    console.print(table)
    console.print(targets_table(rows))


# The targets: (aiopar row, anchor row, the least anchor / aiopar
# asked, the floor rows). A floor is what the same work costs with no thread
# hand-off at all (the task run inline, asyncio's own gather of futures done
# already), or, for an await, in the least pool that has futures at all
# (MinimalPool); no implementation of a thread pool in Python costs less, so
# anchor / (sum of floors) is the most any could reach in this run.
MINIMAL_POOL = "the floor: a minimal pool's await (MinimalPool)"
INLINE_FLOOR = (
    "fork 10,000 then wait all",
    "the floor: the same on the inline backend (no thread)",
)
TARGETS: list[tuple[tuple[str, str], float, list[tuple[str, str]]]] = [
    (("fork 10,000 then wait all", "executor: submit 10,000, result each"), 3.0, [INLINE_FLOOR]),
    (
        ("fork 10,000 then wait all", "torch.jit.fork 10,000 then wait, scripted"),
        1.0,
        [INLINE_FLOOR],
    ),
    (
        (
            "fork 10,000 then wait all",
            "the same in a process with no BLAS loaded (the budget not listening)",
        ),
        1 / 1.1,
        [],
    ),
    (("map of 10,000 then wait all", "torch.jit.fork 10,000 then wait, scripted"), 1.5, []),
    *(
        target
        for loop in ("asyncio", "uvloop")
        for target in (
            (
                (
                    f"sequential await fork(noop) ({loop})",
                    "the limit: bare loop-to-thread round trip",
                ),
                1 / 1.2,
                [(f"sequential await fork(noop) ({loop})", MINIMAL_POOL)],
            ),
            ((f"sequential await fork(noop) ({loop})", "await asyncio.to_thread(noop)"), 1.0, []),
            (
                (f"gather of 2,000 forks ({loop})", "gather of 2,000 to_thread"),
                4.0,
                [
                    INLINE_FLOOR,
                    (
                        f"gather of 2,000 forks ({loop})",
                        "the floor: gather of 2,000 futures done already",
                    ),
                ],
            ),
        )
    ),
]


def targets_table(rows: list[Row]) -> Table:
    """Each target's ratio in this run, of wall times and of CPU times
    beside it (a target holds for both), and the most any pool could reach
    in each."""
    measured = {(row[0], row[1]): row[2:] for row in rows}
    table = Table(title="targets (anchor / aiopar; reachable: anchor / the floors' sum)")
    for column in ("aiopar", "anchor", "ratio", "cpu", "target", "reachable", "verdict"):
        table.add_column(
            column,
            justify="right" if column in ("ratio", "cpu", "target", "reachable") else "left",
        )
    for key, least, floors in TARGETS:
        if key not in measured or not all(floor in measured for floor in floors):
            continue  # a row this run has not got (no uvloop, no torch)
        ours, anchor, *cpu = measured[key]
        ratio = anchor / ours
        cpu_ratio = cpu[1] / cpu[0] if cpu else None
        reachable = anchor / sum(measured[floor][1] for floor in floors) if floors else None
        reachable_cpu = (
            cpu[1] / sum(measured[floor][3] for floor in floors)
            if floors and cpu and all(len(measured[floor]) == 4 for floor in floors)
            else None
        )
        if ratio < least:
            verdict, reach = "missed", reachable
        elif cpu_ratio is not None and cpu_ratio < least:
            verdict, reach = "missed in CPU time", reachable_cpu
        else:
            verdict, reach = "met", None
        if reach is not None and reach < least:
            verdict += ": beyond reach"
        shown = "" if reachable is None else f"{reachable:.2f}x"
        if reachable_cpu is not None:
            shown += f" / {reachable_cpu:.2f}x"
        table.add_row(
            *key,
            f"{ratio:.2f}x",
            "" if cpu_ratio is None else f"{cpu_ratio:.2f}x",
            f">= {least:.2f}x",
            shown,
            verdict,
        )
    return table


if __name__ == "__main__":
    main()
