"""How an rpc connection proves that both ends are peers of one cluster.

Before anything is unpickled, each side proves it holds the cluster's
secret: the caller sends a nonce, the listener answers with its own nonce
and an HMAC-SHA256 of both, and the caller answers with an HMAC of both
under another label, then says its name. A stranger gets nothing it can
replay, and a caller knows it reached a peer, not a process that took a
dead peer's port.

The caller's side runs in the calling thread, blocking until its deadline
(:func:`prove_to_listener`); the listener's side is a step of the reading
protocol that the hub feeds without blocking (:func:`admit`).
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Callable, Generator
from typing import Protocol

__all__ = [
    "HANDSHAKE_TIMEOUT",
    "BlockingChannel",
    "Channel",
    "admit",
    "new_secret",
    "prove_to_listener",
]

HANDSHAKE_TIMEOUT = 5.0  # seconds a new connection has to prove it is a peer
MAGIC = b"aiopar-rpc/1\n"
_NONCE = _MAC = 32  # bytes (HMAC-SHA256)


class Channel(Protocol):
    """A connection's bytes, before any message: what the handshake needs."""

    def send_raw(self, data: bytes) -> None: ...


class BlockingChannel(Channel, Protocol):
    """The caller's channel: it waits for what it reads, until its timeout."""

    def receive_exactly(self, size: int) -> bytes: ...


def new_secret() -> bytes:
    """A cluster's secret: what peers prove they hold when they connect."""
    return secrets.token_bytes(32)


def _proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.digest(secret, role + first + second, "sha256")


def prove_to_listener(channel: BlockingChannel, secret: bytes, name: str) -> None:
    """The caller's side: PermissionError if the listener cannot prove it is a peer."""
    mine = secrets.token_bytes(_NONCE)
    channel.send_raw(MAGIC + mine)
    answer = channel.receive_exactly(_NONCE + _MAC)
    theirs, proof = answer[:_NONCE], answer[_NONCE:]
    if not hmac.compare_digest(proof, _proof(secret, b"listener", mine, theirs)):
        raise PermissionError("what listens there is not a peer of this cluster (wrong proof)")
    encoded = name.encode()
    channel.send_raw(_proof(secret, b"caller", theirs, mine) + len(encoded).to_bytes(2, "big"))
    channel.send_raw(encoded)


def admit(
    channel: Channel, secret: bytes, admitted: Callable[[str], None]
) -> Generator[int, bytearray, None]:
    """The listener's side, as a reading protocol: it yields how many bytes
    it needs next and is sent them. It raises PermissionError for a caller
    that is not a peer, and calls ``admitted(caller's name)`` once it is."""
    hello = bytes((yield len(MAGIC) + _NONCE))
    if not hello.startswith(MAGIC):
        raise PermissionError("the caller does not speak aiopar's rpc")
    theirs, mine = hello[len(MAGIC) :], secrets.token_bytes(_NONCE)
    channel.send_raw(mine + _proof(secret, b"listener", theirs, mine))
    answer = bytes((yield _MAC + 2))
    if not hmac.compare_digest(answer[:_MAC], _proof(secret, b"caller", mine, theirs)):
        raise PermissionError("the caller does not hold the cluster's secret")
    size = int.from_bytes(answer[_MAC:], "big")
    name = bytes((yield size)).decode(errors="replace") if size else ""
    admitted(name)
