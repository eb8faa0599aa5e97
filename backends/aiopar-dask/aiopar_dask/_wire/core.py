"""The wire's shared vocabulary: the kinds of message, and the error for a closed connection."""

from __future__ import annotations

from typing import Any

__all__ = ["CALL", "ERROR", "RELEASE", "VALUE", "ConnectionClosed", "Frames"]

CALL, VALUE, ERROR, RELEASE = 1, 2, 3, 4  # a message's kind

Frames = list[Any]  # a message's bytes-like objects: a pickle and its out-of-band buffers


class ConnectionClosed(ConnectionError):
    """The connection is closed, or broke: nothing more goes through it.

    Whatever ended it (this side closed it, the other side did, the socket
    failed, or what arrived was no message of this wire) is raised as this
    one type, the transport's own error as its ``__cause__``, as
    distributed's ``CommClosedError`` is. An ``OSError``, so code that
    handles socket errors handles it too.
    """
