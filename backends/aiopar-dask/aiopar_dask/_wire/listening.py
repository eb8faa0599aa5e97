"""The callee's side: a listening socket whose connections must prove they are peers."""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable

from aiopar.lowlevel import SegmentPool

from . import handshake
from .connection import Connection, OnMessage, tune
from .framing import ReadingProtocol, messages
from .hub import Hub
from .shared import LOCAL
from .tls import TlsSession

__all__ = ["Listener"]


class Listener:
    """A listening socket on ``host``, served by ``hub``: each message that a
    connection sends is passed to ``on_message(connection, kind, call_id, frames)``
    in the hub's thread.

    With ``segments``, it also listens on an abstract Unix socket named
    :attr:`local`, for peers of this machine: big buffers go through shared
    memory there, and its bytes are not encrypted even when the TCP
    connections are, since no other user of the machine can read a Unix
    socket (its callers prove the secret all the same).

    Nothing a connection sends is unpickled before it has proved it holds
    ``secret``; a connection that does not within
    ``handshake.HANDSHAKE_TIMEOUT`` s (the TLS handshake included) is closed
    unread.
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
        if segments is not None and LOCAL:
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
            tls = None
            if sock.family != socket.AF_UNIX:
                tune(sock)
                if self._context is not None:
                    tls = TlsSession(self._context, True, None)
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
            deadline = time.monotonic() + handshake.HANDSHAKE_TIMEOUT
            connection.serve(self._hub, protocol, self._discard(connection), deadline)

    def _admit(self, connection: Connection, admitted: Callable[[str], None]) -> ReadingProtocol:
        yield from handshake.admit(connection, self._secret, admitted)
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

    def on_error(self, exc: Exception) -> None:
        pass  # (logged by the hub) this listening socket accepts no more
