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
# A child that hangs writes every thread's stack to stderr and exits, well
# within the test's timeout: the failure then says where it hung.
MISSED_BY_THE_MAIN_THREAD = """
    import faulthandler, signal, sys, threading, time

    faulthandler.dump_traceback_later(40, exit=True)

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
import dis, itertools, sys, threading, time

import aiopar
from aiopar.backends.thread import ThreadBackend

CALLS = {"CALL", "CALL_FUNCTION_EX", "CALL_KW"}


def interrupted(code, nth, action):
    # Run action, raising KeyboardInterrupt in a frame of code as the nth
    # call it makes returns (where CPython raises Ctrl-C); whether it did.
    instructions = list(dis.get_instructions(code))
    returns = {b.offset for a, b in itertools.pairwise(instructions) if a.opname in CALLS}
    seen = 0

    def in_frame(frame, event, arg):
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
        return True
    finally:
        sys.settrace(None)
    return False


def interrupting_after_each_call(code, action):
    # Run action once for each call a frame of code makes, interrupted as
    # that call returns; yield after each run, until a run makes no more calls.
    for nth in itertools.count(1):
        if not interrupted(code, nth, action):
            assert nth > 1, "the tracer saw no call return: no opcode events reached it"
            return
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
# On a pool whose workers are all busy, a fork queues without the lock.
gate = threading.Event()
busy = pool.fork(gate.wait, 30)
for more in interrupting_after_each_call(ThreadBackend.enqueue.__code__, fork):
    check_free(pool._lock, f"as the call {more} of a fork on a busy pool returned")
gate.set()
assert busy.wait(30) and pool.fork(int, "7").wait(30) == 7
pool.drain()
assert not pool._backlog(), "a task queued by an interrupted fork was left"
print("interrupted", nth + more, "times")
pool.shutdown()
""",
        timeout=40,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("interrupted"), done.stdout


def test_a_ctrl_c_as_any_call_of_a_process_fork_returns_keeps_the_pool_in_step():
    # A fork to an idle worker was sent on the forking thread: a Ctrl-C as
    # the job was recorded in flight, before its frame went, left the pool
    # waiting for a reply the worker never owed, and the next reply broke it.
    done = run_python(
        AT_EACH_CALL
        + """
from aiopar.backends._process_pool import Pool
from aiopar.backends._process_wire import Channel

backend = aiopar.get_backend("process", max_workers=1)
pool = backend._pool
assert backend.fork(abs, -1).wait(timeout=60) == 1  # the worker is up, and idle
fork = lambda: backend.fork(abs, -2).wait(timeout=10)  # cut short, it never waits
cuts = 0


def check(where):
    check_free(pool._lock, where)
    assert backend.fork(abs, -3).wait(timeout=10) == 3, where
    assert pool._unsure is None and len(pool._idle) == 1, where


sending = (Pool._submit_on_main_thread, Pool._send_now, Pool._send, Pool._transmit, Channel.send)
for function in (Pool.submit, Pool._worker_for_now, *sending):
    for nth in interrupting_after_each_call(function.__code__, fork):
        cuts += 1
        check(f"as call {nth} of {function.__qualname__} returned")
# A send cut short (before, and after, its frame went) is finished by the
# next fork, itself cut short at each of its calls in turn.
for first in (1, 2, 3):
    for nth in itertools.count(1):
        assert interrupted(Pool._send_now.__code__, first, fork)
        assert pool._unsure is not None
        if not interrupted(Pool._finish_send.__code__, nth, fork):
            break
        cuts += 2
        check(f"as call {first} of _send_now, then call {nth} of _finish_send returned")
    check(f"as call {first} of _send_now returned, the send finished")
# Behind a busy worker: small forks sent ahead to it, then forks queued
# behind a call too big for that, for the manager to send.
busy = backend.fork(time.sleep, 0.5)
big = [b"x" * 100_000]
for function, args in ((Pool._send_now, (abs, -2)), (Pool.submit, (len, big))):
    for nth in itertools.count(1):
        if not interrupted(function.__code__, nth, lambda: backend.fork(*args)):
            break
        cuts += 1
assert busy.wait(timeout=10) is None
check("as forks behind a busy worker returned")
print("interrupted", cuts, "times")
""",
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("interrupted"), done.stdout
