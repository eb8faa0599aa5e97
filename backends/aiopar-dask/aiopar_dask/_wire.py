"""The wire between rpc peers: pickles on plain sockets, read by one thread each.

dask's comms would carry calls too, but a dask comm round trip costs 0.2 to
0.3 ms on a 2-core machine (tornado streams, msgpack framing, the event
loop), more than torch's whole ``rpc_sync``, and reaching the loop from the
calling thread and back costs two thread hops more. Here the calling thread
writes its call itself, and one thread per connection reads: a no-op
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
import pickle
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any

from distributed.protocol import pickle as dask_pickle

__all__ = ["CALL", "ERROR", "VALUE", "Connection", "Listener", "connect", "dumps", "loads"]

CALL, VALUE, ERROR = 1, 2, 3

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
    views = [memoryview(b).cast("B") for b in buffers]
    return [data, *views], [True, *(not v.readonly for v in views)]


def loads(frames: Frames) -> Any:
    return pickle.loads(frames[0], buffers=frames[1:])


class Connection:
    """A socket that any thread may write whole messages to, and one thread reads."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._send_lock = threading.Lock()
        self._reader = sock.makefile("rb", buffering=1 << 16)

    def send(self, kind: int, call_id: int, frames: Frames, writeable: list[bool]) -> None:
        """Write one message; OSError if the connection is gone."""
        head = [_HEAD.pack(kind, call_id, len(frames))]
        head += [
            _FRAME.pack(memoryview(f).nbytes, w) for f, w in zip(frames, writeable, strict=True)
        ]
        first = b"".join([*head, frames[0]])
        with self._send_lock:
            self._sock.sendall(first)
            for frame in frames[1:]:
                self._sock.sendall(frame)

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
        """Close it; a thread blocked in :meth:`receive` gets EOFError."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._reader.close()
        with contextlib.suppress(OSError):
            self._sock.close()


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # calls are small: no Nagle delay


def connect(host: str, port: int, timeout: float, context: ssl.SSLContext | None) -> Connection:
    """A connection to the listener at ``host:port`` (TLS with ``context``)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        _tune(sock)
        if context is not None:
            sock = context.wrap_socket(sock, server_hostname=host)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return Connection(sock)


class Listener:
    """A listening socket on ``host``; each connection gets a thread that
    passes its messages to ``on_message(connection, kind, call_id, frames)``."""

    def __init__(
        self,
        host: str,
        context: ssl.SSLContext | None,
        on_message: Callable[[Connection, int, int, Frames], None],
    ) -> None:
        self._sock = socket.create_server((host, 0))
        self.port: int = self._sock.getsockname()[1]
        self._context = context
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
            _tune(sock)
            if self._context is not None:
                sock = self._context.wrap_socket(sock, server_side=True)
            connection = Connection(sock)
        except (OSError, ssl.SSLError):
            sock.close()
            return
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
