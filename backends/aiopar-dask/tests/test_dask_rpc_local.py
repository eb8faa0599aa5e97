"""Peers of one machine: a Unix socket, and big buffers in shared memory.

Without TLS, a caller reaches a peer of its machine on the peer's abstract
Unix socket, and a message's buffers of a megabyte or more travel in one
segment of the sender's pool, which comes back to the pool once the
receiver no longer maps it. Strangers get no further there than on TCP.
"""

from __future__ import annotations

import array
import os
import queue
import socket
import ssl
import sys

import numpy as np
import pytest
from aiopar_dask import _wire
from aiopar_dask._wire import handshake
from dask_helpers import run_python, wait_until

from aiopar.lowlevel import HAVE_MEMFD, SegmentPool

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        sys.platform != "linux" or not HAVE_MEMFD, reason="memfd and abstract Unix sockets"
    ),
]

MB = 1 << 20


class Echo:
    """A listener with its own pool that keeps what it receives and sends it back."""

    def __init__(self, secret: bytes) -> None:
        self.hub = _wire.Hub(name="aiopar-rpc-io-test")
        self.segments = SegmentPool()
        self.kept: queue.Queue[object] = queue.Queue()

        def echo(connection: _wire.Connection, kind: int, call_id: int, frames: object) -> None:
            payload = _wire.loads(frames)
            self.kept.put(payload)
            connection.send(_wire.VALUE, call_id, *_wire.dumps(payload), wait=False)

        self.listener = _wire.Listener(self.hub, "127.0.0.1", None, secret, echo, self.segments)

    def close(self) -> None:
        self.listener.close()
        self.hub.close()
        self.segments.close()


class Caller:
    """A connection to an :class:`Echo`, served by a hub of its own."""

    def __init__(self, echo: Echo, secret: bytes, local: str | None) -> None:
        self.hub = _wire.Hub(name="aiopar-rpc-io-test")
        self.segments = SegmentPool()
        self.connection = _wire.connect(
            "127.0.0.1",
            echo.listener.port,
            5,
            None,
            secret,
            "a-caller",
            local=local,
            segments=self.segments,
        )
        self.replies: queue.Queue[object] = queue.Queue()
        self.connection.serve(
            self.hub,
            _wire.messages(self.connection, lambda c, k, i, frames: self.replies.put(frames)),
            self.replies.put,
        )

    def call(self, payload: object) -> object:
        self.connection.send(_wire.CALL, 0, *_wire.dumps(payload))
        return _wire.loads(self.replies.get(timeout=30))

    def close(self) -> None:
        self.connection.close()
        self.hub.close()
        self.segments.close()


@pytest.fixture
def pair():
    secret = _wire.new_secret()
    made: list[Echo | Caller] = []

    def make(local: bool | str = True) -> tuple[Echo, Caller]:
        echo = Echo(secret)
        made.append(echo)
        name = echo.listener.local if local is True else local or None
        caller = Caller(echo, secret, name)
        made.append(caller)
        return echo, caller

    yield make
    for end in reversed(made):
        end.close()


def family(connection: _wire.Connection) -> socket.AddressFamily:
    return socket.socket(fileno=os.dup(connection.fileno())).family


