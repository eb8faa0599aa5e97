"""The wire between the parent and a worker process: framed messages over a
Unix socket, with large buffers passed as shared-memory file descriptors.

A frame is a fixed header, the ids of buffers and of released segments, and
a pickle (:mod:`._process_pickle` makes it); a segment's descriptor
(:mod:`._shm`) travels with its frame (``SCM_RIGHTS``). A pickle
too small for a segment is read into one buffer of its size, so a message
costs time in proportion to its size. The receiver reports the segments it
no longer maps on a later frame (``released``).
"""

from __future__ import annotations

import os
import pickle
import select
import socket
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from .._shm import aligned, map_segment
from ._process_pickle import Packed

__all__ = [
    "CHUNK",
    "ERROR",
    "PATH",
    "READY",
    "RELEASE",
    "RESULT",
    "SKIP",
    "TASK",
    "TRACE",
    "BadFrame",
    "Channel",
    "Frame",
]

# kinds of frame; a TASK frame's t0 is 1 when the parent's profiler records
# the task, and the worker then sends a TRACE frame (what the task forked
# there) right before its RESULT or ERROR. A CHUNK frame is a task of
# Backend.map (a function and the arguments of several calls), answered by
# one RESULT frame with an outcome per call; a SKIP frame right before it
# names the calls not to make (their futures were cancelled).
TASK, RESULT, ERROR, READY, RELEASE, PATH, TRACE, CHUNK, SKIP = 1, 2, 3, 4, 5, 6, 7, 8, 9

# kind, segment flags, buffer count, released-id count, message id,
# segment id, segment size, payload size, start and end times (ns)
_HEADER = struct.Struct("<BBxxIIxxxxqQQQqq")
# The header's padding, as numbers: read in one call, checked to be zero.
_PADDING = struct.Struct("<2xH8xI")
# segment flags: there is a segment; the pickle is in it, after the buffers
_HAS_SEGMENT, _PICKLE_IN_SEGMENT = 1, 2
_FLAGS = _HAS_SEGMENT | _PICKLE_IN_SEGMENT  # every flag a header may carry
_ANC_SIZE = socket.CMSG_SPACE(16 * array("i").itemsize)
# A plain int: ``&`` on the socket module's flag enum is a Python call (about
# a microsecond), made on every read of the round trip.
_MSG_CTRUNC = int(socket.MSG_CTRUNC)
_KINDS = frozenset(range(TASK, SKIP + 1))
# Bounds on what a header may announce, checked before anything is
# allocated: no frame carries more ids than this, nor a payload bigger than
# this machine's memory.
_MAX_IDS = 1 << 20
# The most a header makes the receiver allocate before the bytes arrive.
_UPFRONT = 64 << 20
try:
    _MAX_PAYLOAD = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
except (AttributeError, ValueError, OSError):
    _MAX_PAYLOAD = 1 << 40


class BadFrame(Exception):
    """The peer sent something that is not a frame of this wire, or that its
    receiver did not expect: the stream can no longer be trusted."""


class Frame:
    """One received message."""

    __slots__ = ("buffers", "kind", "msg_id", "payload", "t0", "t1")

    def __init__(
        self,
        kind: int,
        msg_id: int,
        payload: bytes | bytearray | memoryview,
        buffers: list[memoryview],
        t0: int,
        t1: int,
    ) -> None:
        self.kind = kind
        self.msg_id = msg_id
        self.payload = payload
        self.buffers = buffers
        self.t0 = t0
        self.t1 = t1

    def loads(self) -> Any:
        """Unpickle the payload on top of the received buffers, then let go
        of both (the arrays built on a segment keep it mapped)."""
        try:
            return pickle.loads(self.payload, buffers=self.buffers)
        finally:
            self.payload = b""
            self.buffers = []


