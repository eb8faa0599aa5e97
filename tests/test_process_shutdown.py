"""Stopping the process backend: cancel, shutdown, tasks that never return, exit, os.fork().

Whatever could hang runs in a subprocess with a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import process_helpers
import pytest
from helpers import eventually
from process_helpers import (
    FileGate,
    add,
    exited,
    run_script,
    script_env,
    sleep_then,
    until_opened,
)

import aiopar
from aiopar.backends.process import ProcessBackend

# The shared fixtures; nothing_left_behind checks every test (autouse).
nothing_left_behind = process_helpers.nothing_left_behind
pool = process_helpers.pool
own_pool = process_helpers.own_pool


# -- cancel and shutdown ---------------------------------------------------------


def test_cancel_before_sent(own_pool, tmp_path):
    backend = own_pool(1, prefetch=0)
    gate = FileGate(tmp_path / "gate")
    running = backend.fork(until_opened, gate.path, "first")
    queued = backend.fork(add, 1)
    assert queued.cancel()
    assert queued.cancelled()
    with pytest.raises(aiopar.CancelledError):
        queued.wait()
    gate.open()
    assert running.wait() == "first"
    assert not running.cancel()


def test_prefetched_task_is_no_longer_cancellable(own_pool, tmp_path):
    backend = own_pool(1, prefetch=1)
    gate = FileGate(tmp_path / "gate")
    running = backend.fork(until_opened, gate.path, "first")
    eventually(running.running)
    prefetched = backend.fork(add, 1)
    queued = backend.fork(add, 2)
    assert not prefetched.cancel()
    assert queued.cancel()
    gate.open()
    assert running.wait() == "first" and prefetched.wait() == 1


def test_shutdown_runs_what_was_queued(own_pool):
    backend = own_pool(1)
    futures = [backend.fork(sleep_then, 0.02, i) for i in range(6)]
    backend.shutdown(wait=True)
    assert [f.value() for f in futures] == list(range(6))
    assert backend._pool.workers == []
    with pytest.raises(RuntimeError, match="shut down"):
        backend.fork(add, 1)


def test_shutdown_cancel_pending(own_pool, tmp_path):
    backend = own_pool(1, prefetch=0)
    gate = FileGate(tmp_path / "gate")
    running = backend.fork(until_opened, gate.path, "ran")
    eventually(running.running)
    queued = [backend.fork(add, i) for i in range(5)]
    queued[-1].add_done_callback(gate.open)  # the task ends once shutdown has cancelled them
    backend.shutdown(wait=True, cancel_pending=True)
    assert running.value() == "ran"
    assert all(f.cancelled() for f in queued)


def test_shutdown_without_wait_finishes_in_the_background(own_pool):
    backend = own_pool(1)
    futures = [backend.fork(sleep_then, 0.02, i) for i in range(3)]
    backend.shutdown(wait=False)
    assert [f.wait(timeout=30) for f in futures] == [0, 1, 2]
    backend.shutdown(wait=True)  # joins the manager


def test_shutdown_of_an_unused_backend():
    threads_before = set(threading.enumerate())
    backend = ProcessBackend(1)
    backend.shutdown()
    backend.shutdown()  # again: does nothing
    assert backend.closed
    assert backend._pool.workers == []
    assert set(threading.enumerate()) <= threads_before  # no manager left behind
    with pytest.raises(RuntimeError, match="shut down"):
        backend.fork(add, 1)


def test_interpreter_exit_with_pending_work(tmp_path):
    done = run_script(
        tmp_path,
        """
        import time, aiopar
        backend = aiopar.get_backend("process", max_workers=1)
        futures = [backend.fork(time.sleep, 0.05) for _ in range(4)]
        futures[-1].add_done_callback(lambda f: print("last done", flush=True))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "last done" in done.stdout
    assert "Traceback" not in done.stderr


# -- tasks that never return -----------------------------------------------------------


