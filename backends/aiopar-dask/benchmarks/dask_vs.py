"""aiopar on dask against raw dask.distributed, and aiopar.rpc against torch.distributed.rpc.

Rows, each measured in this one run; where two contenders share a cluster
they take turns round by round (so they see the same machine load) and each
gets its median:

The clusters are the defaults a user gets: TLS with certificates made at
start-up (which the rpc peers of one machine do not need: they talk over a
Unix socket), but where a row says otherwise.

- fork, sequential: fork a no-op and wait, repeat; raw dask:
  ``client.submit(noop, pure=False).result()`` on the same client;
- fork, batched: fork N no-ops, then wait for all; raw dask: N submits, then
  ``client.gather``;
- fork, 100 MB argument: a 100 MB float64 array as the argument (the task
  returns a number); raw dask: the same submit;
- map, N items: ``backend.map(noop, range(N))`` (a dask task per chunk),
  then wait for all; raw dask: ``client.map`` (a task per item), then
  ``client.gather``;
- rpc_sync of a no-op between two processes; torch: ``rpc_sync`` over
  TensorPipe between two local processes (when torch is installed). The
  no-op is ``int`` (``int()`` is 0), which both pickle by reference: a
  function defined in a script's ``__main__`` travels by value
  (cloudpickle, about 30 us a call here), as it does with dask;
- rpc_async, 2,000 in flight: 2,000 no-op calls, then wait for all;
- rpc_sync, 100 MB argument, against torch's rpc_sync of a 100 MB tensor
  and dask's own transfer of the same array (the fork row's raw dask time):
  the two processes share memory (a Unix socket and a segment);
- rpc_sync, 100 MB argument, over TCP: the same call as between peers of two
  machines without TLS (``security=False``; this process does not look for
  the other's Unix socket);
- rpc_sync of a no-op over TCP with the default TLS, as between peers of two
  machines under TLS, against torch's plain rpc_sync and aiopar's default.

aiopar's rpc rows and torch's are measured in passes that alternate
(``--passes``, 3 by default), and each row keeps its best pass: the two
cannot share a round, and on a shared machine a moment of load would
otherwise decide a ratio.

Each row shows wall time and, beside it, the CPU time of the calling
process (``time.process_time()``) per call, and each ratio both ways: on a
busy machine wall time swings with the load while CPU time holds.

The dask cluster has one worker process with one thread; the rpc peers are
this process and one worker process. Everything listens on 127.0.0.1.

Run: ``python backends/aiopar-dask/benchmarks/dask_vs.py [--rounds 5] [--passes 3]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from typing import Any

import distributed
import numpy as np
from aiopar_dask import DaskBackend
from aiopar_dask._wire import connecting

import aiopar
from aiopar import rpc

MB = 1_000_000
IN_FLIGHT = 2000


def noop(x: Any = None) -> None:
    return None


def nbytes(a: np.ndarray) -> int:
    return a.nbytes


Times = tuple[float, float]  # seconds: wall, and CPU of this process
Row = tuple[str, str, float, float]  # row, contender, wall and CPU seconds per call


def median_times(runs: dict[str, Callable[[], Any]], rounds: int) -> dict[str, Times]:
    """Median wall and CPU seconds of each run, the runs taking turns round by round."""
    for run in runs.values():
        run()  # warm-up
    walls: dict[str, list[float]] = {name: [] for name in runs}
    cpus: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            run()
            walls[name].append(time.perf_counter() - wall)
            cpus[name].append(time.process_time() - cpu)
    return {name: (statistics.median(walls[name]), statistics.median(cpus[name])) for name in runs}


def per_call(row: str, name: str, times: Times, calls: int = 1) -> Row:
    return (row, name, times[0] / calls, times[1] / calls)


def fork_rows(rounds: int, array: np.ndarray) -> list[Row]:
    backend = DaskBackend(n_workers=1, threads_per_worker=1)
    client = backend.client
    seq, batch = 50, 500

    def aiopar_seq() -> None:
        for i in range(seq):
            backend.fork(noop, i).wait()

    def dask_seq() -> None:
        for i in range(seq):
            client.submit(noop, i, pure=False).result()

    def aiopar_batch() -> None:
        aiopar.wait_all([backend.fork(noop, i) for i in range(batch)])

    def dask_batch() -> None:
        client.gather([client.submit(noop, i, pure=False) for i in range(batch)])

    def aiopar_map() -> None:
        aiopar.wait_all(backend.map(noop, range(batch)))

    def dask_map() -> None:
        client.gather(client.map(noop, range(batch), pure=False))

    rows = []
    for name, t in median_times({"aiopar": aiopar_seq, "dask": dask_seq}, rounds).items():
        rows.append(per_call("fork, sequential", name, t, seq))
    for name, t in median_times({"aiopar": aiopar_batch, "dask": dask_batch}, rounds).items():
        rows.append(per_call("fork, batched", name, t, batch))
    for name, t in median_times({"aiopar": aiopar_map, "dask": dask_map}, rounds).items():
        rows.append(per_call(f"map, {batch} items", name, t, batch))
    runs = {
        "aiopar": lambda: backend.fork(nbytes, array).wait(),
        "dask": lambda: client.submit(nbytes, array, pure=False).result(),
    }
    for name, t in median_times(runs, rounds).items():
        rows.append(per_call("fork, 100 MB argument", name, t))
    backend.shutdown()
    return rows


def rpc_rows(rounds: int, array: np.ndarray) -> list[Row]:
    rpc.init_rpc("worker0", world_size=2)
    seq = 500

    def sync() -> None:
        for _ in range(seq):
            rpc.rpc_sync("worker1", int)

    def in_flight() -> None:
        aiopar.wait_all([rpc.rpc_async("worker1", int) for _ in range(IN_FLIGHT)])

    times = median_times(
        {
            "sync": sync,
            "async": in_flight,
            "array": lambda: rpc.rpc_sync("worker1", len, args=(array,)),
        },
        rounds,
    )
    rpc.shutdown()
    local, connecting._connect_local = connecting._connect_local, lambda name, timeout: None
    try:
        plain = rpc.RpcBackendOptions(security=False)
        rpc.init_rpc("worker0", world_size=2, rpc_backend_options=plain)
        tcp = median_times({"array": lambda: rpc.rpc_sync("worker1", len, args=(array,))}, rounds)
        rpc.shutdown()
        rpc.init_rpc("worker0", world_size=2)
        tls = median_times({"sync": sync}, rounds)
        rpc.shutdown()
    finally:
        connecting._connect_local = local
    return [
        per_call("rpc_sync, no-op", "aiopar", times["sync"], seq),
        per_call(f"rpc_async, {IN_FLIGHT:,} in flight", "aiopar", times["async"], IN_FLIGHT),
        per_call("rpc_sync, 100 MB argument", "aiopar", times["array"]),
        per_call("rpc_sync, 100 MB argument, TCP", "aiopar", tcp["array"]),
        per_call("rpc_sync, no-op, TCP and TLS", "aiopar", tls["sync"], seq),
    ]


_TORCH_PEER = """
import json, os, statistics, sys, time
import torch
import torch.distributed.rpc as rpc

