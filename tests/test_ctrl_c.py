"""Ctrl-C is never lost and never leaves a pool's lock held.

A SIGINT that arrives just before the main thread blocks (or that another
thread takes) does not wake that wait: each wait of aiopar's on the main
thread must still raise the KeyboardInterrupt. The children here reproduce
that every time: their main thread blocks SIGINT, so a thread of their own
takes it and the main thread's wait is never woken by it.

CPython raises a KeyboardInterrupt as a call returns. One raised as
``lock.acquire()`` returns, before the ``try`` that releases the lock, leaves
the lock held for good: if it is a pool's, the interpreter's exit, which
needs it, hangs. The last tests raise one after each call fork makes.
"""

from __future__ import annotations

import signal
import subprocess
import textwrap

import pytest
from helpers import run_python, start_python

pytestmark = pytest.mark.timeout(60)

# The main thread blocks SIGINT; a thread started before it did takes it.
MISSED_BY_THE_MAIN_THREAD = """
    import signal, sys, threading, time

    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    import aiopar

    fut = aiopar.Future()
"""


def interrupt(code: str, *, says: str) -> subprocess.Popen[str]:
    """Start ``code`` after the preamble above, wait until its stdout (or,
    if ``says`` starts with "aiopar:", its stderr) says ``says``, send SIGINT."""
    proc = start_python(textwrap.dedent(MISSED_BY_THE_MAIN_THREAD) + code)
    stream = proc.stderr if says.startswith("aiopar:") else proc.stdout
    assert stream is not None
    read = ""
    while says not in read:
        line = stream.readline()
        assert line, f"the child never said {says!r}: {read}{proc.communicate()}"
        read += line
    proc.send_signal(signal.SIGINT)
    return proc


def finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"Ctrl-C did not end the wait: {out}{err}")


WAITS = {
    "wait": "fut.wait()",
    "wait with a timeout": "fut.wait(timeout=3600)",
    "result": "fut.result()",
    "exception": "fut.exception()",
    "wait_all": "aiopar.wait_all([fut])",
    "as_completed": "next(aiopar.as_completed([fut]))",
    "TaskGroup": "with group: pass",
}


@pytest.mark.parametrize("wait", WAITS.values(), ids=WAITS.keys())
def test_a_wait_on_the_main_thread_ends_with_a_ctrl_c_its_lock_missed(wait):
    proc = interrupt(
        f"""
group = aiopar.TaskGroup()
group.fork(fut.wait)  # before "waiting": forking runs code a signal would interrupt
try:
    print("waiting", flush=True)
    {wait}
except KeyboardInterrupt:
    print("interrupted", flush=True)
    fut.set_result(None)  # lets a task that waits for it finish
""",
        says="waiting",
    )
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert out.splitlines()[-1] == "interrupted"


PARALLEL_FOR = """
helper_started = threading.Event()

def chunk(begin, end):
    if threading.current_thread() is not threading.main_thread():
        helper_started.set()
        fut.wait()  # never ends: the caller must not wait for it
    else:
        while not helper_started.is_set():
            time.sleep(0.001)
        if {in_own_chunk} or end == 64:  # the caller's last chunk
            print("waiting", flush=True)
            while {in_own_chunk}:
                time.sleep(0.01)

try:
    aiopar.parallel_for(0, 64, 1, chunk)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    fut.set_result(None)
"""


@pytest.mark.parametrize(
    "in_own_chunk", [False, True], ids=["waiting for a helper", "in its own chunk"]
)
def test_parallel_for_ends_with_a_ctrl_c_while_a_helper_s_chunk_runs(in_own_chunk):
    proc = interrupt(PARALLEL_FOR.format(in_own_chunk=in_own_chunk), says="waiting")
    out, err = finish(proc)
    assert proc.returncode == 0, err
    assert out.splitlines()[-1] == "interrupted"


def test_exit_waiting_for_a_running_task_ends_with_a_ctrl_c_its_wait_missed():
    proc = interrupt(
        """
aiopar.fork(fut.wait)
""",
        says="aiopar: waiting for 1 running task",
    )
    _, err = finish(proc)
    assert proc.returncode == 130, err
    assert "interrupted again, exiting without waiting" in err


def test_exit_after_an_uncaught_ctrl_c_ends_with_a_second_one_its_wait_missed():
    proc = interrupt(
        """
aiopar.fork(fut.wait)
print("waiting", flush=True)
aiopar.fork(fut.wait).wait()
""",
        says="waiting",
    )
    assert proc.stderr is not None
    err = ""
    while "aiopar: waiting for" not in err:  # the first Ctrl-C ended the main thread's wait
        line = proc.stderr.readline()
        assert line, f"exit did not wait for the running tasks: {err}{proc.communicate()}"
        err += line
    assert "KeyboardInterrupt" in err
    proc.send_signal(signal.SIGINT)
    _, rest = finish(proc)
    assert proc.returncode == 130, err + rest


# -- a KeyboardInterrupt as any call returns ----------------------------------
#
# A Ctrl-C there may leave the interrupted call half done (the budget's
# counts): each case runs in a child of its own.

AT_EACH_CALL = """
import dis, itertools, sys, threading

import aiopar
from aiopar.backends.thread import ThreadBackend

CALLS = {"CALL", "CALL_FUNCTION_EX", "CALL_KW"}


def interrupting_after_each_call(code, action):
    # Run action once for each call a frame of code makes, raising
    # KeyboardInterrupt in that frame as the call returns (where CPython
    # raises Ctrl-C); yield after each run, until a run makes no more calls.
    instructions = list(dis.get_instructions(code))
    returns = {b.offset for a, b in itertools.pairwise(instructions) if a.opname in CALLS}
    for nth in itertools.count(1):
        seen = 0

        def in_frame(frame, event, arg, nth=nth):
            nonlocal seen
            if event == "opcode" and frame.f_lasti in returns:
                seen += 1
                if seen == nth:
                    raise KeyboardInterrupt
            return in_frame

        def tracer(frame, event, arg):
            if frame.f_code is not code:
                return None
            # Since 3.12, opcode events come through sys.monitoring, which
            # the f_trace_opcodes setter turns on only for a frame that
            # already has its local trace function: set that one first.
            frame.f_trace = in_frame
            frame.f_trace_opcodes = True
            return in_frame

        sys.settrace(tracer)
        try:
            action()
        except KeyboardInterrupt:
            pass
        else:
            assert nth > 1, "the tracer saw no call return: no opcode events reached it"
            return
        finally:
            sys.settrace(None)
        yield nth


def check_free(lock, where):
    assert lock.acquire(timeout=5), f"the lock is still held after Ctrl-C {where}"
    lock.release()
"""


def test_a_ctrl_c_as_any_call_of_fork_returns_leaves_the_pool_s_lock_free():
    done = run_python(
        AT_EACH_CALL
        + """
pool = ThreadBackend(max_workers=1)
fork = lambda: pool.fork(int)
for nth in interrupting_after_each_call(ThreadBackend.enqueue.__code__, fork):
    check_free(pool._lock, f"as fork's call {nth} returned")
print("interrupted", nth, "times")
pool.shutdown()
""",
        timeout=40,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("interrupted"), done.stdout
