"""The process backend's wire: frames over a socket, big pickles in one buffer
or in shared memory."""

from __future__ import annotations

import os
import socket
import threading
import tracemalloc

import numpy as np
import pytest

from aiopar._shm import SegmentPool, map_segment
from aiopar.backends import _process_pickle as pickling
from aiopar.backends import _process_wire as wire


@pytest.fixture
def channels():
    """Two ends of a wire, and the segment pool they send from."""
    left, right = socket.socketpair()
    segments = SegmentPool()
    ends = [wire.Channel(sock, segments.release, lambda seg_id: None) for sock in (left, right)]
    yield *ends, segments
    for end in ends:
        end.close()
    segments.close()


def _send_in_a_thread(channel, messages):
    """Send (kind, id, packed) messages from another thread (a big one
    blocks until the receiver reads it)."""
    thread = threading.Thread(target=lambda: [channel.send(*m) for m in messages])
    thread.start()
    return thread


def test_a_big_pickle_on_the_socket_is_read_into_one_buffer(channels, monkeypatch):
    """Received into one buffer of its size, allocated once, and unpickled
    from it: no buffer per read (where there is no shared memory)."""
    sender, receiver, segments = channels
    allocations = []
    real_bytearray = bytearray

    def counting_bytearray(*args):
        buf = real_bytearray(*args)
        if len(buf) >= 1 << 20:
            allocations.append(buf)
        return buf

    monkeypatch.setattr(wire, "bytearray", counting_bytearray, raising=False)
    monkeypatch.setattr(pickling, "LARGE_PICKLE", 1 << 40)  # every pickle on the socket
    value = os.urandom(16 << 20)
    small = pickling.Packed(b"small", [], None, None)
    big = pickling.pack(value, segments)
    assert big.segment is None
    thread = _send_in_a_thread(
        sender, [(wire.RESULT, 1, small), (wire.RESULT, 2, big), (wire.RESULT, 3, small)]
    )
    frames = [receiver.recv() for _ in range(3)]
    thread.join()
    assert [f.msg_id for f in frames] == [1, 2, 3]
    assert frames[0].payload == frames[2].payload == b"small"
    assert len(allocations) == 1 and frames[1].payload is allocations[0]
    assert frames[1].loads() == value


def test_a_big_pickle_travels_in_shared_memory(channels):
    sender, receiver, segments = channels
    array = np.arange(100_000.0)
    value = [b"x" * (4 << 20), "y" * (2 << 20), array, list(range(1000))]
    packed = pickling.pack(value, segments)
    assert packed.payload == b"" and packed.pickle_in_segment > 6 << 20
    assert packed.lengths == [array.nbytes]  # the array's buffer first, then the pickle
    thread = _send_in_a_thread(sender, [(wire.RESULT, 1, packed)])
    frame = receiver.recv()
    thread.join()
    got = frame.loads()
    assert got[:2] == value[:2] and got[3] == value[3]
    np.testing.assert_array_equal(got[2], array)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="segments need memfd_create")
def test_a_segment_shorter_than_its_message_is_refused_not_mapped():
    # Reading past a mapping's end kills the process (SIGBUS): refuse it first.
    fd = os.memfd_create("short")
    os.ftruncate(fd, 4096)
    with pytest.raises(ValueError, match="segment of 4096 bytes holds no 8192-byte message"):
        map_segment(fd, 8192, [8192], lambda: None)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed all the same


def _header(kind=wire.RESULT, nbufs=0, msg_id=1, plen=0):
    return wire._HEADER.pack(kind, 0, nbufs, 0, msg_id, 0, 0, plen, 0, 0)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (_header(kind=200), "a header that is not one"),
        (_header()[:13] + b"\1" + _header()[14:], "a header that is not one"),  # padding
        (_header(plen=2**62), "announcing 4611686018427387904 bytes"),
        (_header(nbufs=2**31), "and 2147483648 ids"),
    ],
)
def test_what_is_not_a_header_is_refused_before_anything_is_allocated(channels, data, words):
    sender, receiver, _ = channels
    sender.sock.sendall(data)
    with pytest.raises(wire.BadFrame, match=words):
        receiver.recv()


def test_a_header_announcing_more_than_comes_costs_no_more_memory_than_what_came(channels):
    sender, receiver, _ = channels
    sender.sock.sendall(_header(plen=512 << 20) + b"x" * 1000)
    sender.sock.close()
    tracemalloc.start()
    try:
        with pytest.raises(EOFError):
            receiver.recv()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 100 << 20


def test_a_payload_bigger_than_what_is_allocated_up_front_arrives_whole(channels, monkeypatch):
    sender, receiver, segments = channels
    monkeypatch.setattr(wire, "_UPFRONT", 1 << 20)
    monkeypatch.setattr(pickling, "LARGE_PICKLE", 1 << 40)  # every pickle on the socket
    value = os.urandom(5 << 20)
    thread = _send_in_a_thread(sender, [(wire.RESULT, 1, pickling.pack(value, segments))])
    frame = receiver.recv()
    thread.join()
    assert frame.loads() == value
