"""A user's script as typed: no ``if __name__ == "__main__":`` guard, saved
to a file or piped to ``python -``. The clusters aiopar starts never run
the script again in their processes (multiprocessing's spawn would)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(180)

UNGUARDED = """\
import os
import aiopar
from aiopar import rpc

print("the script starts", flush=True)

with aiopar.use_backend("dask", n_workers=1, threads_per_worker=1):
    pids = aiopar.wait_all([aiopar.fork(os.getpid) for _ in range(2)])
    print("dask elsewhere:", os.getpid() not in pids, flush=True)

rpc.init_rpc("worker0", world_size=2)
print("rpc elsewhere:", rpc.rpc_sync("worker1", os.getpid) != os.getpid(), flush=True)
rpc.shutdown()
"""


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_an_unguarded_script_runs_once_with_a_cluster_and_rpc_peers(how, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED)
    with script.open() as source:
        done = subprocess.run(
            [sys.executable, script.name if how == "file" else "-"],
            stdin=subprocess.DEVNULL if how == "file" else source,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=150,
        )
    assert done.returncode == 0, done.stderr
    expected = "the script starts\ndask elsewhere: True\nrpc elsewhere: True\n"
    assert done.stdout == expected, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_a_killed_script_leaves_no_cluster_process_behind(tmp_path):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, psutil, time, aiopar\n"
            "with aiopar.use_backend('dask', n_workers=1, threads_per_worker=1):\n"
            "    aiopar.fork(os.getpid).wait()\n"
            "    print(*[p.pid for p in psutil.Process().children(recursive=True)], flush=True)\n"
            "    time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pids = [int(pid) for pid in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
    assert len(pids) >= 2  # a nanny and its worker
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(psutil.pid_exists(pid) for pid in pids):
        time.sleep(0.1)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, f"still running after their script was killed: {alive}"


@pytest.mark.parametrize(
    "uses",
    [
        "with aiopar.use_backend('dask', n_workers=1, processes=False):\n"
        "    aiopar.fork(abs, -1).wait()\n",
        "rpc.init_rpc('worker0', world_size=1)\nrpc.shutdown()\n",
    ],
    ids=["backend", "rpc"],
)
def test_a_script_named_distributed_py_fails_with_an_import_error_naming_it(uses, tmp_path):
    # The plugin's `import distributed` imported the script again, which hung for ever.
    script = tmp_path / "distributed.py"
    script.write_text(f"import aiopar\nfrom aiopar import rpc\n{uses}")
    done = subprocess.run(
        [sys.executable, script.name], capture_output=True, text=True, cwd=tmp_path, timeout=60
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: "), done.stderr
    assert str(script) in last and "rename it" in last, last
