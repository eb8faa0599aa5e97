"""A process worker that dies fails only its own task; the queue runs on a replacement."""

from __future__ import annotations

import os
import signal
import time

import process_helpers
import pytest
from helpers import eventually
from process_helpers import add, exit_now, kill_self, segfault

import aiopar
from aiopar import _fresh

# The shared fixtures; nothing_left_behind checks every test (autouse).
nothing_left_behind = process_helpers.nothing_left_behind
own_pool = process_helpers.own_pool


# -- crashes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "args", "words"),
    [
        (kill_self, (), "SIGKILL"),
        (exit_now, (3,), "exited with code 3"),
        (segfault, (), "SIGSEGV"),
    ],
    ids=["sigkill", "os_exit", "segfault"],
)
def test_a_dying_worker_fails_only_its_task(own_pool, fn, args, words):
    backend = own_pool(1)  # one worker: the queued tasks sit behind the dying one
    doomed = backend.fork(fn, *args)
    queued = [backend.fork(add, i, 1) for i in range(4)]
    with pytest.raises(aiopar.BrokenWorkerError, match=words) as info:
        doomed.wait(timeout=30)
    assert fn.__name__ in str(info.value)
    assert [f.wait(timeout=30) for f in queued] == [1, 2, 3, 4]
    assert backend.fork(add, 1, 1).wait() == 2  # replaced


def test_sigkill_from_outside_while_running(own_pool, tmp_path):
    backend = own_pool(1)
    marker = tmp_path / "pid"
    fut = backend.fork(_write_pid_and_sleep, str(marker))
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    with pytest.raises(aiopar.BrokenWorkerError, match="SIGKILL"):
        fut.wait(timeout=30)
    assert backend.fork(add, 2, 2).wait() == 4


def _write_pid_and_sleep(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(30)


def test_an_idle_worker_that_dies_is_replaced(own_pool):
    backend = own_pool(1)
    pid = backend.fork(os.getpid).wait()
    os.kill(pid, signal.SIGKILL)
    eventually(lambda: all(worker.pid != pid for worker in backend._pool.workers))
    assert backend.fork(os.getpid).wait(timeout=30) != pid


def test_workers_that_cannot_start_fail_the_queue(own_pool, monkeypatch):
    monkeypatch.setattr(_fresh, "BOOT", "import sys; sys.exit(7)")
    backend = own_pool(1)
    with pytest.raises(aiopar.BrokenWorkerError, match="before they were ready"):
        backend.fork(add, 1).wait(timeout=30)
