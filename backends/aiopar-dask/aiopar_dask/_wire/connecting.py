"""The caller's side of a new connection: reach the peer, shake hands, hand it over.

Peers of one machine talk over an abstract Unix socket (big buffers then go
in shared memory, and nothing is encrypted: no other user of the machine
can read it); others over TCP, with TLS if the cluster has it.
"""

from __future__ import annotations

import socket
import ssl

from aiopar.lowlevel import SegmentPool

from . import handshake
from .connection import Connection, tune
from .core import ConnectionClosed
from .tls import TlsSession

__all__ = ["connect"]


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
    it does not answer within ``timeout`` s, :class:`ConnectionClosed` if it
    closes the connection meanwhile, and the socket's OSError if it cannot
    be reached. :meth:`Connection.serve` starts reading it.

    A peer that also listens on the Unix socket ``local`` is reached there
    if it runs on this machine (else nothing listens on that name here),
    without TLS, and the connection's big buffers go through ``segments``.
    """
    sock = None
    if local is not None and segments is not None:
        sock = _connect_local(local, timeout)
    tls = None
    if sock is None:
        sock = socket.create_connection((host, port), timeout=timeout)
        tune(sock)
        if context is not None:
            tls = TlsSession(context, False, host)
    try:
        dialing = _Dialing(sock, tls)
        if dialing.tls is not None:
            dialing.tls.handshake(sock)
        handshake.prove_to_listener(dialing, secret, name)
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


class _Dialing:
    """A caller's new connection during its handshake: blocking, with a timeout."""

    def __init__(self, sock: socket.socket, tls: TlsSession | None) -> None:
        self.sock = sock
        self.tls = tls

    def send_raw(self, data: bytes) -> None:
        if self.tls is None:
            self.sock.sendall(data)
        else:
            self.tls.send(self.sock, data)

    def receive_exactly(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            left = size - len(data)
            chunk = self.sock.recv(left) if self.tls is None else self.tls.receive(self.sock, left)
            if not chunk:
                raise ConnectionClosed("the other side closed the connection in the handshake")
            data += chunk
        return bytes(data)