def main(rank, rounds, seq, in_flight):
    options = rpc.TensorPipeRpcBackendOptions(init_method=os.environ["INIT_METHOD"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        def sync():
            for _ in range(seq):
                rpc.rpc_sync("worker1", int)
        def flight():
            torch.futures.wait_all([rpc.rpc_async("worker1", int) for _ in range(in_flight)])
        array = torch.rand(100 * 2**20 // 8, dtype=torch.float64)  # 100 MB
        def big():
            rpc.rpc_sync("worker1", len, args=(array,))
        out = {}
        for name, run in (("sync", sync), ("async", flight), ("array", big)):
            run()
            walls, cpus = [], []
            for _ in range(rounds):
                wall, cpu = time.perf_counter(), time.process_time()
                run()
                walls.append(time.perf_counter() - wall)
                cpus.append(time.process_time() - cpu)
            out[name] = (statistics.median(walls), statistics.median(cpus))
        print(json.dumps(out))
    rpc.shutdown()

if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
"""


def torch_rows(rounds: int) -> list[Row]:
    try:
        import torch  # noqa: F401
    except ImportError:
        return []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "INIT_METHOD": f"tcp://127.0.0.1:{port}"}
    seq = 500
    script = textwrap.dedent(_TORCH_PEER)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank), str(rounds), str(seq), str(IN_FLIGHT)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (1, 0)
    ]
    out = procs[1].communicate(timeout=600)[0]
    procs[0].wait(timeout=60)
    times = json.loads(out)
    return [
        per_call("rpc_sync, no-op", "torch", times["sync"], seq),
        per_call(f"rpc_async, {IN_FLIGHT:,} in flight", "torch", times["async"], IN_FLIGHT),
        per_call("rpc_sync, 100 MB argument", "torch", times["array"]),
    ]


def best_of(rows: list[Row]) -> list[Row]:
    """The fastest pass (by wall time) of each (row, contender), in the order they first appear."""
    best: dict[tuple[str, str], Row] = {}
    for found in rows:
        kept = best.get(found[:2])
        if kept is None or found[2] < kept[2]:
            best[found[:2]] = found
    return list(best.values())


def shown(seconds: float) -> str:
    return f"{seconds * 1e6:9.1f} us" if seconds < 0.01 else f"{seconds * 1e3:9.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per row")
    parser.add_argument("--passes", type=int, default=3, help="alternate rpc and torch passes")
    options = parser.parse_args()
    rounds = options.rounds
    array = np.random.default_rng(0).random(100 * MB // 8)  # 100 MB of float64

    passes = []
    for _ in range(options.passes):
        passes += rpc_rows(rounds, array) + torch_rows(rounds)
    rows = fork_rows(rounds, array) + best_of(passes)
    by = {(row, name): (wall, cpu) for row, name, wall, cpu in rows}
    # what each aiopar row is compared with: (contender, its row), when measured in this run
    anchors = {
        "fork, sequential": [("dask", "fork, sequential")],
        "fork, batched": [("dask", "fork, batched")],
        "map, 500 items": [("dask", "map, 500 items")],
        "fork, 100 MB argument": [("dask", "fork, 100 MB argument")],
        "rpc_sync, no-op": [("torch", "rpc_sync, no-op")],
        f"rpc_async, {IN_FLIGHT:,} in flight": [("torch", f"rpc_async, {IN_FLIGHT:,} in flight")],
        "rpc_sync, 100 MB argument": [
            ("torch", "rpc_sync, 100 MB argument"),
            ("dask", "fork, 100 MB argument"),
        ],
        "rpc_sync, 100 MB argument, TCP": [
            ("torch", "rpc_sync, 100 MB argument"),
            ("aiopar", "rpc_sync, 100 MB argument"),
        ],
        "rpc_sync, no-op, TCP and TLS": [
            ("torch", "rpc_sync, no-op"),
            ("aiopar", "rpc_sync, no-op"),
        ],
    }
    print(
        f"distributed {distributed.__version__}, {os.cpu_count()} cores, {rounds} rounds, "
        f"best of {options.passes} rpc passes"
    )
    print(f"{'row':34} {'contender':10} {'wall/call':>12} {'CPU/call':>12}  aiopar / anchor")
    print("-" * 100)
    for row, name, wall, cpu in rows:
        ratios = []
        if name == "aiopar":
            for contender, anchor_row in anchors.get(row, []):
                anchor = by.get((anchor_row, contender))
                if anchor and anchor[0] and anchor[1]:
                    ratios.append(
                        f"{wall / anchor[0]:.2f}x {contender} (CPU {cpu / anchor[1]:.2f}x)"
                    )
        print(f"{row:34} {name:10} {shown(wall):>12} {shown(cpu):>12}  {', '.join(ratios)}")


if __name__ == "__main__":
    main()
