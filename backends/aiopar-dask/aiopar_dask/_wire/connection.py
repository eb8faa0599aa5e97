"""A connection between two peers: whole messages sent from any thread, read by the hub.

A send never waits for the other side to read: what the socket does not
take at once (a non-blocking write, in the sending thread) is queued, and
the hub writes it as the socket drains. Reading is the hub's: it feeds
what arrives to the connection's reading protocol (the handshake, then
:func:`~.framing.messages`). A large frame is read straight into its own
buffer; the rest is read through the reading thread's buffer, so a
connection holds no read buffer of its own, only the bytes its protocol
has not taken yet. However the connection ends, what its users see is one
error, :class:`~.core.ConnectionClosed`.

What a connection that has not proved itself (a listener's, in its
handshake) makes this process hold is bounded: its objects, its TLS
session, and fewer bytes than the handshake's next step asks for; and
closing a connection breaks every reference cycle through it, so it is
freed as it closes, without waiting for the garbage collector.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from aiopar.lowlevel import Segment, SegmentPool

from .core import ConnectionClosed, Frames
from .framing import WRITEABLE, ReadingProtocol, laid_out, release
from .hub import Hub
from .shared import ANCILLARY, SharedMemory
from .tls import TlsSession

__all__ = ["Connection", "OnMessage", "tune"]

_MAX_QUEUED = 64 << 20  # bytes waiting in a connection's queue before callers wait for room
_IOV_MAX = 1024  # buffers one sendmsg takes (Linux)
_STAGING = 1 << 18  # bytes read from a socket at once, into the reading thread's buffer
_LARGE = _STAGING // 4  # a frame at least this long is read straight into its own buffer
_MAPPED = 1 << 20  # a frame at least this long is read into mapped memory

OnMessage = Callable[["Connection", int, int, Frames], object]


class _Staging(threading.local):
    """The reading thread's buffers (a hub's): each socket it serves is read
    into ``plain`` (a TLS session's bytes through ``encrypted``) and the
    protocol takes what it asked for from there. One thread reads at a time
    and never from inside a protocol, so one pair serves every connection.
    """

    def __init__(self) -> None:
        self.plain = bytearray(_STAGING)
        self.encrypted = bytearray(_STAGING)


_staging = _Staging()


def tune(sock: socket.socket) -> None:
    """Set up a TCP socket for calls, before anything is written on it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # calls are small: no Nagle delay


class Connection:
    """A socket between two peers that any thread may send whole messages on.

    With TLS, ``tls`` is the session the socket carries. On a Unix socket
    without TLS, with ``segments``, big buffers travel in shared memory from
    that pool (see ``shared``).
    """

    def __init__(
        self, sock: socket.socket, tls: TlsSession | None, segments: SegmentPool | None = None
    ) -> None:
        self._sock = sock
        self._tls = tls
        self._shared: SharedMemory | None = None
        if segments is not None and tls is None and sock.family == socket.AF_UNIX:
            self._shared = SharedMemory(segments, self._on_unmapped)
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
        self._protocol: ReadingProtocol | None = None
        self._wanted = 0
        self._held = bytearray()  # read, not taken by the protocol: fewer bytes than _wanted
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
        sent. Raises :class:`ConnectionClosed` if the connection is closed.
        """
        views = [memoryview(f) for f in frames]
        flags = [WRITEABLE if w else 0 for w in writeable]
        segment = None if self._shared is None else self._shared.share(views, flags)
        segment_id = 0 if segment is None else segment.id
        message = _Outgoing(laid_out(kind, call_id, views, flags, segment_id), abandoned, segment)
        with self._lock:
            if wait:
                while self._queued >= _MAX_QUEUED and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self._drop(message)
                        return
                    self._changed.wait(left)
            if (
                self._shared is not None
                and self._shared.has_unmapped()
                and not self._closed
                and self._failed is None
            ):
                self._send_released()
            self._enqueue(message)

    def send_raw(self, data: bytes) -> None:
        """Send bytes that are no message (the handshake's)."""
        with self._lock:
            self._enqueue(_Outgoing([memoryview(data)], None))

    def _enqueue(self, message: _Outgoing) -> None:
        if self._closed or self._failed is not None:
            self._drop(message)
            raise self._closed_error()
        self._queue.append(message)
        self._queued += message.size
        self._write_soon()
        if self._failed is not None:
            raise self._closed_error()

    def _closed_error(self) -> ConnectionClosed:
        failed = self._failed
        if failed is None:
            return ConnectionClosed("the connection is closed (by this peer)")
        error = ConnectionClosed(
            f"writing to the connection failed ({type(failed).__name__}: {failed})"
        )
        error.__cause__ = failed
        return error

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
                    message.consume(self._tls.encrypt(message.views))
                    self._take_encrypted()
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

    def _take_encrypted(self) -> None:
        """Queue what the TLS session has produced (records, handshake messages)."""
        assert self._tls is not None
        data = self._tls.output()
        if data:
            if self._encrypted is not None:
                data = bytes(self._encrypted) + data
            self._encrypted = memoryview(data)

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
            assert self._shared is not None
            self._shared.release([message.segment.id])
            message.segment = None

    def on_writable(self) -> None:
        """The hub: the socket takes more."""
        with self._lock:
            if self._flush() or self._closed:
                self._writing = False
                assert self._hub is not None
                self._hub.want_write(self, False)

    # -- shared memory -----------------------------------------------------------------

    def shared_buffers(self, segment_id: int, lengths: list[int]) -> list[memoryview]:
        """In the hub's thread: a view of each buffer of ``lengths`` in the
        segment that came with the message being read."""
        if self._shared is None:
            raise ConnectionClosed("a message refers to shared memory on a connection without it")
        return self._shared.map(segment_id, lengths)

    def on_released(self, segment_ids: list[int]) -> None:
        """In the hub's thread: the other side no longer maps these segments."""
        assert self._shared is not None
        self._shared.release(segment_ids)

    def _on_unmapped(self) -> None:
        """A segment the other side sent is no longer mapped here (a finalizer:
        it runs wherever the last view went, holding whatever locks are held)."""
        if self._hub is not None:
            self._hub.call_soon_unlocked(self._send_released_now)

    def _send_released_now(self) -> None:
        """In the hub's thread: send the releases due. A write that fails
        here shuts the socket down, and the hub then reads its end and
        reports the connection broken (``on_close``), as for any write."""
        with self._lock:
            if not self._closed and self._failed is None:
                with contextlib.suppress(ConnectionClosed):
                    self._send_released()

    def _send_released(self) -> None:
        """Queue a RELEASE of the segments unmapped so far, ahead of the next
        message (with the lock held): a reply goes after the release of the
        segment its call came in."""
        assert self._shared is not None
        ids = self._shared.unmapped()
        if ids:
            self._enqueue(_Outgoing(release(ids), None))

    # -- reading, in the hub's thread ---------------------------------------------------

    def serve(
        self,
        hub: Hub,
        protocol: ReadingProtocol,
        on_close: Callable[[BaseException], object],
        deadline: float | None = None,
    ) -> None:
        """Have ``hub`` read this connection into ``protocol`` from now on;
        ``on_close(why)`` runs once if the connection breaks (not when
        :meth:`close` closes it), ``why`` a :class:`ConnectionClosed` unless
        the protocol refused what came (``PermissionError``, say) or
        ``deadline`` (``time.monotonic()``) passed first (``TimeoutError``)."""
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
        """The hub: read what the socket has, and feed it to the protocol.
        What the protocol has not taken when the socket runs dry is kept:
        fewer bytes than it asked for."""
        staging = _staging.plain
        start, end = 0, len(self._held)  # what staging holds and the protocol has not taken
        staging[:end] = self._held
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
                held = end - start
                if held >= self._wanted:
                    piece = staging[start : start + self._wanted]
                    start += self._wanted
                    self._wanted = self._protocol.send(piece)
                    continue
                if self._wanted >= _LARGE:
                    self._large = _buffer(self._wanted)
                    self._large[:held] = staging[start:end]
                    self._got = held
                    start = end = 0
                    continue
                if drained and (self._tls is None or self._tls.holds_nothing()):
                    return  # the hub calls again when more comes
                if start:
                    staging[:held] = staging[start:end]
                    start, end = 0, held
                room = memoryview(staging)[end:]
                got = self._receive_into(room)
                end += got
                drained = got < len(room)
        except BlockingIOError:
            return
        except (ConnectionClosed, PermissionError) as exc:  # the end of it, or a stranger
            self._broken(exc)
        except OSError as exc:  # the socket failed (TLS's errors are OSErrors too)
            self._broken(_broke(exc))
        except BaseException as exc:  # what came is no message of this wire
            self._broken(exc)
        finally:
            self._held = staging[start:end]

    def _receive_into(self, view: memoryview) -> int:
        """Read into ``view``: BlockingIOError if nothing has come,
        :class:`ConnectionClosed` at the end."""
        if self._shared is not None:
            got, ancillary, flags, _ = self._sock.recvmsg_into([view], ANCILLARY)
            if ancillary:
                self._shared.take_fds(ancillary, flags)
        elif self._tls is None:
            got = self._sock.recv_into(view)
        else:
            with self._lock:
                try:
                    got = self._tls.decrypt_into(self._sock, view, _staging.encrypted)
                finally:
                    if self._tls.has_output():  # the handshake's answers
                        self._take_encrypted()
                        self._write_soon()
        if not got:
            raise ConnectionClosed("the other side closed the connection")
        return got

    def on_late(self) -> None:
        """The hub: the handshake did not end by the deadline given to :meth:`serve`."""
        self._broken(TimeoutError("the handshake did not end in time"))

    def on_error(self, exc: Exception) -> None:
        """The hub: a handler raised what none of them should: the connection is done."""
        self._broken(exc)

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
            hub = self._hub
        if self._shared is not None:
            self._shared.close()
        # What the connection's owners gave it refers back to it (a closure,
        # a protocol reading it): let go of them, so that it is freed now.
        self._protocol = None
        self._on_close = None
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        if hub is None:
            self._sock.close()
        else:
            hub.remove(self, self._sock.close)
        return True


def _broke(exc: OSError) -> ConnectionClosed:
    """The error for a socket that failed with ``exc``. (Made here, not in
    the handler's frame, which ``exc``'s traceback holds: a local there
    would hold ``exc`` in turn, a cycle only the collector breaks.)"""
    closed = ConnectionClosed(f"the connection broke ({type(exc).__name__}: {exc})")
    closed.__cause__ = exc
    return closed


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
