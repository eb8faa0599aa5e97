"""examples/starlette_app.py under uvicorn: every response right under load,
and a SIGTERM stops it cleanly, its process workers with it."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import psutil
import pytest

aiohttp = pytest.importorskip("aiohttp")
pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

ROOT = Path(__file__).resolve().parent.parent
GRACE = 5  # uvicorn's --timeout-graceful-shutdown, seconds
REQUESTS = 600
CONCURRENCY = 24


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_serving(proc: subprocess.Popen[bytes], url: str, timeout: float = 30) -> None:
    """Return once ``url`` answers 200; fail if the server exits or the
    deadline passes first (it imports numpy and aiopar before it listens)."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        assert time.monotonic() < deadline, "the server did not answer in time"
        time.sleep(0.05)


def running(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def expected_matmul_sum(seed: int) -> float:
    a, b = np.random.default_rng(seed).integers(0, 10, (2, 300, 300)).astype(np.float64)
    return float((a @ b).sum())


def requests_to_send() -> list[tuple[str, dict[str, object]]]:
    """(path, the body it must answer), the three endpoints mixed."""
    rng = random.Random(38)
    matmul_sums = {seed: expected_matmul_sum(seed) for seed in range(8)}
    sent: list[tuple[str, dict[str, object]]] = []
    for i in range(REQUESTS):
        kind = i % 3
        if kind == 0:
            seed = rng.randrange(8)
            sent.append((f"/matmul?seed={seed}", {"seed": seed, "sum": matmul_sums[seed]}))
        elif kind == 1:
            seconds = rng.choice([0.0, 0.01, 0.02])
            sent.append((f"/blocking?seconds={seconds}", {"slept": seconds}))
        else:
            n = rng.randrange(1_000, 20_000)
            sent.append((f"/cpu?n={n}", {"n": n, "sum_of_squares": (n - 1) * n * (2 * n - 1) // 6}))
    rng.shuffle(sent)
    return sent


async def load(base: str, sent: list[tuple[str, dict[str, object]]]) -> list[str]:
    """Send every request, ``CONCURRENCY`` at a time; what went wrong, if anything."""
    wrong: list[str] = []
    gate = asyncio.Semaphore(CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=30)

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(path: str, body: dict[str, object]) -> None:
            async with gate, session.get(base + path) as response:
                got = await response.json() if response.status == 200 else await response.text()
                if response.status != 200 or got != body:
                    wrong.append(f"{path}: {response.status} {got!r}, expected {body!r}")

        await asyncio.gather(*(one(path, body) for path, body in sent))
    return wrong


@pytest.mark.timeout(60)
def test_the_app_answers_every_request_and_stops_cleanly(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = (tmp_path / "server.log").open("w+b")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "examples.starlette_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--timeout-graceful-shutdown",
            str(GRACE),
            "--no-access-log",  # keeps the log to what the checks read
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own group, so cleanup can end all of it
    )
    try:
        wait_until_serving(proc, base + "/health")
        wrong = asyncio.run(load(base, requests_to_send()))
        assert not wrong, f"{len(wrong)} of {REQUESTS} wrong, first: {wrong[:3]}"

        # The /cpu requests ran on the process backend's workers.
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children, "the process backend started no worker"

        proc.send_signal(signal.SIGTERM)
        # uvicorn ends by raising SIGTERM again with its default action.
        assert proc.wait(timeout=GRACE + 10) in (0, -signal.SIGTERM)
        log.seek(0)
        output = log.read().decode(errors="replace")
        assert "Application shutdown complete" in output, output
        assert "Traceback" not in output and "ERROR" not in output, output

        # The workers exit with their parent: nothing is left.
        deadline = time.monotonic() + 10
        while alive := [c for c in children if running(c)]:
            assert time.monotonic() < deadline, f"left running: {alive}"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
