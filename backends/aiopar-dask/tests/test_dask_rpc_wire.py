"""The rpc wire under faults: whatever a reply holds, its call settles, and
no frozen peer stops the others. Each cluster runs in a child process with a
timeout, so a call that never settles fails the test instead of stalling it.
"""

from __future__ import annotations

import socket
import time

import pytest
from aiopar_dask import _wire
from dask_helpers import run_python

pytestmark = pytest.mark.timeout(240)


def test_whatever_a_reply_holds_its_call_settles():
    script = """
        import sys
        from aiopar import rpc

        def deep(n):
            if n:
                return deep(n - 1)
            raise ValueError("at the bottom")

        def recurse():
            return recurse()

        class ExitsWhenUnpickled:
            def __reduce__(self):
                return (sys.exit, (3,))

        rpc.init_rpc("worker0", world_size=2)
        for fn, args in (deep, (400,)), (deep, (900,)), (recurse, ()):
            try:
                rpc.rpc_async("worker1", fn, args=args, timeout=30).wait()
            except Exception as exc:
                print(type(exc).__name__, str(exc).splitlines()[0])
        try:
            rpc.rpc_sync("worker1", ExitsWhenUnpickled, timeout=30)
        except TypeError as exc:
            print("TypeError", "cannot be unpickled" in str(exc), type(exc.__cause__).__name__)
        print(rpc.rpc_sync("worker1", len, args=((1, 2),), timeout=30))  # the link lives on
        rpc.shutdown()
    """
    done = run_python(script, timeout=120)
    assert done.stdout.splitlines() == [
        "ValueError at the bottom",
        "ValueError at the bottom",
        "RecursionError maximum recursion depth exceeded",
        "TypeError True SystemExit",
        "2",
    ], done.stderr


def test_a_large_send_to_a_frozen_peer_keeps_its_timeout_and_blocks_no_one():
    script = """
        import os, signal
        import numpy as np
        from aiopar import rpc

        rpc.init_rpc("worker0", world_size=2)
        pid = rpc.rpc_sync("worker1", os.getpid)
        os.kill(pid, signal.SIGSTOP)
        try:
            big = np.ones(100 << 20, dtype=np.uint8)
            calls = [
                rpc.rpc_async("worker1", len, args=(big,), timeout=2),
                rpc.rpc_async("worker1", len, args=((),), timeout=2),  # behind it, not blocked
            ]
            for call in calls:
                try:
                    call.wait()
                except TimeoutError:
                    print("timed out")
        finally:
            os.kill(pid, signal.SIGCONT)
        print(rpc.rpc_sync("worker1", len, args=((1, 2),), timeout=30))  # resumed: it answers
        rpc.shutdown()
    """
    done = run_python(script, timeout=120)
    assert done.stdout.splitlines() == ["timed out", "timed out", "2"], done.stderr


def test_a_frozen_caller_leaves_the_callee_responsive(tmp_path):
    # worker2 makes 20 calls to worker1 returning 8 MB each, then freezes
    # before the replies come; worker1's pool must still answer worker0.
    script = """
        import os, signal, sys, time
        from aiopar import rpc

        marker = sys.argv[1]

        def big_when_frozen(marker):
            while not os.path.exists(marker):
                time.sleep(0.01)
            return bytes(8 << 20)

        def flood(marker):
            for _ in range(20):
                rpc.rpc_async("worker1", big_when_frozen, args=(marker,), timeout=0)
            return os.getpid()

        rpc.init_rpc("worker0", world_size=3,
                     rpc_backend_options=rpc.RpcBackendOptions(num_worker_threads=2))
        pid = rpc.rpc_sync("worker2", flood, args=(marker,))
        os.kill(pid, signal.SIGSTOP)
        try:
            open(marker, "w").close()
            print(rpc.rpc_sync("worker1", len, args=((1, 2),), timeout=20))
        finally:
            os.kill(pid, signal.SIGCONT)
        rpc.shutdown()
    """
    done = run_python(script, str(tmp_path / "frozen"), timeout=120)
    assert done.stdout.splitlines() == ["2"], done.stderr


# -- a connection's queue, on a socket pair whose other end reads only when told --------

MB = 1 << 20


def read_messages(sock: socket.socket, count: int) -> list[object]:
    """Read ``count`` messages from ``sock`` as a peer's reader would."""
    reader = _wire.Connection(sock)
    return [_wire.loads(reader.receive()[2]) for _ in range(count)]


def test_a_send_never_waits_for_the_reader_and_an_abandoned_message_is_not_sent():
    mine, theirs = socket.socketpair()
    connection = _wire.Connection(mine)
    try:
        big = bytes(32 * MB)  # more than the socket pair buffers: the rest is queued
        connection.send(_wire.VALUE, 1, *_wire.dumps(big), wait=False)
        connection.send(_wire.VALUE, 2, *_wire.dumps("dropped"), abandoned=lambda: True)
        connection.send(_wire.VALUE, 3, *_wire.dumps("sent"), abandoned=lambda: False)
        # every send returned while nothing was read; now the other side reads
        assert [len(m) if isinstance(m, bytes) else m for m in read_messages(theirs, 2)] == [
            32 * MB,
            "sent",
        ]
    finally:
        connection.close()
        theirs.close()


def test_a_sender_waits_for_room_only_until_its_deadline():
    mine, theirs = socket.socketpair()
    connection = _wire.Connection(mine)
    try:
        for call_id in range(3):  # fills the queue (its limit is 64 MB)
            connection.send(_wire.VALUE, call_id, *_wire.dumps(bytes(32 * MB)), wait=False)
        connection.send(_wire.CALL, 9, *_wire.dumps("late"), deadline=time.monotonic() + 0.2)
        # it returned without queuing: its caller's timeout fails the call
        messages = read_messages(theirs, 3)
        assert [len(m) for m in messages] == [32 * MB] * 3
        theirs.settimeout(1)
        with pytest.raises(TimeoutError):
            theirs.recv(1)  # nothing more came
    finally:
        connection.close()
        theirs.close()


def test_ten_thousand_calls_in_flight_need_no_thread_each():
    # Threads per process stay bounded by a constant however many calls are
    # in flight: neither side starts a thread per call or per reply.
    script = """
        import threading
        from aiopar import rpc

        rpc.init_rpc("worker0", world_size=2)
        rpc.rpc_sync("worker1", len, args=((),))  # the link and its threads exist
        before = threading.active_count(), rpc.rpc_sync("worker1", threading.active_count)
        calls = [rpc.rpc_async("worker1", len, args=((i,),)) for i in range(10_000)]
        during = threading.active_count()
        assert sum(call.wait(timeout=60) for call in calls) == 10_000
        after = threading.active_count(), rpc.rpc_sync("worker1", threading.active_count)
        print(max(after[0], during) - before[0], after[1] - before[1])
        rpc.shutdown()
    """
    done = run_python(script, timeout=120)
    assert done.returncode == 0, done.stderr
    caller, callee = (int(n) for n in done.stdout.split())
    assert caller <= 4, done.stdout  # a writer thread for the queued sends, and such
    assert callee <= 20, done.stdout  # at most its pool (16 threads) and a writer
