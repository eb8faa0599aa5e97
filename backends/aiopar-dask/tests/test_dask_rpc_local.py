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
import sys
import threading

import distributed
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


def replies_to(replies: queue.Queue[object]) -> _wire.OnMessage:
    return lambda connection, kind, call_id, frames: replies.put(frames)


def test_tls_encrypts_tcp_and_peers_of_one_machine_keep_their_unix_socket():
    # No other user of the machine can read a Unix socket: TLS is for what
    # crosses the network, and a peer of this machine keeps shared memory.
    pytest.importorskip("cryptography")  # Security.temporary() makes its certificates with it
    security = distributed.Security.temporary()
    secret = _wire.new_secret()
    hub = _wire.Hub(name="aiopar-rpc-io-test")

    def echo(connection: _wire.Connection, kind: int, call_id: int, frames: object) -> None:
        connection.send(_wire.VALUE, call_id, *_wire.dumps(_wire.loads(frames)), wait=False)

    context = security.get_listen_args("worker")["ssl_context"]
    listener = _wire.Listener(hub, "127.0.0.1", context, secret, echo, SegmentPool())
    segments = SegmentPool()
    try:
        assert listener.local is not None
        for local, expected in ((listener.local, socket.AF_UNIX), (None, socket.AF_INET)):
            connection = _wire.connect(
                "127.0.0.1",
                listener.port,
                5,
                security.get_connection_args("worker")["ssl_context"],
                secret,
                local=local,
                segments=segments,
            )
            replies: queue.Queue[object] = queue.Queue()
            connection.serve(hub, _wire.messages(connection, replies_to(replies)), replies.put)
            try:
                assert family(connection) == expected
                connection.send(_wire.CALL, 1, *_wire.dumps(np.ones(2 * MB)))
                assert np.array_equal(_wire.loads(replies.get(timeout=30)), np.ones(2 * MB))
            finally:
                connection.close()
    finally:
        listener.close()
        hub.close()
        segments.close()


def test_a_receiver_keeps_its_arrays_after_the_sender_closes(pair):
    echo, caller = pair()
    sent = np.arange(2 * MB // 8, dtype=np.int64)
    caller.call(sent)
    kept = echo.kept.get(timeout=10)
    caller.close()
    assert not caller.segments._busy  # the sender takes its segments back at once
    assert np.array_equal(kept, sent)  # the receiver's mapping stays valid


def test_a_release_that_cannot_be_written_breaks_its_own_connection_only(monkeypatch):
    # The receiver maps a segment of the sender's; the sender's end stops
    # reading; the receiver drops the array, and its RELEASE meets a broken
    # pipe in the hub's thread. That error once escaped the thread (and
    # stopped it): now it closes that connection, whose calls then settle.
    escaped: list[object] = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    hub = _wire.Hub(name="aiopar-rpc-io-test")
    pools = SegmentPool(), SegmentPool()
    ours, theirs = socket.socketpair()
    sender = _wire.Connection(ours, None, pools[0])
    receiver = _wire.Connection(theirs, None, pools[1])
    arrived: queue.Queue[object] = queue.Queue()
    broke: queue.Queue[BaseException] = queue.Queue()
    receiver.serve(hub, _wire.messages(receiver, lambda c, k, i, f: arrived.put(f)), broke.put)
    try:
        sender.send(_wire.VALUE, 1, *_wire.dumps(np.ones(2 * MB, dtype=np.uint8)))
        array = _wire.loads(arrived.get(timeout=10))
        assert int(array.sum()) == 2 * MB
        ours.shutdown(socket.SHUT_RD)  # a write to it now fails: EPIPE
        del array  # unmapped: the hub writes the RELEASE
        assert isinstance(broke.get(timeout=10), _wire.ConnectionClosed)
        # The hub still reads the other connections.
        left, right = socket.socketpair()
        other = _wire.Connection(right, None)
        got: queue.Queue[object] = queue.Queue()
        other.serve(hub, _wire.messages(other, lambda c, k, i, f: got.put(_wire.loads(f))), got.put)
        _wire.Connection(left, None).send(_wire.CALL, 2, *_wire.dumps("still read"))
        assert got.get(timeout=10) == "still read"
        other.close()
    finally:
        sender.close()
        receiver.close()
        hub.close()
        for pool in pools:
            pool.close()
    assert escaped == []


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
