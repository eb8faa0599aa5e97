"""The wire between rpc peers: pickles on plain sockets, read by one thread per process.

Only peers of one cluster talk on it: each connection starts with a mutual
HMAC-SHA256 handshake over the cluster's secret (see ``_handshake``).

dask's comms would carry calls too, but a dask comm round trip costs 0.2 to
0.3 ms on a 2-core machine (tornado streams, msgpack framing, the event
loop), more than torch's whole ``rpc_sync``, and reaching the loop from the
calling thread and back costs two thread hops more. Here the calling thread
writes its call itself, as far as the socket takes it without waiting, and
the process's :class:`~._hub.Hub` reads every connection and writes what
was left over: a no-op ``rpc_sync`` between two processes takes about
0.1 ms, and a process has the same threads for one connection or a thousand.
TLS goes through ``ssl.MemoryBIO``, so it costs the same thread hops as a
plain socket: none. dask still provides everything else: the peers and
their addresses, TLS (the ``ssl.SSLContext`` of a ``distributed.Security``),
pickling (its cloudpickle fallback), and the worker thread pool that runs
the calls.

A message is a header (kind, call id, number of frames, shared-memory
segment), each frame's length and flags, then the frames: a pickle
(protocol 5) and its out-of-band buffers, so an array is written and read
without a copy (a large frame is read straight into its own buffer).

Peers of one machine talk over a Unix socket instead (when neither uses
TLS): a message's buffers of a megabyte or more go in one shared-memory
segment, whose descriptor travels with the message (``SCM_RIGHTS``), and
the receiver maps it: its arrays are views of the segment, with no copy.
A socket moves 100 MB between two processes in 120 to 140 ms on a 2-core
machine; a copy into a segment from the sender's pool, whose pages stay
mapped from one message to the next, and a mapping at the receiver take
about 20 ms. The receiver tells the sender once it no longer maps a
segment (a ``RELEASE`` message), and the sender reuses it.
"""

from __future__ import annotations

import array
import contextlib
import copyreg
import io
import mmap
import os
import pickle
import re
import socket
import ssl
import struct
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import cloudpickle

from aiopar.backends import HAVE_MEMFD, Segment, SegmentPool, aligned, map_segment
from aiopar.rpc import RRef

from . import _handshake
from ._handshake import new_secret
from ._hub import Hub

__all__ = [
    "CALL",
    "ERROR",
    "HANDSHAKE_TIMEOUT",
    "HAVE_MEMFD",
    "VALUE",
    "Connection",
    "Hub",
    "Listener",
    "SegmentPool",
    "connect",
    "dumps",
    "loads",
    "new_secret",
]

CALL, VALUE, ERROR, RELEASE = 1, 2, 3, 4

HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to prove it is a peer
_MAX_QUEUED = 64 << 20  # bytes waiting in a connection's queue before callers wait for room
_IOV_MAX = 1024  # buffers one sendmsg takes (Linux)
_STAGING = 1 << 18  # bytes read from a socket at once
_LARGE = _STAGING // 4  # a frame at least this long is read straight into its own buffer
_MAPPED = 1 << 20  # a frame at least this long is read into mapped memory
_TLS_CHUNK = 1 << 20  # plaintext encrypted at once: a big message is not doubled in memory
_SHARED = 1 << 20  # a buffer at least this long goes in shared memory, to a peer of this machine
_MAX_FDS = 64  # descriptors received and not yet taken before a connection is dropped
_LOCAL = HAVE_MEMFD and sys.platform == "linux"  # segments and abstract Unix sockets

_HEAD = struct.Struct("!BQHQ")  # kind, call id, number of frames, segment id (0: none)
_FRAME = struct.Struct("!QB")  # length, flags
_WRITEABLE, _IN_SEGMENT = 1, 2  # a frame's flags
_IDS = struct.Struct("!Q")  # a RELEASE message's frame: the segment ids, each thus
_ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * 4) if _LOCAL else 0  # room for descriptors in a read

Frames = list[Any]  # bytes-like objects
OnMessage = Callable[["Connection", int, int, Frames], None]
Protocol = Generator[int, Any, None]  # yields how many bytes it needs, is sent them (a buffer)