class Channel:
    """Framed messages over one end of a Unix stream socket.

    ``send`` is not thread-safe: callers serialize it. ``on_released(seg_id)``
    is called for every segment the peer reports it no longer maps;
    ``on_unmapped(seg_id)`` once this process stops mapping one the peer sent.
    """

    def __init__(
        self,
        sock: socket.socket,
        on_released: Callable[[int], None],
        on_unmapped: Callable[[int], None],
    ) -> None:
        self.sock = sock
        self._on_released = on_released
        self._on_unmapped = on_unmapped
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        # A reused read buffer: a fresh big bytes object per read costs an
        # mmap and page faults.
        self._chunk = bytearray(64 * 1024)
        self._chunk_view = memoryview(self._chunk)
        #: None: a read waits as long as it takes. Seconds: a frame that
        #: stops coming for that long half way raises BadFrame (a receiver
        #: that serves others must not wait for ever on one peer).
        self.stall_timeout: float | None = None

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(
        self,
        kind: int,
        msg_id: int = 0,
        packed: Packed | None = None,
        *,
        released: Iterable[int] = (),
        t0: int = 0,
        t1: int = 0,
        owner: object = None,
    ) -> None:
        released = list(released)
        if packed is None:
            seg, payload, lengths, in_segment = None, b"", [], 0
        else:
            seg, payload, lengths = packed.segment, packed.payload, packed.lengths
            in_segment = packed.pickle_in_segment
        flags = 0
        if seg is not None:
            flags = _HAS_SEGMENT | (_PICKLE_IN_SEGMENT if in_segment else 0)
        header = _HEADER.pack(
            kind,
            flags,
            len(lengths),
            len(released),
            msg_id,
            seg.id if seg is not None else 0,
            sum(map(aligned, lengths)) + in_segment,
            in_segment or len(payload),
            t0,
            t1,
        )
        if lengths or released:
            parts = [header, array("Q", lengths + released).tobytes(), payload]
        else:
            parts = [header, payload]
        ancdata = []
        if seg is not None:
            seg.owner = owner
            ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", [seg.fd]))]
        sent = self.sock.sendmsg(parts, ancdata)
        for part in parts:
            # A partial send (a signal interrupted it): the rest, part by part
            # rather than joined into one more copy.
            if sent >= len(part):
                sent -= len(part)
            else:
                self.sock.sendall(memoryview(part)[sent:])
                sent = 0

    def has_frame(self) -> bool:
        """Whether a whole frame is already buffered (recv will not block);
        raises :class:`BadFrame` for a header that is not one."""
        return len(self._buf) >= _HEADER.size and self._frame_size() <= len(self._buf)

    def _frame_size(self) -> int:
        _, flags, nbufs, nrel, _, _, _, plen, _, _ = _header(self._buf)
        size: int = _HEADER.size + 8 * (nbufs + nrel) + (0 if flags & _PICKLE_IN_SEGMENT else plen)
        return size

    def recv(self) -> Frame | None:
        """The next frame, blocking until it is whole; None for a frame that
        only carried released segment ids. Raises EOFError when the peer is
        gone, :class:`BadFrame` when what it sent is not a frame."""
        buf = self._buf
        while len(buf) < _HEADER.size:
            self._fill()
        kind, flags, nbufs, nrel, msg_id, seg_id, seg_size, plen, t0, t1 = _header(buf)
        in_segment = plen if flags & _PICKLE_IN_SEGMENT else 0
        if in_segment:
            plen = 0  # on the socket
        start = _HEADER.size + 8 * (nbufs + nrel)
        end = start + plen
        # Small frames come through the chunk (a read may take several);
        # a big one is read straight into a buffer of its own size (up to
        # _UPFRONT, then grown as it arrives), so a frame costs time in
        # proportion to its size.
        while len(buf) < start or len(buf) < end <= len(buf) + len(self._chunk):
            self._fill()
        ids = array("Q")
        payload: bytes | bytearray | memoryview
        with memoryview(buf) as view:
            ids.frombytes(view[_HEADER.size : start])
            if len(buf) >= end:
                payload = bytes(view[start:end])
                have = plen
            else:
                big = bytearray(min(plen, _UPFRONT))
                have = len(buf) - start
                big[:have] = view[start:]
        del buf[: start + have]
        if have < plen:
            payload = self._recv_payload(big, have, plen)
        for released_id in ids[nbufs:]:
            self._on_released(released_id)
        buffers: list[memoryview] = []
        if flags & _HAS_SEGMENT:
            lengths = list(ids[:nbufs])
            if in_segment:
                lengths.append(in_segment)
            buffers = self._map(seg_id, seg_size, lengths)
            if in_segment:
                payload = buffers.pop()
        if kind == RELEASE:
            return None
        return Frame(kind, msg_id, payload, buffers, t0, t1)

    def _map(self, seg_id: int, size: int, lengths: list[int]) -> list[memoryview]:
        """The buffers of ``lengths`` in the segment that came with the frame."""
        if not self._fds:
            raise BadFrame("a frame announced a shared-memory segment that did not arrive")
        on_unmapped = self._on_unmapped
        try:
            return map_segment(self._fds.popleft(), size, lengths, lambda: on_unmapped(seg_id))
        except ValueError as exc:
            raise BadFrame(str(exc)) from None

    def _fill(self) -> None:
        """Read what is there (up to a chunk) onto the end of the buffer."""
        nbytes = self._recvmsg(self._chunk_view)
        self._buf += self._chunk_view[:nbytes]

    def _recv_payload(self, payload: bytearray, have: int, size: int) -> bytearray:
        """Read the rest of a payload of ``size`` bytes into ``payload``,
        which holds ``have`` of them. It grows, at most doubling, only as
        bytes arrive: a header that announces more than comes costs no more
        memory than what came."""
        while True:
            self._recv_into(memoryview(payload)[have:])
            have = len(payload)
            if have >= size:
                return payload
            payload += bytes(min(size - have, have))

    def _recv_into(self, view: memoryview) -> None:
        """Fill ``view`` from the socket."""
        while view:
            nbytes = self._recvmsg(view)
            view = view[nbytes:]

    def _recvmsg(self, view: memoryview) -> int:
        if self.stall_timeout is None or not self.sock.getblocking():
            nbytes, ancdata, flags, _ = self.sock.recvmsg_into([view], _ANC_SIZE)
        else:
            try:
                nbytes, ancdata, flags, _ = self.sock.recvmsg_into(
                    [view], _ANC_SIZE, socket.MSG_DONTWAIT
                )
            except BlockingIOError:
                nbytes, ancdata, flags = self._recvmsg_or_stall(view, self.stall_timeout)
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self._fds.extend(fds)
        if flags & _MSG_CTRUNC:
            raise EOFError("file descriptors were lost in transit (MSG_CTRUNC)")
        if not nbytes:
            raise EOFError("the peer closed its end of the socket")
        return nbytes

    def _recvmsg_or_stall(self, view: memoryview, timeout: float) -> tuple[int, Any, int]:
        """As recvmsg_into, for at most ``timeout`` seconds without a byte."""
        while True:
            try:
                nbytes, ancdata, flags, _ = self.sock.recvmsg_into(
                    [view], _ANC_SIZE, socket.MSG_DONTWAIT
                )
                return nbytes, ancdata, flags
            except BlockingIOError:
                if not select.select([self.sock], [], [], timeout)[0]:
                    raise BadFrame(
                        f"a frame cut short: nothing more of it came for {timeout} s"
                    ) from None

    def close(self) -> None:
        """Close the socket and every descriptor received but not yet mapped."""
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()


def _header(buf: bytearray) -> tuple[int, ...]:
    """The fields of the header at the start of ``buf``, once they are known
    to describe a frame this wire could have sent: a known kind and flags,
    zero padding, and sizes within bounds."""
    fields = _HEADER.unpack_from(buf)
    kind, flags, nbufs, nrel, _, _, _, plen, _, _ = fields
    if kind not in _KINDS or flags > _FLAGS or _PADDING.unpack_from(buf) != (0, 0):
        raise BadFrame(f"a header that is not one (its first bytes: {bytes(buf[:16]).hex()})")
    if nbufs + nrel > _MAX_IDS or plen > _MAX_PAYLOAD:
        raise BadFrame(
            f"a header announcing {plen} bytes and {nbufs + nrel} ids, more than a frame "
            f"carries (at most {_MAX_PAYLOAD} bytes and {_MAX_IDS} ids)"
        )
    return fields
