"""aiopar.rpc under torch's launcher: a torchrun script with only the rpc
import changed. torchrun holds MASTER_PORT itself (its store); the ranks
meet through that store. Skipped where torch is not installed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch", reason="torchrun comes with torch, which is not installed")

pytestmark = pytest.mark.timeout(180)

# torch's own shape of a torchrun script, with `from aiopar import rpc` for
# `import torch.distributed.rpc as rpc`.
SCRIPT = """
    import os
    from aiopar import rpc

    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    other = rpc.rpc_sync(f"worker{(rank + 1) % world_size}", os.getpid)
    print("rank", rank, "called a process of its own:", other != os.getpid(), flush=True)
    rpc.shutdown()
"""


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize("how", ["master_port", "standalone"])
def test_a_torchrun_script_runs_with_only_the_import_changed(how, tmp_path):
    # Every rank waited 60 s for a dask scheduler on MASTER_PORT, where torchrun's store is.
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    where = (
        ["--standalone"]
        if how == "standalone"
        else ["--master_addr=localhost", f"--master_port={free_port()}"]
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", *where]
    done = subprocess.run(
        [*command, str(script)], capture_output=True, text=True, cwd=tmp_path, timeout=150
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank"))
    assert lines == [f"rank {r} called a process of its own: True" for r in range(3)], done.stderr
    assert "Traceback" not in done.stderr, done.stderr
