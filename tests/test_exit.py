"""Interpreter exit and Ctrl-C: what runs, what is cancelled, and that exit
always ends. Each case runs in a child process with a timeout."""

from __future__ import annotations

import signal
import time

import pytest
from helpers import run_python, start_python

pytestmark = pytest.mark.timeout(60)


def wait_for_line(proc, text: str, timeout: float = 20) -> str:
    """Read the child's stdout up to a line containing ``text``; return it all."""
    deadline = time.monotonic() + timeout
    read = ""
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        read += line
        if text in line:
            return read
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"the child never printed {text!r}: {proc.communicate()}")


def interrupt_exits_at_once(proc) -> None:
    """Ctrl-C while exit waits: the child exits at once, as interrupted."""
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130
    assert time.monotonic() - sent < 5


def interrupted_again_says_one_line(proc) -> None:
    """A second Ctrl-C while exit waits: the child exits at once, saying so
    in one line, with no traceback."""
    interrupt_exits_at_once(proc)
    rest = proc.stderr.read()
    assert "aiopar: interrupted again, exiting without waiting" in rest
    assert "Traceback" not in rest and "Exception ignored" not in rest, rest


def test_exit_finishes_a_coroutine_fork_a_thread_task_waits_for():
    done = run_python(
        """
        import asyncio, aiopar

        async def slow():
            await asyncio.sleep(0.3)
            return "coroutine"

        def waits():
            print(aiopar.fork(slow).wait(), "finished", flush=True)

        aiopar.fork(waits)
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "coroutine finished\n"


def test_exit_runs_the_coroutine_forks_still_queued_on_the_owned_loop():
    done = run_python(
        """
        import asyncio, aiopar

        async def step(i):
            await asyncio.sleep(0.01)
            print("ran", i, flush=True)

        for i in range(5):
            aiopar.fork(step, i)
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"ran {i}" for i in range(5)]


