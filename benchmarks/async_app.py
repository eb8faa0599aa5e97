"""An async web app's offloading under uvicorn: aiopar against anyio and run_in_executor.

The same Starlette app (this module's ``app``) runs under uvicorn three
times, in three server processes, one per contender for offloading a call
from the event loop:

* aiopar: ``await aiopar.fork(f)`` (the default thread backend);
* anyio: ``await anyio.to_thread.run_sync(f)`` (what Starlette itself uses);
* run_in_executor: ``await loop.run_in_executor(None, f)`` (asyncio's default
  executor).

Only the aiopar server imports aiopar. For each kind of work (a 300x300
numpy matmul, a no-op, ``time.sleep(0.05)`` standing for a blocking driver
call) and each concurrency, this process loads the servers with aiohttp in
turn, the order rotating round by round so drift on a shared machine hits
them alike: a closed loop of that many clients, each sending its next
request when its last one is answered, for a few seconds, then waiting for
the requests in flight. Each row gives req/s and p99 latency of each
contender, aiopar's ratio to anyio, the server's thread count at the end of
the row and its CPU seconds beside the wall seconds it was loaded.

Then the micro-case, in this process: 100 concurrent 50 ms ``time.sleep``
calls gathered on one asyncio loop, the three contenders alternating,
median wall and CPU seconds (every thread of the process) of the rounds.

Both tables print in markdown, as docs/async.md shows them. With
``--baseline DIR`` (a checkout of an earlier commit, say from ``git worktree
add DIR COMMIT``), a fourth server, "aiopar before", serves the app with
that checkout's aiopar, alternating with the others in the same run.

    python benchmarks/async_app.py [--quick] [--seconds 2] [--rounds 2] [--baseline DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

if TYPE_CHECKING:  # the servers never load the client's library
    import aiohttp

CONTENDERS: tuple[str, ...] = ("aiopar", "anyio", "run_in_executor")
#: the contender served with an earlier checkout's aiopar (--baseline)
BASELINE = "aiopar before"
#: the environment variable that tells a server which contender it is
CONTENDER_VARIABLE = "AIOPAR_ASYNC_APP_CONTENDER"
SLEEP = 0.05  # seconds of the blocking call

MATRIX = np.random.default_rng(0).standard_normal((300, 300))


def matmul() -> None:
    MATRIX @ MATRIX


def noop() -> None:
    pass


def sleep() -> None:
    time.sleep(SLEEP)


#: what each row offloads: its label in the table, and the call
WORKS: dict[str, tuple[str, Callable[[], None]]] = {
    "matmul": ("numpy 300x300 matmul", matmul),
    "noop": ("a no-op", noop),
    "sleep": (f"`time.sleep({SLEEP})`", sleep),
}


def offloader(contender: str) -> Callable[[Callable[[], None]], Awaitable[None]]:
    """How ``contender`` runs a call off the event loop. Each imports only
    its own library, so no server carries another's threads or settings."""
    if contender in ("aiopar", BASELINE):
        import aiopar

        return aiopar.fork
    if contender == "anyio":
        import anyio.to_thread

        return anyio.to_thread.run_sync
    if contender == "run_in_executor":
        return lambda f: asyncio.get_running_loop().run_in_executor(None, f)
    raise ValueError(f"no contender {contender!r}; one of {CONTENDERS}")


offload = offloader(os.environ.get(CONTENDER_VARIABLE, "aiopar"))


async def endpoint(request: Request) -> PlainTextResponse:
    await offload(WORKS[request.path_params["work"]][1])
    return PlainTextResponse("ok")


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


app = Starlette(routes=[Route("/health", health), Route("/work/{work}", endpoint)])


