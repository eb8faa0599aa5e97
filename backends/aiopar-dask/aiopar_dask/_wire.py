"""The wire between rpc peers: pickles on plain sockets, read by one thread each.

Only peers of one cluster talk on it: each connection starts with a mutual
HMAC-SHA256 handshake over the cluster's secret (see ``_is_peer``).

dask's comms would carry calls too, but a dask comm round trip costs 0.2 to
0.3 ms on a 2-core machine (tornado streams, msgpack framing, the event
loop), more than torch's whole ``rpc_sync``, and reaching the loop from the
calling thread and back costs two thread hops more. Here the calling thread
writes its call itself when the socket takes it at once (else a writer
thread of the connection does), and one thread per connection reads: a no-op
``rpc_sync`` between two processes takes about 0.1 ms. dask still provides
everything else: the peers and their addresses, TLS (the ``ssl.SSLContext``
of a ``distributed.Security``), pickling (its cloudpickle fallback), and the
worker thread pool that runs the calls.

A message is a header (kind, call id, number of frames), each frame's
length and writeable flag, then the frames: a pickle (protocol 5) and its
out-of-band buffers, so an array is written and read without a copy.
"""

from __future__ import annotations

import contextlib
import hmac
import pickle
import secrets
import socket
import ssl
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from distributed.protocol import pickle as dask_pickle

__all__ = [
    "CALL",
    "ERROR",
    "HANDSHAKE_TIMEOUT",
    "VALUE",
    "Connection",
    "Listener",
    "connect",
    "dumps",
    "loads",
    "new_secret",
]

CALL, VALUE, ERROR = 1, 2, 3

HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to prove it is a peer
_MAGIC = b"aiopar-rpc/1\n"
_NONCE = _MAC = 32  # bytes (HMAC-SHA256)
_MAX_QUEUED = 64 << 20  # bytes waiting in a connection's queue before callers wait for room
_WRITER_IDLE = 1.0  # seconds a writer thread waits for more before it exits
_IOV_MAX = 1024  # buffers one sendmsg takes (Linux)

_HEAD = struct.Struct("!BQH")  # kind, call id, number of frames
_FRAME = struct.Struct("!Q?")  # length, writeable

Frames = list[Any]  # bytes-like objects


def dumps(obj: Any) -> tuple[Frames, list[bool]]:
    """``obj`` as frames (a pickle and its out-of-band buffers) and their writeable flags.

    Plain pickle first, as dask's pickler does; its cloudpickle fallback
    (lambdas, what is defined in ``__main__``) only when that fails or
    refers to ``__main__``.
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:
        data = b"__main__"
    if b"__main__" in data:
        buffers.clear()
        data = dask_pickle.dumps(obj, buffer_callback=buffers.append)
    # raw(): the bytes of any contiguous buffer, a zero-length dimension
    # included (a cast of a view with zeros in its shape fails).
    views = [b.raw() for b in buffers]
    return [data, *views], [True, *(not v.readonly for v in views)]


def loads(frames: Frames) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


class Connection:
    """A socket that any thread may send whole messages on, and one thread reads.

    A send never waits for a slow reader on the other side: what the socket
    does not take at once (a non-blocking write, in the sending thread) is
    queued and written by the connection's writer thread, started when
    needed. A TLS socket cannot write without blocking, so its messages always
    go through the writer.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._direct = not isinstance(sock, ssl.SSLSocket)
        self._reader = sock.makefile("rb", buffering=1 << 16)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # queued, written, or closed
        self._queue: deque[_Outgoing] = deque()
        self._queued = 0  # bytes in the queue
        self._writer: threading.Thread | None = None
        self._closed = False

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
        message = _Outgoing(views, abandoned)
        with self._lock:
            if self._closed:
                raise ConnectionResetError("the connection is closed")
            if self._direct and not self._queue:
                self._send_now(message)
                if not message.views:
                    return
            elif wait:
                while self._queued >= _MAX_QUEUED and not self._closed:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return
                    self._changed.wait(left)
            self._queue.append(message)
            self._queued += message.size
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write, name="aiopar-rpc-write", daemon=True
                )
                self._writer.start()
            else:
                self._changed.notify_all()

    def _send_now(self, message: _Outgoing) -> None:
        """Write what the socket takes without blocking; the rest stays in ``message``."""
        try:
            while message.views:
                sent = self._sock.sendmsg(message.views[:_IOV_MAX], (), socket.MSG_DONTWAIT)
                message.started = True
                message.consume(sent)
        except BlockingIOError:
            pass

    def _write(self) -> None:
        """The writer thread: write the queue in order, then exit when idle."""
        while True:
            with self._lock:
                while not self._queue:
                    idle = not self._changed.wait(_WRITER_IDLE)
                    if self._closed or (idle and not self._queue):
                        self._writer = None
                        return
                message = self._queue[0]
            try:
                if message.started or message.abandoned is None or not message.abandoned():
                    message.started = True
                    for view in message.views:
                        self._sock.sendall(view)
            except OSError:
                self.close()  # the reader sees it closed and fails the link's calls
            with self._lock:
                if self._queue and self._queue[0] is message:  # else closed meanwhile
                    self._queue.popleft()
                    self._queued -= message.size
                self._changed.notify_all()

    def receive(self) -> tuple[int, int, Frames]:
        """Read one message (blocking); EOFError once the connection is closed."""
        kind, call_id, count = _HEAD.unpack(self._read(_HEAD.size))
        sizes = [_FRAME.unpack(self._read(_FRAME.size)) for _ in range(count)]
        frames: Frames = []
        for size, writeable in sizes:
            frame = memoryview(self._read(size))
            frames.append(frame if writeable else frame.toreadonly())
        return kind, call_id, frames

    def _read(self, size: int) -> bytearray:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            n = self._reader.readinto(view[got:])
            if not n:
                raise EOFError("the connection closed")
            got += n
        return buffer

    def close(self) -> None:
        """Close it: queued messages are dropped, a thread blocked in
        :meth:`receive` gets EOFError, and the writer thread ends."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            self._queued = 0
            self._changed.notify_all()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._reader.close()
        with contextlib.suppress(OSError):
            self._sock.close()


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


# -- the handshake ------------------------------------------------------------------
#
# Before anything is unpickled, each side proves it holds the cluster's
# secret: the caller sends a nonce, the listener answers with its own nonce
# and an HMAC of both, and the caller answers with an HMAC of both under
# another label. A stranger gets nothing it can replay, and a caller knows it
# reached a peer, not a process that took a dead peer's port.


def new_secret() -> bytes:
    """A cluster's secret: what peers prove they hold when they connect."""
    return secrets.token_bytes(32)


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.digest(secret, role + first + second, "sha256")


