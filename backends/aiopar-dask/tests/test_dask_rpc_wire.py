"""The rpc wire under faults: whatever a reply holds, its call settles, and
no frozen peer stops the others. Each cluster runs in a child process with a
timeout, so a call that never settles fails the test instead of stalling it.
"""

from __future__ import annotations

import queue
import socket
import time

import pytest
from aiopar_dask import _wire
from dask_helpers import Served, loopback_cluster, run_python, start_python

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


def test_data_never_raises_system_exit_or_keyboard_interrupt_in_another_process():
    # What unpickling raises is the data's: a SystemExit there once ended the
    # caller silently (an argument that raised it on the callee came back as
    # itself). A result that raises SystemExit: see the test above.
    script = """
        import sys
        from aiopar import rpc

        def interrupt():
            raise KeyboardInterrupt("raised by the data")

        class Raises:
            def __init__(self, how):
                self.how = how

            def __reduce__(self):
                return (sys.exit, (8,)) if self.how == "exit" else (interrupt, ())

        def unpickling_raised(name, fn, *args):
            try:
                rpc.rpc_sync("worker1", fn, args=args, timeout=30)
            except TypeError as exc:
                said = f"{exc} {type(exc.__cause__).__name__}"
                return "cannot be unpickled" in said and name in said

        rpc.init_rpc("worker0", world_size=2)
        # an argument, unpickled on the callee; then a result, unpickled here
        print(unpickling_raised("SystemExit", len, Raises("exit")))
        print(unpickling_raised("KeyboardInterrupt", len, Raises("interrupt")))
        print(unpickling_raised("KeyboardInterrupt", Raises, "interrupt"))
        print(rpc.rpc_sync("worker1", len, args=((1, 2),), timeout=30))  # both peers live on
        rpc.shutdown()
    """
    done = run_python(script, timeout=120)
    assert done.stdout.splitlines() == ["True", "True", "True", "2"], done.stderr


def test_a_reply_slow_to_unpickle_delays_its_own_call_only(tmp_path):
    # Replies were unpickled by the one thread that reads every connection:
    # while one took 4 s, an instant call with timeout=2 timed out, and one
    # whose unpickling made a call of its own froze the process's rpc for good.
    script = """
        import fractions, os, sys, time
        from aiopar import rpc

        marker = sys.argv[1]

        def slowly(value):
            open(marker, "w").close()  # it is being read now
            time.sleep(4)
            return value

        class SlowToRead:
            def __reduce__(self):
                return (slowly, ("slow",))

        def call_back():
            return rpc.rpc_sync("worker1", len, args=((1, 2, 3),), timeout=0)

        class CallsWhenRead:
            def __reduce__(self):
                return (call_back, ())

        rpc.init_rpc("worker0", world_size=2)
        slow = rpc.rpc_async("worker1", SlowToRead, timeout=30)
        while not os.path.exists(marker):  # until its reply is being unpickled here
            time.sleep(0.01)
        print(rpc.rpc_sync("worker1", len, args=((1, 2),), timeout=2))  # plain data
        print(rpc.rpc_sync("worker1", fractions.Fraction, args=(1, 3), timeout=2))  # a class
        print(rpc.rpc_sync("worker1", CallsWhenRead, timeout=0))  # a call while it is read
        print(slow.wait())
        rpc.shutdown()
    """
    done = run_python(script, str(tmp_path / "reading"), timeout=120)
    assert done.stdout.splitlines() == ["2", "1/3", "3", "slow"], done.stderr


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
    """Read ``count`` messages from ``sock`` as a peer does; return their payloads."""
    reader = Served(sock)
    try:
        return [payload for _, _, payload in reader.take(count)]
    finally:
        reader.close()