# --- the load side: this process, when run as a script ---


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """uvicorn serving ``app`` for one contender, in a process of its own."""

    def __init__(self, contender: str, pythonpath: str | None = None) -> None:
        import psutil

        self.contender = contender
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "async_app:app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-access-log",  # a log line per request would be the bottleneck
                "--log-level",
                "warning",
                "--timeout-graceful-shutdown",
                "5",
            ],
            # Here, so -m puts this directory first on sys.path, not the caller's.
            cwd=Path(__file__).resolve().parent,
            env={
                **os.environ,
                CONTENDER_VARIABLE: contender,
                **({"PYTHONPATH": pythonpath} if pythonpath else {}),
            },
            start_new_session=True,
        )
        self.ps = psutil.Process(self.process.pid)

    def wait_until_serving(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                raise RuntimeError(f"the {self.contender} server exited with {code}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1):
                    return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """CPU time of every thread of the server so far."""
        times = self.ps.cpu_times()
        return times.user + times.system

    def threads(self) -> int:
        return self.ps.num_threads()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


@dataclass
class Load:
    """What one contender's server did at one point, over every round."""

    latencies: list[float] = field(default_factory=list)
    wall: float = 0.0
    cpu: float = 0.0
    errors: int = 0
    threads: int = 0

    def rate(self) -> float:
        return len(self.latencies) / self.wall

    def p99_ms(self) -> float:
        return 1000 * statistics.quantiles(self.latencies, n=100)[98]


async def closed_loop(
    session: aiohttp.ClientSession, url: str, concurrency: int, seconds: float, load: Load
) -> None:
    """``concurrency`` clients, each sending a request as soon as its last
    one is answered, until ``seconds`` have passed; the requests in flight
    then finish, and count."""
    start = time.perf_counter()
    stop_at = start + seconds

    async def client() -> None:
        while time.perf_counter() < stop_at:
            sent = time.perf_counter()
            async with session.get(url) as response:
                body = await response.read()
            load.latencies.append(time.perf_counter() - sent)
            if response.status != 200 or body != b"ok":
                load.errors += 1

    await asyncio.gather(*(client() for _ in range(concurrency)))
    load.wall += time.perf_counter() - start


async def measure_point(
    servers: list[Server],
    sessions: dict[str, aiohttp.ClientSession],
    work: str,
    concurrency: int,
    args: argparse.Namespace,
) -> dict[str, Load]:
    """Each server loaded in turn, ``args.rounds`` times, after a short warm-up each."""
    for server in servers:  # threads started, connections open, caches warm
        await closed_loop(
            sessions[server.contender],
            f"{server.url}/work/{work}",
            concurrency,
            args.seconds / 4,
            Load(),
        )
    loads = {server.contender: Load() for server in servers}
    for round_ in range(args.rounds):
        shift = round_ % len(servers)
        for server in servers[shift:] + servers[:shift]:
            load = loads[server.contender]
            cpu = server.cpu_seconds()
            url = f"{server.url}/work/{work}"
            await closed_loop(sessions[server.contender], url, concurrency, args.seconds, load)
            load.cpu += server.cpu_seconds() - cpu
    for server in servers:
        loads[server.contender].threads = server.threads()
    return loads


def ratio(ours: float, anchor: float) -> str:
    return f"{ours / anchor:.2f}x"


def each(loads: dict[str, Load], cell: Callable[[Load], str]) -> str:
    return " / ".join(cell(loads[contender]) for contender in CONTENDERS)


def app_table(points: list[tuple[str, int, dict[str, Load]]]) -> str:
    names = " / ".join(CONTENDERS)
    lines = [
        f"| work offloaded | concurrency | req/s: {names} | aiopar / anyio "
        f"| p99 ms: {names} | aiopar / anyio | server threads at the end "
        f"| server CPU s in wall s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for work, concurrency, loads in points:
        aiopar_, anyio_ = loads["aiopar"], loads["anyio"]
        lines.append(
            f"| {WORKS[work][0]} | {concurrency} "
            f"| {each(loads, lambda load: f'{load.rate():.0f}')} "
            f"| {ratio(aiopar_.rate(), anyio_.rate())} "
            f"| {each(loads, lambda load: f'{load.p99_ms():.0f}')} "
            f"| {ratio(aiopar_.p99_ms(), anyio_.p99_ms())} "
            f"| {each(loads, lambda load: str(load.threads))} "
            f"| {each(loads, lambda load: f'{load.cpu:.1f} in {load.wall:.1f}')} |"
        )
    return "\n".join(lines)


async def gather_sleeps(contender: str, calls: int) -> None:
    """The issue's micro-case: ``calls`` concurrent 50 ms sleeps, gathered."""
    run = offloader(contender)
    await asyncio.gather(*(run(sleep) for _ in range(calls)))


async def micro_case(calls: int, rounds: int) -> dict[str, tuple[float, float]]:
    """Median wall and CPU seconds of each contender, alternating on one
    loop (anyio's threads and the default executor belong to the loop)."""
    here = [contender for contender in CONTENDERS if contender != BASELINE]
    times: dict[str, list[tuple[float, float]]] = {contender: [] for contender in here}
    for contender in here:  # warm-up: threads started
        await gather_sleeps(contender, calls)
    for _ in range(rounds):
        for contender in here:
            wall, cpu = time.perf_counter(), time.process_time()
            await gather_sleeps(contender, calls)
            times[contender].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        contender: (
            statistics.median(wall for wall, _ in measured),
            statistics.median(cpu for _, cpu in measured),
        )
        for contender, measured in times.items()
    }


def micro_table(calls: int, medians: dict[str, tuple[float, float]]) -> str:
    labels = {
        "aiopar": "`aiopar.fork` (default pool)",
        "anyio": "`anyio.to_thread.run_sync`",
        "run_in_executor": "`loop.run_in_executor(None)`",
    }
    anyio_wall = medians["anyio"][0]
    lines = [
        f"| {calls} concurrent `time.sleep({SLEEP})`, gathered | wall s | CPU s | wall / anyio's |",
        "|---|---|---|---|",
    ]
    for contender, (wall, cpu) in medians.items():
        lines.append(
            f"| {labels[contender]} | {wall:.2f} | {cpu:.2f} | {ratio(wall, anyio_wall)} |"
        )
    return "\n".join(lines)


async def load_servers(
    servers: list[Server], args: argparse.Namespace
) -> list[tuple[str, int, dict[str, Load]]]:
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=300)
    sessions = {
        server.contender: aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=max(args.concurrency)), timeout=timeout
        )
        for server in servers
    }
    try:
        points = []
        for work in WORKS:
            for concurrency in args.concurrency:
                loads = await measure_point(servers, sessions, work, concurrency, args)
                points.append((work, concurrency, loads))
                print(f"  {WORKS[work][0]}, {concurrency} concurrent: done", flush=True)
        return points
    finally:
        for session in sessions.values():
            await session.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short loads, 10 and 50 concurrent")
    parser.add_argument("--seconds", type=float, default=2.0, help="load per contender per round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds per point")
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[10, 100, 400], help="clients at once"
    )
    parser.add_argument("--calls", type=int, default=100, help="sleeps of the micro-case")
    parser.add_argument(
        "--baseline", metavar="DIR", help="also serve with the aiopar of this checkout"
    )
    args = parser.parse_args(argv)
    global CONTENDERS
    if args.baseline:
        CONTENDERS = ("aiopar", BASELINE, "anyio", "run_in_executor")
    if args.quick:
        args.seconds, args.rounds, args.concurrency = 0.2, 1, [10, 50]

    started = time.perf_counter()
    servers = [
        Server(contender, args.baseline if contender == BASELINE else None)
        for contender in CONTENDERS
    ]
    try:
        for server in servers:
            server.wait_until_serving()
        print(f"loading {', '.join(CONTENDERS)}, each in its own uvicorn server", flush=True)
        points = asyncio.run(load_servers(servers, args))
    finally:
        for server in servers:
            server.stop()
    medians = asyncio.run(micro_case(args.calls, rounds=1 if args.quick else 5))

    print(f"\n{os.cpu_count()} cores, {args.seconds:g} s per contender per round, ", end="")
    print(f"{args.rounds} rounds, contenders alternating in one run\n")
    print(app_table(points))
    print()
    print(micro_table(args.calls, medians))
    errors = {c: sum(loads[c].errors for *_, loads in points) for c in CONTENDERS}
    print(f"\nwrong responses: {errors}; took {time.perf_counter() - started:.0f} s")
    if any(errors.values()):
        raise SystemExit("some requests were answered wrong")


if __name__ == "__main__":
    main()
