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

A message is a header (kind, call id, number of frames), each frame's
length and writeable flag, then the frames: a pickle (protocol 5) and its
out-of-band buffers, so an array is written and read without a copy (a
large frame is read straight into its own buffer).
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import mmap
import pickle
import re
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from typing import Any

import cloudpickle

from aiopar.rpc import RRef

from . import _handshake
from ._handshake import new_secret
from ._hub import Hub

__all__ = [
    "CALL",
    "ERROR",
    "HANDSHAKE_TIMEOUT",
    "VALUE",
    "Connection",
    "Hub",
    "Listener",
    "connect",
    "dumps",
    "loads",
    "new_secret",
]

CALL, VALUE, ERROR = 1, 2, 3

HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to prove it is a peer
_MAX_QUEUED = 64 << 20  # bytes waiting in a connection's queue before callers wait for room
_IOV_MAX = 1024  # buffers one sendmsg takes (Linux)
_STAGING = 1 << 18  # bytes read from a socket at once
_LARGE = _STAGING // 4  # a frame at least this long is read straight into its own buffer
_MAPPED = 1 << 20  # a frame at least this long is read into mapped memory
_TLS_CHUNK = 1 << 20  # plaintext encrypted at once: a big message is not doubled in memory

_HEAD = struct.Struct("!BQH")  # kind, call id, number of frames
_FRAME = struct.Struct("!Q?")  # length, writeable

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
    """The reading protocol after the handshake: each message, whole, to ``on_message``."""
    while True:
        kind, call_id, count = _HEAD.unpack((yield _HEAD.size))
        heads = (yield _FRAME.size * count) if count else bytearray()
        frames: Frames = []
        for size, writeable in _FRAME.iter_unpack(heads):
            frame = memoryview((yield size) if size else bytearray())
            frames.append(frame if writeable else frame.toreadonly())
        on_message(connection, kind, call_id, frames)


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
    :func:`messages`).
    """

    def __init__(self, sock: socket.socket, tls: _Tls | None) -> None:
        self._sock = sock
        self._tls = tls
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
        head = [_HEAD.pack(kind, call_id, len(frames))]
        head += [
            _FRAME.pack(memoryview(f).nbytes, w) for f, w in zip(frames, writeable, strict=True)
        ]
        views = [memoryview(b"".join([*head, frames[0]])), *(memoryview(f) for f in frames[1:])]
        with self._lock:
            if wait:
                while self._queued >= _MAX_QUEUED and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    self._changed.wait(left)
            self._enqueue(_Outgoing(views, abandoned))

    def send_raw(self, data: bytes) -> None:
        """Send bytes that are no message (the handshake's)."""
        with self._lock:
            self._enqueue(_Outgoing([memoryview(data)], None))

    def _enqueue(self, message: _Outgoing) -> None:
        if self._closed or self._failed is not None:
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
                    message.views.clear()
                elif self._tls is not None:
                    message.started = True
                    self._encrypt(message)
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
            self._queue.clear()
            self._queued = 0
            self._encrypted = None
            self._changed.notify_all()
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)  # the hub reads its end, and reports it
            return True

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
        if self._tls is None:
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
                    return tls.session.read(len(view), view)
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
            self._queue.clear()
            self._queued = 0
            self._encrypted = None
            self._changed.notify_all()
            hub = self._hub
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
    """A message on its way: what is left to write of it."""

    __slots__ = ("abandoned", "size", "started", "views")

    def __init__(self, views: list[memoryview], abandoned: Callable[[], bool] | None) -> None:
        # An empty frame (an array with a zero-length dimension) has nothing
        # to write, and a send that wrote 0 bytes of it would never end.
        self.views = [v.cast("B") for v in views if v.nbytes]
        self.size = sum(v.nbytes for v in self.views)
        self.abandoned = abandoned
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
) -> Connection:
    """A connection to the peer listening at ``host:port`` (TLS with
    ``context``), once it has proved it holds ``secret`` and been told that
    this peer is ``name``: PermissionError if it does not, TimeoutError if
    it does not answer within ``timeout`` s. :meth:`Connection.serve` starts
    reading it."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        dialing = _Dialing(sock, None if context is None else _Tls(context, False, host))
        if dialing.tls is not None:
            dialing.tls_handshake()
        _handshake.prove_to_listener(dialing, secret, name)
    except BaseException:
        sock.close()
        raise
    return Connection(sock, dialing.tls)


class _Accepting:
    """The listening socket, as the hub waits on it."""

    def __init__(self, sock: socket.socket, accept: Callable[[], None]) -> None:
        self._sock = sock
        self.on_readable = accept

    def fileno(self) -> int:
        return self._sock.fileno()

    def on_writable(self) -> None:
        pass

    def on_late(self) -> None:
        pass


class Listener:
    """A listening socket on ``host``, served by ``hub``: each message that a
    connection sends is passed to ``on_message(connection, kind, call_id, frames)``
    in the hub's thread.

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
    ) -> None:
        self._sock = socket.create_server((host, 0))
        self._sock.setblocking(False)
        self.port: int = self._sock.getsockname()[1]
        self._hub = hub
        self._context = context
        self._secret = secret
        self._on_message = on_message
        self._lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._closed = False
        self._accepting = _Accepting(self._sock, self._accept)
        hub.add(self._accepting)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:  # BlockingIOError: none left; else closed
                return
            _tune(sock)
            tls = None if self._context is None else _Tls(self._context, True, None)
            connection = Connection(sock, tls)
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
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._hub.remove(self._accepting, self._sock.close)
        for connection in connections:
            connection.close()
