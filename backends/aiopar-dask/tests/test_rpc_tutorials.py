"""torch's rpc tutorials in examples/, run as torch's documentation runs them:
``python examples/<tutorial>.py RANK`` in one process per rank, which meet
at MASTER_ADDR:MASTER_PORT (env://, rank 0 starting the rendezvous there),
on loopback. Each test checks what the ranks print."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dask_helpers import LOOPBACK, Leftovers, wait_until

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
TIMEOUT = 120  # seconds for a whole run: a rank that hangs fails the test, and is killed

pytestmark = pytest.mark.timeout(TIMEOUT + 30)


@pytest.fixture(autouse=True)
def leaves_no_process():
    left = Leftovers()
    yield
    assert wait_until(lambda: not left.processes(), timeout=15), left.processes()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def run_ranks(script: str, world_size: int) -> list[str]:
    """Run ``examples/<script> RANK`` for each rank at once; what each rank
    printed, once every rank has exited 0 and written nothing on stderr."""
    env = dict(os.environ, MASTER_ADDR=LOOPBACK, MASTER_PORT=str(free_port()))
    procs = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLES / script), str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs: dict[int, tuple[str, str]] = {}
    deadline = time.monotonic() + TIMEOUT
    try:
        for rank, proc in enumerate(procs):
            outputs[rank] = proc.communicate(timeout=max(deadline - time.monotonic(), 0))
    except subprocess.TimeoutExpired:
        pass  # the ranks still running are killed: their return codes say so
    finally:
        for proc in procs:
            proc.kill()
        for rank, proc in enumerate(procs):
            if rank not in outputs:
                outputs[rank] = proc.communicate()
    printed = [outputs[rank] for rank in range(world_size)]
    report = "\n".join(
        f"-- rank {rank}, stdout:\n{out}-- stderr:\n{err}"
        for rank, (out, err) in enumerate(printed)
    )
    assert [proc.returncode for proc in procs] == [0] * world_size, report
    assert [err for _, err in printed] == [""] * world_size, report
    return [out for out, _ in printed]


def test_parameter_server():
    server, *trainers = run_ranks("rpc_parameter_server.py", world_size=3)
    assert server.splitlines() == [
        "PS master initializing RPC",
        "RPC initialized! Running parameter server...",
        "RPC shutdown on parameter server.",
        # one server for both trainers (its module's lock and global are
        # the server process's own), one step per batch of each: 2 x 10
        "The parameter server took 20 optimizer steps.",
    ]
    for rank, out in enumerate(trainers, start=1):
        lines = out.splitlines()
        assert lines[:2] == [
            f"Worker rank {rank} initializing RPC",
            f"Worker {rank} done initializing RPC",
        ]
        losses = [
            float(re.fullmatch(rf"Rank {rank} training batch {batch} loss (\d+\.\d{{4}})", line)[1])
            for batch, line in zip((0, 5), lines[2:4], strict=True)
        ]
        assert losses[1] < losses[0], out
        # the classes are far apart: every test image is told right,
        # however the two trainers' steps interleave
        assert lines[4:] == ["Training complete!", "Getting accuracy....", "Accuracy 1.0"], out


def test_batch_parameter_server():
    server, *trainers = run_ranks("rpc_batch_parameter_server.py", world_size=3)
    assert server.splitlines() == ["Start training", "Finish training: the model took 6 updates"]
    for rank, out in enumerate(trainers, start=1):
        # each call returned once both trainers' gradients had updated the
        # model: batch i is trained on the model of i updates
        pattern = rf"trainer{rank} batch (\d): loss \d+\.\d{{4}} on the model of (\d) updates"
        seen = [re.fullmatch(pattern, line) for line in out.splitlines()]
        assert all(seen) and [(int(m[1]), int(m[2])) for m in seen] == [(i, i) for i in range(6)], (
            out
        )


def test_rref_pipeline():
    master, worker1, worker2 = run_ranks("rpc_pipeline.py", world_size=3)
    assert worker1 == worker2 == ""
    lines = master.splitlines()
    splits = [line for line in lines if line.startswith("number of splits")]
    assert [line for line in lines if line not in splits] == [
        f"Processing batch {i}" for _ in range(4) for i in range(3)
    ], master
    pattern = r"number of splits = (\d), losses = (\S+) (\S+) (\S+), execution time = \S+ s"
    found = [re.fullmatch(pattern, line) for line in splits]
    assert all(found) and [int(m[1]) for m in found] == [1, 2, 4, 8], master
    losses = np.array([[float(loss) for loss in m.groups()[1:]] for m in found])
    # micro-batches change the schedule, not the arithmetic
    np.testing.assert_allclose(losses, np.broadcast_to(losses[0], losses.shape), rtol=1e-5)
    assert losses[0, 0] > losses[0, 1] > losses[0, 2], master  # it trains
