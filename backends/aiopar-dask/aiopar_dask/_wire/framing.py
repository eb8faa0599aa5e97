"""How a message is laid out on a connection, and the protocol that reads it back.

A message is a header (kind, call id, number of frames, shared-memory
segment), each frame's length and flags, then the frames themselves;
a frame flagged as in the segment is not on the socket: the receiver maps
it from the segment whose descriptor came with the message.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Generator
from typing import Any, Protocol, TypeVar

from .core import RELEASE, Frames

__all__ = [
    "IN_SEGMENT",
    "WRITEABLE",
    "Reader",
    "ReadingProtocol",
    "laid_out",
    "messages",
    "release",
]

_HEAD = struct.Struct("!BQHQ")  # kind, call id, number of frames, segment id (0: none)
_FRAME = struct.Struct("!QB")  # length, flags
WRITEABLE, IN_SEGMENT = 1, 2  # a frame's flags
_IDS = struct.Struct("!Q")  # a RELEASE message's frame: the segment ids, each thus

# Yields how many bytes it needs next, and is sent them (a bytes-like object).
ReadingProtocol = Generator[int, Any, None]


def laid_out(
    kind: int, call_id: int, views: list[memoryview], flags: list[int], segment_id: int
) -> list[memoryview]:
    """What goes on the socket for a message of these frames: the header
    joined to the first frame (the pickle), then the frames not in a segment."""
    head = [_HEAD.pack(kind, call_id, len(views), segment_id)]
    head += [_FRAME.pack(v.nbytes, f) for v, f in zip(views, flags, strict=True)]
    first = memoryview(b"".join([*head, views[0]]))
    return [first, *(v for v, f in zip(views[1:], flags[1:], strict=True) if not f & IN_SEGMENT)]


def release(segment_ids: list[int]) -> list[memoryview]:
    """A RELEASE message: the receiver no longer maps these segments of the sender's."""
    frame = memoryview(b"".join(_IDS.pack(i) for i in segment_ids))
    return [memoryview(_HEAD.pack(RELEASE, 0, 1, 0) + _FRAME.pack(frame.nbytes, 0)), frame]


def released(frame: memoryview) -> list[int]:
    """The segment ids of a RELEASE message's frame."""
    return [segment_id for (segment_id,) in _IDS.iter_unpack(frame)]


class Reader(Protocol):
    """The connection a :func:`messages` protocol reads."""

    def shared_buffers(self, segment_id: int, lengths: list[int]) -> list[memoryview]:
        """A view of each buffer of ``lengths`` in the segment that came with the message."""

    def on_released(self, segment_ids: list[int]) -> None:
        """The other side no longer maps these segments of this side's."""


R = TypeVar("R", bound=Reader)


def messages(connection: R, on_message: Callable[[R, int, int, Frames], object]) -> ReadingProtocol:
    """The reading protocol after the handshake: each message, whole, to
    ``on_message(connection, kind, call_id, frames)`` (a ``RELEASE`` message
    to the connection itself)."""
    while True:
        kind, call_id, count, segment = _HEAD.unpack((yield _HEAD.size))
        heads = list(_FRAME.iter_unpack((yield _FRAME.size * count) if count else b""))
        shared = [size for size, flags in heads if flags & IN_SEGMENT]
        # (popped, so that this generator holds none of them once they are
        # passed on: the call may be run, and its arguments gone, before
        # the hub's thread comes back here)
        mapped = connection.shared_buffers(segment, shared)[::-1] if shared else []
        frames: Frames = []
        for size, flags in heads:
            if flags & IN_SEGMENT:
                frame = mapped.pop()
            else:
                frame = memoryview((yield size) if size else bytearray())
            frames.append(frame if flags & WRITEABLE else frame.toreadonly())
            del frame
        if kind == RELEASE:
            connection.on_released(released(frames[0]))
        else:
            on_message(connection, kind, call_id, frames)
        # Hold nothing of it while waiting for the next message: a segment
        # goes back to its sender once the last view of it has gone.
        del frames