def test_shutdown_cancel_pending_terminates_a_stuck_worker(tmp_path):
    done = run_script(
        tmp_path,
        """
        import time
        from aiopar.backends.process import ProcessBackend

        backend = ProcessBackend(1, prefetch=1, grace=0.5)
        stuck = backend.fork(time.sleep, 3600)
        prefetched = backend.fork(abs, -1)  # sent to the stuck worker behind it
        queued = backend.fork(abs, -2)
        while not stuck.running():
            time.sleep(0.01)
        backend.shutdown(wait=True, cancel_pending=True)
        print("stuck:", repr(stuck.exception()))
        print("prefetched cancelled:", prefetched.cancelled())
        print("queued cancelled:", queued.cancelled())
        print("workers left:", len(backend._pool.workers))
        """,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "stuck: BrokenWorkerError(" in out
    assert "sleep() was terminated at shutdown" in out
    assert "0.5 s after shutdown(cancel_pending=True)" in out
    assert "prefetched cancelled: True" in out  # it never started: its worker was stopped first
    assert "queued cancelled: True" in out
    assert "workers left: 0" in out
    assert "terminating" in done.stderr  # logged, with what to change


def test_a_stuck_worker_that_ignores_sigterm_is_killed(tmp_path):
    done = run_script(
        tmp_path,
        """
        import os, signal, time
        from aiopar.backends.process import ProcessBackend

        def stubborn():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open("ignoring", "w").close()
            time.sleep(3600)

        backend = ProcessBackend(1, grace=0.2)
        future = backend.fork(stubborn)
        while not os.path.exists("ignoring"):
            time.sleep(0.01)
        backend.shutdown(cancel_pending=True)
        print(repr(future.exception()))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "BrokenWorkerError(" in done.stdout and "stubborn() was terminated" in done.stdout


def test_interpreter_exit_terminates_a_stuck_worker(tmp_path):
    done = run_script(
        tmp_path,
        """
        import time, aiopar

        backend = aiopar.get_backend("process", max_workers=1, grace=0.5)
        stuck = backend.fork(time.sleep, 3600)
        stuck.add_done_callback(lambda f: print("stuck:", repr(f.exception()), flush=True))
        finished = backend.fork(abs, -3)
        while not stuck.running():
            time.sleep(0.01)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "stuck: BrokenWorkerError(" in done.stdout
    assert "the interpreter is exiting and no task finished for 0.5 s" in done.stdout


def test_exit_after_an_uncaught_keyboard_interrupt_cancels_the_queue(tmp_path):
    done = run_script(
        tmp_path,
        """
        import time, aiopar

        backend = aiopar.get_backend("process", max_workers=1, prefetch=0, grace=0.5)
        assert backend.fork(abs, -1).wait() == 1
        stuck = backend.fork(time.sleep, 3600)  # starts at once on the idle worker
        stuck.add_done_callback(lambda f: print("stuck:", repr(f.exception()), flush=True))
        for i in range(3):
            backend.fork(print, "ran", i).add_done_callback(
                lambda f: print("cancelled:", f.cancelled(), flush=True)
            )
        raise KeyboardInterrupt
        """,
    )
    assert done.returncode != 0  # the interrupt still ends the program
    assert done.stdout.count("cancelled: True") == 3 and "ran 0" not in done.stdout
    assert "0.5 s after an uncaught KeyboardInterrupt" in done.stdout


def test_exit_still_runs_the_queue_while_tasks_finish(tmp_path):
    # No task takes the grace period, so all of them run although together
    # they take longer. The worker is up first: its start is no task.
    done = run_script(
        tmp_path,
        """
        import time, aiopar

        backend = aiopar.get_backend("process", max_workers=1, grace=1.0)
        backend.fork(int).wait()
        futures = [backend.fork(time.sleep, 0.1) for _ in range(15)]
        futures[-1].add_done_callback(lambda f: print("last:", f.exception(), flush=True))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "last: None" in done.stdout


def test_exit_gives_a_task_that_starts_after_a_quiet_spell_its_whole_grace(tmp_path):
    # Exit's drain sets the deadline as it begins; a thread task forks on
    # the idle pool once that has passed. The third fork waits for a new
    # worker, which wakes the manager: it found the deadline passed and
    # terminated the two tasks just sent, and cancelled the third.
    done = run_script(
        tmp_path,
        """
        import time, aiopar

        procs = aiopar.get_backend("process", max_workers=3, prefetch=0, grace=3.0)
        aiopar.wait_all([procs.fork(time.sleep, 0.05) for _ in range(2)])  # two workers up

        def after_a_quiet_spell():
            time.sleep(3.5)
            for i in range(3):
                procs.fork(time.sleep, 0.2).add_done_callback(
                    lambda f, i=i: print(i, f.cancelled() or f.exception(), flush=True)
                )

        aiopar.fork(after_a_quiet_spell)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == ["0 None", "1 None", "2 None"], done.stdout


def test_workers_exit_when_the_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time, aiopar

            backend = aiopar.get_backend("process", max_workers=2, prefetch=0)
            aiopar.wait_all([backend.fork(time.sleep, 0.3) for _ in range(2)])
            stuck = backend.fork(time.sleep, 3600)  # one worker busy, the other idle
            while not stuck.running():
                time.sleep(0.01)
            print(*[w.pid for w in backend._pool.workers], flush=True)
            time.sleep(3600)
            """
        )
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=script_env()
    )
    pids: list[int] = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10  # a second is the promise; the machine is shared
        while not all(exited(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [pid for pid in pids if not exited(pid)] == []
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        for pid in pids:
            if not exited(pid):
                os.kill(pid, signal.SIGKILL)


# -- os.fork() ---------------------------------------------------------------------------


def test_a_forked_child_gets_a_fresh_pool(tmp_path):
    done = run_script(
        tmp_path,
        """
        import multiprocessing, os, time, traceback
        import numpy as np
        import aiopar
        from process_helpers import FileGate, until_opened

        backend = aiopar.get_backend("process", max_workers=2)
        parent_workers = set(aiopar.wait_all([backend.fork(os.getpid) for _ in range(4)]))
        inherited = {os.fstat(w.channel.fileno()).st_ino for w in backend._pool.workers}

        def open_sockets():
            inodes = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    link = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
            return inodes

        def child():
            # The parent's worker sockets are closed here, so its workers
            # see it shut them down.
            assert not open_sockets() & inherited, "a worker socket of the parent is open"
            # A task pending at the fork is the parent's: it fails here.
            error = pending.exception(timeout=10)
            assert isinstance(error, aiopar.BrokenWorkerError), error
            assert "os.fork" in str(error)
            pool = aiopar.get_backend("process", max_workers=2)
            assert aiopar.wait_all([pool.fork(pow, 2, i) for i in range(8)]) == [
                2**i for i in range(8)
            ]
            pids = set(aiopar.wait_all([pool.fork(os.getpid) for _ in range(4)]))
            assert not pids & parent_workers and os.getpid() not in pids
            big = np.arange(1_000_000.0)  # through shared memory
            assert (pool.fork(np.negative, big).wait() == -big).all()
            pool.shutdown()

        def run_child():
            try:
                child()
            except BaseException:
                traceback.print_exc()
                os._exit(1)

        gate = FileGate("os.fork")  # the task runs until the child is done
        pending = backend.fork(until_opened, gate.path)
        pid = os.fork()
        if pid == 0:
            run_child()
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "os.fork child failed"
        gate.open()
        assert pending.wait(timeout=30) is None  # the parent's copy is unharmed

        gate = FileGate("multiprocessing")
        pending = backend.fork(until_opened, gate.path)
        process = multiprocessing.get_context("fork").Process(target=run_child)
        process.start()
        process.join(60)
        assert process.exitcode == 0, f"multiprocessing child: exit code {process.exitcode}"
        gate.open()
        assert pending.wait(timeout=30) is None

        assert backend.fork(abs, -5).wait() == 5
        backend.shutdown()
        print("ok")
        """,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_running_tasks_names_what_the_workers_run(own_pool, tmp_path):
    # What interpreter exit reports it waits for, and the only case where
    # its wait is worth a warning (idle workers may just be slow to exit).
    backend = own_pool(1, prefetch=0)
    assert backend.running_tasks() == []
    gate = FileGate(tmp_path / "gate")
    running = backend.fork(until_opened, gate.path, "done")
    queued = backend.fork(add, 1)
    eventually(running.running)
    assert backend.running_tasks() == ["until_opened"]
    gate.open()
    assert running.wait(timeout=30) == "done" and queued.wait(timeout=30) == 1
    assert backend.running_tasks() == []