def test_a_send_never_waits_for_the_reader_and_an_abandoned_message_is_not_sent():
    mine, theirs = socket.socketpair()
    sender = Served(mine)
    try:
        big = bytes(32 * MB)  # more than the socket pair buffers: the rest is queued
        sender.connection.send(_wire.VALUE, 1, *_wire.dumps(big), wait=False)
        sender.connection.send(_wire.VALUE, 2, *_wire.dumps("dropped"), abandoned=lambda: True)
        sender.connection.send(_wire.VALUE, 3, *_wire.dumps("sent"), abandoned=lambda: False)
        # every send returned while nothing was read; now the other side reads
        assert [len(m) if isinstance(m, bytes) else m for m in read_messages(theirs, 2)] == [
            32 * MB,
            "sent",
        ]
    finally:
        sender.close()


def test_a_sender_waits_for_room_only_until_its_deadline():
    mine, theirs = socket.socketpair()
    sender = Served(mine)
    try:
        for call_id in range(3):  # fills the queue (its limit is 64 MB)
            sender.connection.send(_wire.VALUE, call_id, *_wire.dumps(bytes(32 * MB)), wait=False)
        sender.connection.send(_wire.CALL, 9, *_wire.dumps("late"), deadline=time.monotonic() + 0.2)
        # it returned without queuing: its caller's timeout fails the call
        reader = Served(theirs)
        try:
            assert [len(m[2]) for m in reader.take(3)] == [32 * MB] * 3
            with pytest.raises(queue.Empty):
                reader.received.get(timeout=1)  # nothing more came
        finally:
            reader.close()
    finally:
        sender.close()


def test_odd_frames_cross_in_one_read_and_in_pieces():
    # Small messages share the hub's reads; a large frame is read into its own buffer.
    mine, theirs = socket.socketpair()
    sender, reader = Served(mine), Served(theirs)
    try:
        payloads = ["", b"", bytes(70_000), "x" * 10, bytes(3 * MB), None]
        for call_id, payload in enumerate(payloads):
            sender.connection.send(_wire.VALUE, call_id, *_wire.dumps(payload))
        assert reader.take(len(payloads)) == [(_wire.VALUE, i, p) for i, p in enumerate(payloads)]
        sender.close()
        assert isinstance(reader.received.get(timeout=10), _wire.ConnectionClosed)  # its end closed
    finally:
        sender.close()
        reader.close()


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
    assert caller <= 2, done.stdout  # the timeouts' thread, and such
    assert callee <= 16, done.stdout  # at most its pool (16 threads)


PEERS = 32


@pytest.mark.timeout(420)
def test_32_peers_all_talking_to_all_keep_their_threads_bounded():
    # One thread (the hub) reads all of a process's connections: a peer that
    # talks to 31 others has the threads of a peer that talks to none, but
    # for its pool of calls (2 threads here) and the calls' timeouts (1).
    script = """
        import sys, threading
        from aiopar import rpc

        rank, address, size = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
        # 32 interpreters start on 2 cores: give the rendezvous time on a busy machine
        options = rpc.RpcBackendOptions(
            init_method=address, num_worker_threads=2, rpc_timeout=180
        )
        rpc.init_rpc(f"peer{rank}", rank=rank, world_size=size, rpc_backend_options=options)
        alone = threading.active_count()
        others = [f"peer{r}" for r in range(size) if r != rank]
        calls = [rpc.rpc_async(name, threading.active_count) for name in others]
        theirs = max(call.wait(timeout=60) for call in calls)
        print(alone, threading.active_count(), theirs, flush=True)
        rpc.shutdown()  # waits until every peer has called it: all connections stay up
    """
    with loopback_cluster(n_workers=0) as cluster:
        address = cluster.scheduler_address
        procs = [start_python(script, str(rank), address, str(PEERS)) for rank in range(PEERS)]
        try:
            deadline = time.monotonic() + 360
            outputs = [proc.communicate(timeout=deadline - time.monotonic()) for proc in procs]
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    assert [proc.returncode for proc in procs] == [0] * PEERS, [e for _, e in outputs][:3]
    counts = [[int(n) for n in out.split()] for out, _ in outputs]
    alone = max(c[0] for c in counts)
    connected = max(max(c[1], c[2]) for c in counts)
    assert connected - alone <= 3, counts