def dumps(obj: Any) -> tuple[Frames, list[bool]]:
    """``obj`` as frames (a pickle and its out-of-band buffers) and their writeable flags.

    Plain pickle first, as dask's pickler does; cloudpickle (lambdas, what is
    defined in ``__main__``) only when that fails or refers to ``__main__``.
    A message that holds an RRef goes straight to cloudpickle: pickling an
    RRef makes a copy that its owner counts, so it must be pickled once.
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        stream = io.BytesIO()
        _PlainPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
        data: Any = stream.getbuffer()  # no copy
    except Exception:  # an RRef, or what plain pickle cannot do
        data = b"__main__"
    if _MAIN.search(data):  # (re searches a memoryview without copying it)
        buffers.clear()
        data = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    # raw(): the bytes of any contiguous buffer, a zero-length dimension
    # included (a cast of a view with zeros in its shape fails).
    views = [b.raw() for b in buffers]
    return [data, *views], [True, *(not v.readonly for v in views)]


def _not_in_plain_pickle(obj: object) -> Any:
    raise pickle.PicklingError(f"{type(obj).__name__} is pickled once, by cloudpickle")


class _PlainPickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, RRef: _not_in_plain_pickle}


_MAIN = re.compile(rb"__main__")


def loads(frames: Frames) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


def messages(connection: Connection, on_message: OnMessage) -> Protocol:
    """The reading protocol after the handshake: each message, whole, to
    ``on_message`` (a ``RELEASE`` message to the connection itself)."""
    while True:
        kind, call_id, count, segment = _HEAD.unpack((yield _HEAD.size))
        heads = list(_FRAME.iter_unpack((yield _FRAME.size * count) if count else b""))
        shared = [size for size, flags in heads if flags & _IN_SEGMENT]
        # (popped, so that this generator holds none of them once they are
        # passed on: the call may be run, and its arguments gone, before
        # the hub's thread comes back here)
        mapped = connection.shared_buffers(segment, shared)[::-1] if shared else []
        frames: Frames = []
        for size, flags in heads:
            if flags & _IN_SEGMENT:
                frame = mapped.pop()
            else:
                frame = memoryview((yield size) if size else bytearray())
            frames.append(frame if flags & _WRITEABLE else frame.toreadonly())
            del frame
        if kind == RELEASE:
            connection.on_released(frames[0])
        else:
            on_message(connection, kind, call_id, frames)
        # Hold nothing of it while waiting for the next message: a segment
        # goes back to its sender once the last view of it has gone.
        del frames


class _Tls:
    """A TLS session over memory buffers: the socket only ever carries its bytes."""

    def __init__(self, context: ssl.SSLContext, server_side: bool, host: str | None) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.session = context.wrap_bio(
            self.incoming, self.outgoing, server_side=server_side, server_hostname=host
        )
        self.received = bytearray(_STAGING)  # what the socket gave, before it is decrypted
        self.drained = False  # the socket's last read came back short

    def holds_nothing(self) -> bool:
        """Whether everything read from the socket has been decrypted and taken."""
        return self.drained and not self.incoming.pending and not self.session.pending()


class Connection:
    """A socket between two peers that any thread may send whole messages on.

    A send never waits for the other side to read: what the socket does not
    take at once (a non-blocking write, in the sending thread) is queued,
    and the hub writes it as the socket drains. Reading is the hub's: it
    feeds what arrives to the connection's protocol (the handshake, then
    :func:`messages`). On a Unix socket, with ``segments``, big buffers
    travel in shared memory from that pool.
    """

    def __init__(
        self, sock: socket.socket, tls: _Tls | None, segments: SegmentPool | None = None
    ) -> None:
        self._sock = sock
        self._tls = tls
        local = sock.family == socket.AF_UNIX and tls is None
        self._segments = segments if local else None
        self._lent: set[int] = set()  # ids of this process's segments the other side maps
        self._unmapped: deque[int] = deque()  # ids of the other side's segments, to release
        self._fds: deque[int] = deque()  # descriptors received, for the messages to come
        self.peer_name = ""  # the caller's name, on a listener's connection
        self._lock = threading.Lock()  # sending, closing, and the TLS session
        self._changed = threading.Condition(self._lock)  # written, or closed
        self._queue: deque[_Outgoing] = deque()
        self._queued = 0  # bytes in the queue
        self._encrypted: memoryview | None = None  # TLS bytes not written yet
        self._writing = False  # the hub waits for the socket to take more
        self._closed = False
        self._failed: OSError | None = None  # a write failed: the connection is dead
        self._hub: Hub | None = None
        self._on_close: Callable[[BaseException], object] | None = None
        # reading: the hub's thread only
        self._protocol: Protocol | None = None
        self._wanted = 0
        self._staging = bytearray(_STAGING)
        self._start = self._end = 0  # what _staging holds and the protocol has not taken
        self._large: bytearray | mmap.mmap | None = None  # a large frame, read in place
        self._got = 0

    def fileno(self) -> int:
        return self._sock.fileno()

    # -- sending, from any thread ------------------------------------------------------

    def send(
        self,
        kind: int,
        call_id: int,
        frames: Frames,
        writeable: list[bool],
        *,
        deadline: float | None = None,
        abandoned: Callable[[], bool] | None = None,
        wait: bool = True,
    ) -> None:
        """Send one message without waiting for the other side to read it.

        While ``_MAX_QUEUED`` bytes wait to be written, a sender with ``wait``
        waits for room until ``deadline`` (``time.monotonic()``; None: no
        limit) and then drops its message: its caller's timeout fails the
        call. A message not yet begun when ``abandoned()`` turns true is not
        sent. OSError if the connection is closed.
        """
        views = [memoryview(f) for f in frames]
        flags = [_WRITEABLE if w else 0 for w in writeable]
        segment = self._share(views, flags)
        head = [_HEAD.pack(kind, call_id, len(frames), 0 if segment is None else segment.id)]
        head += [_FRAME.pack(v.nbytes, f) for v, f in zip(views, flags, strict=True)]
        views[0] = memoryview(b"".join([*head, views[0]]))
        views = [v for v, f in zip(views, flags, strict=True) if not f & _IN_SEGMENT]
        message = _Outgoing(views, abandoned, segment)
        with self._lock:
            if wait:
                while self._queued >= _MAX_QUEUED and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._drop(message)
                        return
                    self._changed.wait(left)
            if self._unmapped and not self._closed and self._failed is None:
                self._send_released()
            self._enqueue(message)

    def _share(self, views: list[memoryview], flags: list[int]) -> Segment | None:
        """Copy the big buffers among ``views[1:]`` into one segment and flag
        them; the segment, or None if nothing goes in one."""
        if self._segments is None:
            return None
        placed: list[tuple[int, memoryview]] = []
        size = 0
        for i, view in enumerate(views[1:], 1):
            if view.nbytes >= _SHARED:
                placed.append((size, view.cast("B")))
                size += aligned(view.nbytes)
                flags[i] |= _IN_SEGMENT
        if not placed:
            return None
        try:
            segment = self._segments.write(placed, size)
        except OSError:  # no shared memory to be had: the socket carries them
            for i in range(1, len(flags)):
                flags[i] &= ~_IN_SEGMENT
            return None
        with self._lock:
            self._lent.add(segment.id)
        return segment

    def send_raw(self, data: bytes) -> None:
        """Send bytes that are no message (the handshake's)."""
        with self._lock:
            self._enqueue(_Outgoing([memoryview(data)], None))

    def _enqueue(self, message: _Outgoing) -> None:
        if self._closed or self._failed is not None:
            self._drop(message)
            raise ConnectionResetError(
                f"the connection is closed ({self._failed or 'by this peer'})"
            )
        self._queue.append(message)
        self._queued += message.size
        self._write_soon()
        if self._failed is not None:
            raise self._failed

    def _write_soon(self) -> None:
        """Write what the socket takes now, and have the hub write the rest
        as the socket drains. Called with the lock held."""
        if not self._writing and not self._flush() and self._hub is not None:
            self._writing = True
            self._hub.call_soon(self._hub.want_write, self, True)

    def _flush(self) -> bool:
        """Write what the socket takes without waiting; True once all is
        written (or nothing more can be: the connection failed, and the hub
        finds it closed). Called with the lock held."""
        if self._failed is not None:
            return True
        try:
            while True:
                if self._encrypted is not None:
                    sent = self._sock.send(self._encrypted)
                    self._encrypted = (
                        self._encrypted[sent:] if sent < len(self._encrypted) else None
                    )
                    continue
                if not self._queue:
                    return True
                message = self._queue[0]
                if not message.started and message.abandoned is not None and message.abandoned():
                    self._drop(message)
                elif self._tls is not None:
                    message.started = True
                    self._encrypt(message)
                elif not message.started and message.segment is not None:
                    # The descriptor goes with the message's first bytes.
                    fd = array.array("i", [message.segment.fd])
                    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fd)]
                    message.consume(self._sock.sendmsg(message.views[:_IOV_MAX], ancillary))
                    message.started = True
                else:
                    message.started = True
                    message.consume(self._sock.sendmsg(message.views[:_IOV_MAX]))
                if not message.views:
                    self._queue.popleft()
                    self._queued -= message.size
                    self._changed.notify_all()
        except BlockingIOError:
            return False
        except OSError as exc:
            self._failed = exc
            self._clear()
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # the hub reads its end, and reports it
            return True

    def _clear(self) -> None:
        """Drop every queued message (with the lock held)."""
        for message in self._queue:
            if not message.started:
                self._drop(message)
        self._queue.clear()
        self._queued = 0
        self._encrypted = None
        self._changed.notify_all()

    def _drop(self, message: _Outgoing) -> None:
        """A message that will not be sent: its segment goes back to the pool."""
        message.views.clear()
        if message.segment is not None:
            self._release(message.segment.id)
            message.segment = None

    def _release(self, segment_id: int) -> None:
        if segment_id in self._lent:
            self._lent.discard(segment_id)
            assert self._segments is not None
            self._segments.release(segment_id)

    # -- shared memory -----------------------------------------------------------------

    def shared_buffers(self, segment_id: int, lengths: list[int]) -> list[memoryview]:
        """In the hub's thread: a view of each buffer of ``lengths`` in the
        segment that came with the message being read."""
        if self._segments is None or not self._fds:
            raise ConnectionError("a message refers to shared memory that did not come with it")
        size = sum(aligned(n) for n in lengths[:-1]) + lengths[-1]
        return map_segment(
            self._fds.popleft(), size, lengths, lambda: self._on_unmapped(segment_id)
        )

    def _on_unmapped(self, segment_id: int) -> None:
        """A segment the other side sent is no longer mapped here (a finalizer:
        it runs wherever the last view went, holding whatever locks are held)."""
        self._unmapped.append(segment_id)
        if self._hub is not None:
            self._hub.call_soon_unlocked(self._send_released_now)

    def _send_released_now(self) -> None:
        with self._lock:
            if not self._closed and self._failed is None:
                self._send_released()

    def _send_released(self) -> None:
        """Queue a RELEASE of the segments unmapped so far, ahead of the next
        message (with the lock held): a reply goes after the release of the
        segment its call came in."""
        ids = []
        while self._unmapped:
            ids.append(self._unmapped.popleft())
        if ids:
            frame = memoryview(b"".join(_IDS.pack(i) for i in ids))
            head = _HEAD.pack(RELEASE, 0, 1, 0) + _FRAME.pack(frame.nbytes, 0)
            self._enqueue(_Outgoing([memoryview(head), frame], None, None))

    def on_released(self, frame: memoryview) -> None:
        """In the hub's thread: the other side no longer maps these segments."""
        with self._lock:
            for (segment_id,) in _IDS.iter_unpack(frame):
                self._release(segment_id)

    def _take_fds(self, ancillary: list[tuple[int, int, bytes]], flags: int) -> None:
        fds = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC or len(self._fds) > _MAX_FDS:
            # Not what a peer sends: a message and its one segment are read together.
            raise ConnectionError("too many descriptors came on the connection")

    def _encrypt(self, message: _Outgoing) -> None:
        assert self._tls is not None
        budget = _TLS_CHUNK
        while message.views and budget > 0:
            written = self._tls.session.write(message.views[0][:budget])
            message.consume(written)
            budget -= written
        self._take_encrypted()

    def _take_encrypted(self) -> None:
        """Queue what the TLS session has produced (records, handshake messages)."""
        assert self._tls is not None
        data = self._tls.outgoing.read()
        if data:
            if self._encrypted is not None:
                data = bytes(self._encrypted) + data
            self._encrypted = memoryview(data)

    def on_writable(self) -> None:
        """The hub: the socket takes more."""
        with self._lock:
            if self._flush() or self._closed:
                self._writing = False
                assert self._hub is not None
                self._hub.want_write(self, False)

    # -- reading, in the hub's thread ---------------------------------------------------

    def serve(
        self,
        hub: Hub,
        protocol: Protocol,
        on_close: Callable[[BaseException], object],
        deadline: float | None = None,
    ) -> None:
        """Have ``hub`` read this connection into ``protocol`` from now on;
        ``on_close(why)`` runs once if the connection breaks (not when
        :meth:`close` closes it)."""
        self._protocol = protocol
        self._wanted = next(protocol)
        self._on_close = on_close
        with self._lock:
            if self._closed:
                return
            self._sock.setblocking(False)
            self._hub = hub
            if self._queue:  # the handshake's leftovers
                self._write_soon()
        hub.add(self, deadline)

    def on_readable(self) -> None:
        """The hub: read what the socket has, and feed it to the protocol."""
        drained = False  # a read came back short: the socket has no more for now
        try:
            while self._protocol is not None:
                if self._large is not None:
                    got = self._receive_into(memoryview(self._large)[self._got :])
                    self._got += got
                    if self._got == len(self._large):
                        piece, self._large = self._large, None
                        self._wanted = self._protocol.send(piece)
                    continue
                held = self._end - self._start
                if held >= self._wanted:
                    piece = self._staging[self._start : self._start + self._wanted]
                    self._start += self._wanted
                    self._wanted = self._protocol.send(piece)
                    continue
                if self._wanted >= _LARGE:
                    self._large = _buffer(self._wanted)
                    self._large[:held] = self._staging[self._start : self._end]
                    self._got = held
                    self._start = self._end = 0
                    continue
                if drained and (self._tls is None or self._tls.holds_nothing()):
                    return  # the hub calls again when more comes
                if self._start:
                    self._staging[:held] = self._staging[self._start : self._end]
                    self._start, self._end = 0, held
                room = memoryview(self._staging)[self._end :]
                got = self._receive_into(room)
                self._end += got
                drained = got < len(room)
        except (BlockingIOError, ssl.SSLWantReadError):
            return
        except BaseException as exc:  # closed, refused, or not a message: the end of it
            self._broken(exc)

    def _receive_into(self, view: memoryview) -> int:
        """Read into ``view``: BlockingIOError if nothing has come, EOFError at the end."""
        if self._segments is not None:
            got, ancillary, flags, _ = self._sock.recvmsg_into([view], _ANCILLARY)
            if ancillary:
                self._take_fds(ancillary, flags)
        elif self._tls is None:
            got = self._sock.recv_into(view)
        else:
            with self._lock:
                got = self._decrypt_into(view)
        if not got:
            raise EOFError("the other side closed the connection")
        return got

    def _decrypt_into(self, view: memoryview) -> int:
        tls = self._tls
        assert tls is not None
        while True:
            if tls.incoming.pending or tls.session.pending():  # (else read() could only fail)
                try:
                    return tls.session.read(len(view), view)  # type: ignore[return-value]
                except ssl.SSLWantReadError:  # a part of a record; or the handshake goes on
                    self._take_encrypted()  # the handshake's answers
                    self._write_soon()
                except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                    return 0
            got = self._sock.recv_into(tls.received)
            tls.drained = got < len(tls.received)
            if not got:
                return 0
            tls.incoming.write(memoryview(tls.received)[:got])

    def on_late(self) -> None:
        """The hub: the handshake did not end in time."""
        self._broken(TimeoutError(f"no handshake within {HANDSHAKE_TIMEOUT:g} s"))

    def punctual(self) -> None:
        """The handshake is over: no deadline any more."""
        if self._hub is not None:
            self._hub.punctual(self)

    # -- closing -----------------------------------------------------------------------

    def _broken(self, why: BaseException) -> None:
        on_close = self._on_close
        if self._close() and on_close is not None:
            on_close(why)

    def close(self) -> None:
        """Close it: queued messages are dropped, and its socket is closed by
        the hub (at once if it has none). Its ``on_close`` does not run."""
        self._close()

    def _close(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._clear()
            for segment_id in list(self._lent):  # the other side maps them, or never will
                self._release(segment_id)
            hub = self._hub
        while self._fds:  # (a descriptor received after this is closed by the socket's close)
            with contextlib.suppress(OSError):
                os.close(self._fds.popleft())
        self._protocol = None
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if hub is None:
            self._sock.close()
        else:
            hub.remove(self, self._sock.close)
        return True


def _buffer(size: int) -> bytearray | mmap.mmap:
    """Room for a frame. A huge one is mapped, not allocated: ``bytearray(n)``
    writes n zeros first (100 ms for 100 MB on a busy 2-core machine), while
    mapped pages are zeroed by the kernel as the socket's data lands."""
    return mmap.mmap(-1, size) if size >= _MAPPED else bytearray(size)


class _Outgoing:
    """A message on its way: what is left to write of it, and the segment
    that holds its big buffers (its descriptor goes with the first bytes)."""

    __slots__ = ("abandoned", "segment", "size", "started", "views")

    def __init__(
        self,
        views: list[memoryview],
        abandoned: Callable[[], bool] | None,
        segment: Segment | None = None,
    ) -> None:
        # An empty frame (an array with a zero-length dimension) has nothing
        # to write, and a send that wrote 0 bytes of it would never end.
        self.views = [v.cast("B") for v in views if v.nbytes]
        self.size = sum(v.nbytes for v in self.views)
        self.abandoned = abandoned
        self.segment = segment
        self.started = False

    def consume(self, sent: int) -> None:
        views = self.views
        while views and sent >= views[0].nbytes:
            sent -= views[0].nbytes
            del views[0]
        if sent:
            views[0] = views[0][sent:]


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # calls are small: no Nagle delay


class _Dialing:
    """A caller's new connection during its handshake: blocking, with a timeout."""

    def __init__(self, sock: socket.socket, tls: _Tls | None) -> None:
        self.sock = sock
        self.tls = tls

    def send_raw(self, data: bytes) -> None:
        if self.tls is not None:
            self.tls.session.write(data)
            data = self.tls.outgoing.read()
        self.sock.sendall(data)

    def receive_exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            if self.tls is None:
                chunk = self.sock.recv(size - len(data))
            else:
                try:
                    chunk = self.tls.session.read(size - len(data))
                except ssl.SSLWantReadError:
                    self._pump()
                    continue
            if not chunk:
                raise ConnectionResetError("the other side closed the connection in the handshake")
            data += chunk
        return bytes(data)

    def tls_handshake(self) -> None:
        assert self.tls is not None
        while True:
            try:
                self.tls.session.do_handshake()
            except ssl.SSLWantReadError:
                self._pump()
            else:
                self.sock.sendall(self.tls.outgoing.read())
                return

    def _pump(self) -> None:
        assert self.tls is not None
        self.sock.sendall(self.tls.outgoing.read())
        data = self.sock.recv(_STAGING)
        if not data:
            raise ConnectionResetError("the other side closed the connection in the handshake")
        self.tls.incoming.write(data)


def connect(
    host: str,
    port: int,
    timeout: float,
    context: ssl.SSLContext | None,
    secret: bytes,
    name: str = "",
    *,
    local: str | None = None,
    segments: SegmentPool | None = None,
) -> Connection:
    """A connection to the peer listening at ``host:port`` (TLS with
    ``context``), once it has proved it holds ``secret`` and been told that
    this peer is ``name``: PermissionError if it does not, TimeoutError if
    it does not answer within ``timeout`` s. :meth:`Connection.serve` starts
    reading it.

    Without TLS, a peer that also listens on the Unix socket ``local`` is
    reached there if it runs on this machine (else nothing listens on that
    name here), and the connection's big buffers go through ``segments``.
    """
    sock = None
    if local is not None and segments is not None and context is None:
        sock = _connect_local(local, timeout)
    if sock is None:
        sock = socket.create_connection((host, port), timeout=timeout)
        _tune(sock)
    try:
        dialing = _Dialing(sock, None if context is None else _Tls(context, False, host))
        if dialing.tls is not None:
            dialing.tls_handshake()
        _handshake.prove_to_listener(dialing, secret, name)
    except BaseException:
        sock.close()
        raise
    return Connection(sock, dialing.tls, segments)


def _connect_local(name: str, timeout: float) -> socket.socket | None:
    """A connection to the abstract Unix socket ``name``, or None if nothing
    listens on it in this machine (and network namespace)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect("\0" + name)
    except (ConnectionRefusedError, FileNotFoundError):
        sock.close()
        return None
    except BaseException:
        sock.close()
        raise
    return sock


class _Accepting:
    """A listening socket, as the hub waits on it."""

    def __init__(self, sock: socket.socket, accept: Callable[[socket.socket], None]) -> None:
        self.sock = sock
        self._accept = accept

    def fileno(self) -> int:
        return self.sock.fileno()

    def on_readable(self) -> None:
        self._accept(self.sock)

    def on_writable(self) -> None:
        pass

    def on_late(self) -> None:
        pass


class Listener:
    """A listening socket on ``host``, served by ``hub``: each message that a
    connection sends is passed to ``on_message(connection, kind, call_id, frames)``
    in the hub's thread.

    Without TLS and with ``segments``, it also listens on an abstract Unix
    socket named :attr:`local`, for peers of this machine.

    Nothing a connection sends is unpickled before it has proved it holds
    ``secret``; a connection that does not within ``HANDSHAKE_TIMEOUT`` s
    (the TLS handshake included) is closed unread.
    """

    def __init__(
        self,
        hub: Hub,
        host: str,
        context: ssl.SSLContext | None,
        secret: bytes,
        on_message: OnMessage,
        segments: SegmentPool | None = None,
    ) -> None:
        sockets = [socket.create_server((host, 0))]
        self.port: int = sockets[0].getsockname()[1]
        self.local: str | None = None
        if segments is not None and context is None and _LOCAL:
            self.local = f"aiopar-rpc-{uuid.uuid4().hex}"
            sockets.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
            sockets[1].bind("\0" + self.local)
            sockets[1].listen()
        self._hub = hub
        self._context = context
        self._secret = secret
        self._on_message = on_message
        self._segments = segments
        self._lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._closed = False
        self._accepting = [_Accepting(sock, self._accept) for sock in sockets]
        for accepting in self._accepting:
            accepting.sock.setblocking(False)
            hub.add(accepting)

    def _accept(self, listening: socket.socket) -> None:
        while True:
            try:
                sock, _ = listening.accept()
            except OSError:  # BlockingIOError: none left; else closed
                return
            if sock.family != socket.AF_UNIX:
                _tune(sock)
            tls = None if self._context is None else _Tls(self._context, True, None)
            connection = Connection(sock, tls, self._segments)
            with self._lock:
                if self._closed:
                    connection.close()
                    return
                self._connections.add(connection)

            def admitted(caller: str, connection: Connection = connection) -> None:
                connection.peer_name = caller
                connection.punctual()

            protocol = self._admit(connection, admitted)
            deadline = time.monotonic() + HANDSHAKE_TIMEOUT
            connection.serve(self._hub, protocol, self._discard(connection), deadline)

    def _admit(self, connection: Connection, admitted: Callable[[str], None]) -> Protocol:
        yield from _handshake.admit(connection, self._secret, admitted)
        yield from messages(connection, self._on_message)

    def _discard(self, connection: Connection) -> Callable[[BaseException], None]:
        def discard(_: BaseException) -> None:
            with self._lock:
                self._connections.discard(connection)

        return discard

    def close(self) -> None:
        """Stop listening and close every connection (their sockets close in the hub)."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
            self._connections.clear()
        for accepting in self._accepting:
            with contextlib.suppress(OSError):
                accepting.sock.shutdown(socket.SHUT_RDWR)
            self._hub.remove(accepting, accepting.sock.close)
        for connection in connections:
            connection.close()