def test_exit_runs_a_coroutine_fork_that_is_on_the_loop_but_has_not_started():
    # Exit must not take a fork whose task exists but has not taken its
    # first step for one the loop dropped, and cancel it.
    done = run_python(
        """
        import asyncio, threading, aiopar

        loop_of = {}
        blocking, queued, exiting = threading.Event(), threading.Event(), threading.Event()

        # Registered after aiopar's own exit hook, so called before it.
        threading._register_atexit(exiting.set)

        async def block_the_loop():
            loop_of["owned"] = asyncio.get_running_loop()
            blocking.set()
            queued.wait(10)  # nothing else on the loop runs meanwhile

        aiopar.fork(block_the_loop)
        blocking.wait()

        async def step():
            print("ran", flush=True)

        aiopar.fork(step)  # its task is made once the loop is free...
        loop_of["owned"].call_soon_threadsafe(exiting.wait, 10)  # ...and waits behind this
        queued.set()
        # exit while it waits
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["ran"]


def test_exit_says_what_it_waits_for_and_ctrl_c_ends_it_at_once():
    proc = start_python(
        """
        import asyncio, aiopar

        async def forever():
            await asyncio.sleep(3600)

        aiopar.fork(forever)
        print("exiting", flush=True)
        """
    )
    try:
        wait_for_line(proc, "exiting")
        deadline = time.monotonic() + 20
        stderr_line = proc.stderr.readline()  # the report, a second into the wait
        assert time.monotonic() < deadline
        assert "aiopar: waiting for 1 running task to finish before exit" in stderr_line
        assert "forever (coroutine)" in stderr_line
        interrupt_exits_at_once(proc)
    finally:
        proc.kill()
        proc.communicate()


QUEUED_THEN_INTERRUPTED = """
    import os, sys, time, aiopar

    aiopar.set_num_interop_threads(2)

    def say(line):  # one write per line: threads print at the same time
        sys.stdout.write(line + "\\n")
        sys.stdout.flush()

    def task(i):
        say(f"started {{i}}")
        # Runs until the test lets it go, which it does only once exit has
        # begun to wait for the running tasks: by then the queued ones must
        # have been cancelled, however slowly a loaded machine got there. It
        # computes meanwhile: a task blocked in a sleep would get a stand-in
        # worker, which would start the queued ones.
        while not os.path.exists({release!r}):
            pass
        say(f"finished {{i}}")

    futs = [aiopar.fork(task, i) for i in range(20)]
    print("waiting", flush=True)
    {wait}
"""


@pytest.mark.parametrize(
    "wait",
    [
        "aiopar.wait_all(futs)",
        "futs[-1].wait(timeout=60)",
        "for f in aiopar.as_completed(futs): pass",
    ],
)
def test_ctrl_c_cancels_what_has_not_started_and_exit_waits_only_for_running_tasks(wait, tmp_path):
    release = tmp_path / "release"
    proc = start_python(QUEUED_THEN_INTERRUPTED.format(wait=wait, release=str(release)))
    try:
        out = wait_for_line(proc, "waiting")
        while out.count("started") < 2:  # the workers (or a worker and the main thread) run
            out += wait_for_line(proc, "started")
        proc.send_signal(signal.SIGINT)
        err = ""
        while "aiopar: waiting for" not in err:  # exit has cancelled the queue and waits
            line = proc.stderr.readline()
            assert line, f"the child never said exit waits: {err}"
            err += line
        release.touch()
        rest, err_rest = proc.communicate(timeout=30)
    finally:
        proc.kill()
    out += rest
    err += err_rest
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    # The task the main thread ran stopped with the interrupt: its future's
    # CancelledError is aiopar's bookkeeping, not a failure nobody read.
    assert "nobody retrieved" not in err, err
    ran = {line.split()[1] for line in out.splitlines() if line.startswith("started")}
    finished = {line.split()[1] for line in out.splitlines() if line.startswith("finished")}
    assert len(ran) <= 3, f"tasks queued before Ctrl-C still ran: {out}"
    # Only a task the main thread ran itself (wait_all runs queued ones) stops
    # at Ctrl-C; exit waits for those running on workers.
    assert len(ran - finished) <= 1 and finished, f"running tasks not waited for: {out}"


def test_a_second_ctrl_c_exits_without_waiting():
    proc = start_python(
        """
        import time, aiopar

        def task():
            print("running", flush=True)
            time.sleep(60)

        fut = aiopar.fork(task)
        fut2 = aiopar.fork(task)
        print("waiting", flush=True)
        fut.wait()
        """
    )
    try:
        if "running" not in wait_for_line(proc, "waiting"):
            wait_for_line(proc, "running")
        proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 20
        while "aiopar: waiting for" not in proc.stderr.readline():  # after the traceback
            assert time.monotonic() < deadline
        interrupt_exits_at_once(proc)
    finally:
        proc.kill()
        proc.communicate()


def test_exit_runs_nested_forks_queued_on_a_scoped_pool():
    # The pool was shut down before its queued tasks ran, and their forks
    # failed with "cannot fork on ...: it has been shut down".
    done = run_python(
        """
        import sys, time, aiopar

        def leaf(i):
            sys.stdout.write(f"leaf {i}\\n")  # one write: workers print at the same time
            sys.stdout.flush()

        def outer(i):
            time.sleep(0.01)
            aiopar.fork(leaf, i)

        with aiopar.use_backend("thread", max_workers=2):
            for i in range(6):
                aiopar.fork(outer, i)
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [f"leaf {i}" for i in range(6)], done.stdout
    assert "Traceback" not in done.stderr, done.stderr


def test_a_plugins_exit_hook_runs_after_queued_work_and_before_shutdown():
    # What rpc needs: its agent leaves its peers only once the tasks queued
    # at exit, which may call them, have run.
    done = run_python(
        """
        import time, aiopar
        from aiopar.lowlevel import at_exit

        pool = aiopar.get_backend("thread", max_workers=1)

        def hook():
            print("hook, pool open:", not pool.closed, flush=True)

        at_exit(hook)

        def task(i):
            time.sleep(0.01)
            print("task", i, flush=True)

        for i in range(3):
            pool.fork(task, i)
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "task 0",
        "task 1",
        "task 2",
        "hook, pool open: True",
    ], done.stdout


def test_tasks_queued_at_exit_may_still_use_a_thread_pool_executor():
    # concurrent.futures refuses new work once its own exit hook has run
    # ("cannot schedule new futures after interpreter shutdown"): queued
    # tasks run before it, as the rpc plugin's calls (offloaded by dask) need.
    done = run_python(
        """
        import concurrent.futures, time, aiopar

        executor = concurrent.futures.ThreadPoolExecutor(1)

        def task(i):
            time.sleep(0.01)
            got = executor.submit(int, str(i)).result()
            print(f"task {i} {got}\\n", end="", flush=True)  # one write: two may run at once

        pool = aiopar.get_backend("thread", max_workers=1)
        for i in range(3):
            pool.fork(task, i)
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    # In any order: a task blocked in its sleep gets a stand-in that runs the next.
    assert sorted(done.stdout.splitlines()) == [f"task {i} {i}" for i in range(3)], done.stderr


def read_stderr_until(proc, text: str) -> str:
    """Read the child's stderr up to a line containing ``text``; return it all."""
    err = ""
    while text not in err:
        line = proc.stderr.readline()
        assert line, f"the child never said {text!r}: {err}{proc.communicate()}"
        err += line
    return err


# A task that runs until the child is killed, on each kind of backend; the
# process backend's grace is long, so only Ctrl-C ends exit's wait.
RUNS_UNTIL_KILLED = """
    import sys, time, aiopar

    def forever():
        print("running", flush=True)
        time.sleep(3600)

    backend = aiopar.get_backend({backend!r}, **{options!r})
    fut = backend.fork(forever)
    while not fut.running():  # on a worker: a wait would run it itself before
        time.sleep(0.01)
    {then}
"""
BACKENDS = {"thread": {}, "process": {"max_workers": 1, "grace": 3600}}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_second_ctrl_c_while_exit_waits_says_one_line_on_every_backend(backend):
    # On the process backend, exit waited in the pool's own atexit handler,
    # where Ctrl-C printed "Exception ignored in atexit callback" and a
    # traceback, and nothing named the running task.
    code = RUNS_UNTIL_KILLED.format(
        backend=backend, options=BACKENDS[backend], then='print("waiting", flush=True); fut.wait()'
    )
    proc = start_python(code)
    try:
        out = wait_for_line(proc, "waiting")
        if "running" not in out:
            wait_for_line(proc, "running")
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        err = read_stderr_until(proc, "aiopar: waiting for 1 running task")
        assert time.monotonic() - sent < 10, "exit said nothing for a long while"
        assert f"forever ({backend})" in err
        assert err.count("Traceback") == 1, err  # the first Ctrl-C's, of the main thread
        interrupted_again_says_one_line(proc)
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.parametrize("backend", BACKENDS)
def test_exit_says_which_task_it_waits_for_and_ctrl_c_ends_it_on_every_backend(backend):
    proc = start_python(
        RUNS_UNTIL_KILLED.format(backend=backend, options=BACKENDS[backend], then="")
    )
    try:
        wait_for_line(proc, "running")
        err = read_stderr_until(proc, "aiopar: waiting for 1 running task")
        assert f"forever ({backend})" in err and "Traceback" not in err, err
        interrupted_again_says_one_line(proc)
    finally:
        proc.kill()
        proc.communicate()


def test_exit_waiting_for_a_process_task_says_so_in_one_line():
    # The process pool said it waits in a line of its own, beside exit's.
    done = run_python(
        """
        import time, aiopar

        def finishes_late():
            time.sleep(2.5)
            print("finished", flush=True)

        backend = aiopar.get_backend("process", max_workers=1, grace=3600)
        fut = backend.fork(finishes_late)
        while not fut.running():  # on a worker when exit begins
            time.sleep(0.01)
        """,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "finished\n"
    waiting = [line for line in done.stderr.splitlines() if "waiting" in line]
    assert len(waiting) == 1 and "finishes_late (process)" in waiting[0], done.stderr