def _receive_exactly(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionResetError("the other side closed the connection in the handshake")
        got += n
    return bytes(buffer)


def _prove_to_listener(sock: socket.socket, secret: bytes) -> None:
    mine = secrets.token_bytes(_NONCE)
    sock.sendall(_MAGIC + mine)
    answer = _receive_exactly(sock, _NONCE + _MAC)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _proof(secret, b"listener", mine, theirs)):
        raise PermissionError("what listens there is not a peer of this cluster (wrong proof)")
    sock.sendall(_proof(secret, b"caller", theirs, mine))


def _is_peer(sock: socket.socket, secret: bytes) -> bool:
    hello = _receive_exactly(sock, len(_MAGIC) + _NONCE)
    if not hello.startswith(_MAGIC):
        return False
    theirs, mine = hello[len(_MAGIC) :], secrets.token_bytes(_NONCE)
    sock.sendall(mine + _proof(secret, b"listener", theirs, mine))
    proof = _receive_exactly(sock, _MAC)
    return hmac.compare_digest(proof, _proof(secret, b"caller", mine, theirs))


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # calls are small: no Nagle delay


def connect(
    host: str, port: int, timeout: float, context: ssl.SSLContext | None, secret: bytes
) -> Connection:
    """A connection to the peer listening at ``host:port`` (TLS with
    ``context``), once it has proved it holds ``secret``: PermissionError if
    it does not, TimeoutError if it does not answer within ``timeout`` s."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=host)
        _prove_to_listener(sock, secret)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Connection(sock)


class Listener:
    """A listening socket on ``host``; each connection gets a thread that
    passes its messages to ``on_message(connection, kind, call_id, frames)``.

    Nothing a connection sends is unpickled before it has proved it holds
    ``secret``; a connection that does not within ``HANDSHAKE_TIMEOUT`` s
    (the TLS handshake included) is closed unread.
    """

    def __init__(
        self,
        host: str,
        context: ssl.SSLContext | None,
        secret: bytes,
        on_message: Callable[[Connection, int, int, Frames], None],
    ) -> None:
        self._sock = socket.create_server((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self._context = context
        self._secret = secret
        self._on_message = on_message
        self._lock = threading.Lock()
        self._connections: set[Connection] = set()
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._spawn(self._accept, "aiopar-rpc-accept")

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                return  # closed
            self._spawn(self._serve, "aiopar-rpc-serve", sock)

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            _tune(sock)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_side=True)
            admitted = _is_peer(sock, self._secret)
            sock.settimeout(None)
        except OSError:  # ssl.SSLError and TimeoutError included
            admitted = False
        if not admitted:
            sock.close()
            return
        connection = Connection(sock)
        with self._lock:
            if self._closed:
                connection.close()
                return
            self._connections.add(connection)
        try:
            while True:
                kind, call_id, frames = connection.receive()
                self._on_message(connection, kind, call_id, frames)
        except (EOFError, OSError, struct.error):
            pass
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop listening, close every connection, and wait up to ``timeout`` s for the threads."""
        with self._lock:
            self._closed = True
            connections = list(self._connections)
            threads = list(self._threads)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() of Linux
        self._sock.close()
        for connection in connections:
            connection.close()
        if timeout:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join(timeout)
