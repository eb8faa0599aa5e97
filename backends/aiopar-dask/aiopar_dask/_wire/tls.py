"""TLS over memory buffers: the socket only ever carries a session's bytes.

The session (an ``ssl.SSLContext`` of a ``distributed.Security``) encrypts
into and decrypts from ``ssl.MemoryBIO`` objects, so TLS costs the same
thread hops as a plain socket: none. A connection's own code moves the
bytes between the socket and the session, without blocking once it is
served; the caller's handshake, before that, blocks until its timeout.
"""

from __future__ import annotations

import socket
import ssl

from .core import ConnectionClosed

__all__ = ["TlsSession"]

_RECEIVED = 1 << 18  # encrypted bytes the caller's handshake reads at once
_CHUNK = 1 << 20  # plaintext encrypted at once: a big message is not doubled in memory


class TlsSession:
    """One side's TLS session over a socket it does not read or write itself."""

    def __init__(self, context: ssl.SSLContext, server_side: bool, host: str | None) -> None:
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._session = context.wrap_bio(
            self._incoming, self._outgoing, server_side=server_side, server_hostname=host
        )
        self._drained = False  # the socket's last read came back short

    # -- a served connection: the socket is non-blocking ------------------------------

    def encrypt(self, views: list[memoryview]) -> int:
        """Encrypt the start of ``views`` (at most a chunk in all) and return
        how many bytes were taken; :meth:`output` has the records."""
        taken = 0
        for view in views:
            if taken >= _CHUNK:
                break
            taken += self._session.write(view[: _CHUNK - taken])
        return taken

    def output(self) -> bytes:
        """What the session has produced for the socket (records, handshake messages)."""
        return self._outgoing.read()

    def has_output(self) -> bool:
        return bool(self._outgoing.pending)

    def decrypt_into(self, sock: socket.socket, view: memoryview, scratch: bytearray) -> int:
        """Read plaintext into ``view``, reading the socket as needed, through
        ``scratch`` (the reading thread's, so that a session holds no buffer
        of that size): how many bytes, 0 once the other side has closed.
        BlockingIOError if the socket has nothing yet; the session may then
        have :meth:`output` for it (the handshake's answers)."""
        while True:
            if self._incoming.pending or self._session.pending():  # (else read() could only fail)
                try:
                    return self._session.read(len(view), view)  # type: ignore[return-value]
                except ssl.SSLWantReadError:  # a part of a record; or the handshake goes on
                    pass
                except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
                    return 0
            got = sock.recv_into(scratch)
            self._drained = got < len(scratch)
            if not got:
                return 0
            self._incoming.write(memoryview(scratch)[:got])

    def holds_nothing(self) -> bool:
        """Whether everything read from the socket has been decrypted and taken."""
        return self._drained and not self._incoming.pending and not self._session.pending()

    # -- the caller's handshake: the socket blocks, until its timeout -------------------

    def handshake(self, sock: socket.socket) -> None:
        """The TLS handshake, over a blocking socket."""
        while True:
            try:
                self._session.do_handshake()
            except ssl.SSLWantReadError:
                self._pump(sock)
            else:
                sock.sendall(self.output())
                return

    def send(self, sock: socket.socket, data: bytes) -> None:
        """Encrypt ``data`` and write it to a blocking socket."""
        self._session.write(data)
        sock.sendall(self.output())

    def receive(self, sock: socket.socket, most: int) -> bytes:
        """At least one byte and at most ``most`` of plaintext, from a blocking socket."""
        while True:
            try:
                return self._session.read(most)
            except ssl.SSLWantReadError:
                self._pump(sock)

    def _pump(self, sock: socket.socket) -> None:
        sock.sendall(self.output())
        data = sock.recv(_RECEIVED)
        if not data:
            raise ConnectionClosed("the other side closed the connection in the TLS handshake")
        self._incoming.write(data)
