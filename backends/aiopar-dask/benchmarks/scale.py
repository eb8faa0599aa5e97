"""aiopar.rpc with many peers on one machine: what a world of N costs.

Each rank is a process of its own, started as torch's docs start them
(``env://``: ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``), with the default security. This script steps them through
the phases together, each phase starting when every rank has finished the
one before (a line on each rank's stdin), and reports, for each world size:

- init: the slowest rank's ``init_rpc``, from its start (imports included);
- first round: every rank calls every other once (``rpc_async`` of a
  no-op, then waits for all): the slowest rank's time, which includes
  opening a connection to each other rank (each with its handshake);
- second round: the same again, over the connections now open;
- connections: the rpc wire's connections of a rank after the rounds, its
  own to the others and the others' to it (the most of any rank);
- RSS and threads of a rank after the rounds (the most of any rank);
- shutdown: the slowest rank's graceful ``rpc.shutdown()``, whose barrier
  waits until every rank has called it.

Also the load average (1 min) before and after each world, as a shared
machine's load moves every figure; with ``--settle L``, each world waits
first (at most ``--settle-timeout`` seconds) for the load to fall below L,
its predecessor's ranks included. Everything listens on 127.0.0.1; every
process a world started is killed when it ends or fails, and a world that
takes longer than ``--timeout`` seconds is killed and reported as such.

Run: ``python backends/aiopar-dask/benchmarks/scale.py --peers 16 32 64``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

RANK = """
    import json, os, sys, threading, time
    started = time.perf_counter()
    import psutil
    from aiopar import rpc

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def say(**fields):
        print(json.dumps(fields), flush=True)

    rpc.init_rpc(f"worker{rank}")
    say(init=time.perf_counter() - started)
    others = [f"worker{r}" for r in range(world) if r != rank]
    for round in (1, 2):
        sys.stdin.readline()
        began = time.perf_counter()
        for call in [rpc.rpc_async(to, int) for to in others]:
            call.wait()
        say(round=time.perf_counter() - began)
    agent = rpc.agent.current_agent()
    me = psutil.Process()
    say(
        outgoing=len(agent._links),
        incoming=len(agent._listener._connections),
        rss=me.memory_info().rss,
        threads=me.num_threads(),
    )
    sys.stdin.readline()
    began = time.perf_counter()
    rpc.shutdown()
    say(shutdown=time.perf_counter() - began)
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def load() -> float:
    return os.getloadavg()[0]


def settle(below: float, timeout: float) -> None:
    """Wait until the load average (1 min) is below ``below``, or ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while load() >= below and time.monotonic() < deadline:
        time.sleep(5)


class World:
    """``size`` ranks, each a process (and the leader of its process group)."""

    def __init__(self, size: int) -> None:
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(size),
            "DASK_LOGGING__DISTRIBUTED": "error",
        }
        self.ranks = [
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(RANK)],
                env={**env, "RANK": str(rank)},
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            for rank in range(size)
        ]

    def gather(self, deadline: float) -> list[dict[str, Any]]:
        """The next line of every rank, read in parallel; TimeoutError at ``deadline``."""
        lines: list[dict[str, Any] | None] = [None] * len(self.ranks)

        def read(i: int) -> None:
            stdout = self.ranks[i].stdout
            assert stdout is not None
            line = stdout.readline()
            lines[i] = json.loads(line) if line else None

        readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(len(lines))]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(max(0.0, deadline - time.monotonic()))
        missing = [i for i, line in enumerate(lines) if line is None]
        if missing:
            raise TimeoutError(f"ranks {missing[:10]} did not report in time (or died)")
        return [line for line in lines if line is not None]

    def go(self) -> None:
        """Start the next phase in every rank at once."""
        for rank in self.ranks:
            assert rank.stdin is not None
            rank.stdin.write("\n")
            rank.stdin.flush()

    def kill(self) -> None:
        for rank in self.ranks:
            with contextlib.suppress(ProcessLookupError):  # (it ended, and its group too)
                os.killpg(rank.pid, signal.SIGKILL)
        for rank in self.ranks:
            rank.wait()


def measure(size: int, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    row: dict[str, Any] = {"peers": size, "load before": load()}
    world = World(size)
    try:
        row["init"] = max(r["init"] for r in world.gather(deadline))
        for name in ("first round", "second round"):
            world.go()
            rounds = [r["round"] for r in world.gather(deadline)]
            row[name] = max(rounds)
        counts = world.gather(deadline)
        row["connections"] = max(r["outgoing"] + r["incoming"] for r in counts)
        row["RSS MB"] = max(r["rss"] for r in counts) / 1e6
        row["threads"] = max(r["threads"] for r in counts)
        world.go()
        row["shutdown"] = max(r["shutdown"] for r in world.gather(deadline))
    except TimeoutError as exc:
        row["failed"] = str(exc)
    finally:
        world.kill()
        row["load after"] = load()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--timeout", type=float, default=600, help="seconds a world may take")
    parser.add_argument("--settle", type=float, help="the load to wait for before each world")
    parser.add_argument("--settle-timeout", type=float, default=300)
    args = parser.parse_args()
    for size in args.peers:
        if args.settle is not None:
            settle(args.settle, args.settle_timeout)
        row = measure(size, args.timeout)
        print(
            "  ".join(
                f"{k}: {v:.3g}" if isinstance(v, float) else f"{k}: {v}" for k, v in row.items()
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