def test_big_buffers_travel_in_a_segment_that_comes_back_to_the_pool(pair):
    echo, caller = pair()
    assert family(caller.connection) == socket.AF_UNIX
    sent = np.arange(3 * MB // 8, dtype=np.float64)
    for _ in range(3):
        back = caller.call({"small": b"x" * 100, "big": sent})
        kept = echo.kept.get(timeout=10)
        assert np.array_equal(back["big"], sent) and back["small"] == b"x" * 100
        assert caller.segments._busy  # the echo still maps the caller's segment
        del kept
        assert wait_until(lambda: not caller.segments._busy, 10)  # released: back in the pool
    assert caller.segments._next_id == 2  # one segment, used three times
    del back
    assert wait_until(lambda: not echo.segments._busy, 10)


def test_odd_big_arrays_arrive_as_they_left(pair):
    _, caller = pair()
    base = np.arange(MB // 4, dtype=np.float64)  # 2 MB
    readonly = base.copy()
    readonly.flags.writeable = False
    arrays = [
        np.asfortranarray(base.reshape(512, -1)),
        base.astype(">f8"),
        readonly,
        np.zeros(MB // 8, dtype=[("a", "<i4"), ("b", "<f8")]),
        base[::2],  # strided: pickled as a copy
        np.zeros((0, MB)),  # empty: nothing to share
    ]
    back = caller.call(arrays)
    for left, arrived in zip(arrays, back, strict=True):
        assert arrived.dtype == left.dtype and arrived.shape == left.shape
        assert np.array_equal(arrived, left)
    assert back[0].flags.f_contiguous and not back[0].flags.c_contiguous
    assert not back[2].flags.writeable and back[0].flags.writeable


def test_a_name_that_nothing_listens_on_here_means_tcp(pair):
    # What a peer of another machine advertises: its name means nothing here.
    _, caller = pair(local="aiopar-rpc-on-another-machine")
    assert family(caller.connection) == socket.AF_INET
    assert np.array_equal(caller.call(np.ones(2 * MB)), np.ones(2 * MB))
    assert caller.segments._next_id == 1  # no segment: the bytes went over TCP


def test_tls_keeps_to_tcp():
    hub = _wire.Hub(name="aiopar-rpc-io-test")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    listener = _wire.Listener(hub, "127.0.0.1", context, b"s" * 32, print, SegmentPool())
    try:
        assert listener.local is None  # every byte encrypted, none in shared memory
    finally:
        listener.close()
        hub.close()


def test_a_receiver_keeps_its_arrays_after_the_sender_closes(pair):
    echo, caller = pair()
    sent = np.arange(2 * MB // 8, dtype=np.int64)
    caller.call(sent)
    kept = echo.kept.get(timeout=10)
    caller.close()
    assert not caller.segments._busy  # the sender takes its segments back at once
    assert np.array_equal(kept, sent)  # the receiver's mapping stays valid


def read_to_end(sock: socket.socket) -> bytes:
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:  # closed unread
        pass
    return got


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("count", [3, 200])
def test_a_stranger_on_the_unix_socket_gets_nothing_and_leaves_no_descriptor(
    pair, monkeypatch, count
):
    monkeypatch.setattr(handshake, "HANDSHAKE_TIMEOUT", 0.5)
    echo, _ = pair()
    before = open_fds()
    fds = [os.memfd_create("stranger") for _ in range(count)]
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect("\0" + echo.listener.local)
            # A call as a message would frame it, with descriptors, and no handshake.
            message = _wire.dumps(("print", "x"))[0][0]
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            sock.sendmsg([bytes(message)], ancillary)
            assert read_to_end(sock) == b""  # closed unanswered
    finally:
        for fd in fds:
            os.close(fd)
    assert echo.kept.empty()
    assert wait_until(lambda: open_fds() <= before, 10), (open_fds(), before)


def test_peers_of_one_machine_share_memory_and_release_it_before_replying():
    script = """
        import numpy as np
        from aiopar import rpc

        def in_shared_memory(a):
            start = a.__array_interface__["data"][0]
            with open("/proc/self/maps") as maps:
                for line in maps:
                    low, high = (int(x, 16) for x in line.split()[0].split("-"))
                    if low <= start < high:
                        return "memfd:aiopar" in line
            return False

        def make(n):
            return np.full(n, 7.0)

        rpc.init_rpc("worker0", world_size=2)
        segments = rpc.agent.current_agent()._segments
        a = np.arange(4_000_000 // 8, dtype=np.float64)
        for _ in range(5):
            assert rpc.rpc_sync("worker1", in_shared_memory, args=(a,))
            # the callee let go of the call's segment before it replied
            assert not segments._busy, segments._busy
        print("segments made", segments._next_id - 1)
        b = rpc.rpc_sync("worker1", make, args=(500_000,))
        print("reply shared", in_shared_memory(b), b.sum() == 3_500_000)
        print("small shared", rpc.rpc_sync("worker1", in_shared_memory, args=(np.ones(10),)))
        rpc.shutdown()
    """
    done = run_python(script, timeout=100)
    assert done.stdout.splitlines() == [
        "segments made 1",
        "reply shared True True",
        "small shared False",
    ], done.stderr
