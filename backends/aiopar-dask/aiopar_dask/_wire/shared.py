"""Shared memory between two peers of one machine, on the Unix socket between them.

A message's buffers of a megabyte or more go in one segment of the
sender's pool, whose descriptor travels with the message (``SCM_RIGHTS``),
and the receiver maps it: its arrays are views of the segment, with no
copy. A socket moves 100 MB between two processes in 120 to 140 ms on a
2-core machine; a copy into a segment, whose pages stay mapped from one
message to the next, and a mapping at the receiver take about 20 ms. The
receiver tells the sender once it no longer maps a segment (a ``RELEASE``
message), and the sender reuses it.
"""

from __future__ import annotations

import array
import contextlib
import os
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable

from aiopar.lowlevel import HAVE_MEMFD, Segment, SegmentPool, aligned, map_segment

from .core import ConnectionClosed
from .framing import IN_SEGMENT

__all__ = ["ANCILLARY", "LOCAL", "SharedMemory"]

LOCAL = HAVE_MEMFD and sys.platform == "linux"  # segments and abstract Unix sockets
_SHARED = 1 << 20  # a buffer at least this long goes in shared memory
_MAX_FDS = 64  # descriptors received and not yet taken before a connection is dropped
ANCILLARY = socket.CMSG_SPACE(_MAX_FDS * 4) if LOCAL else 0  # room for descriptors in a read


def _nothing() -> None:
    pass


class SharedMemory:
    """The segments of one connection: this side's that the other side maps,
    the other side's that this side no longer maps (to be released), and the
    descriptors received for the messages still to be read.

    ``on_unmapped()`` is called when a segment of the other side's is no
    longer mapped here; it runs where the last view went, holding whatever
    locks are held there (a finalizer), so it only schedules the release.
    """

    def __init__(self, pool: SegmentPool, on_unmapped: Callable[[], object]) -> None:
        self._pool = pool
        self._on_unmapped = on_unmapped
        self._lock = threading.Lock()
        self._lent: set[int] = set()  # ids of this side's segments the other side maps
        self._unmapped: deque[int] = deque()  # ids of the other side's segments, to release
        self._fds: deque[int] = deque()  # descriptors received, for the messages to come

    # -- this side's segments ------------------------------------------------------

    def share(self, views: list[memoryview], flags: list[int]) -> Segment | None:
        """Copy the big buffers among ``views[1:]`` into one segment and flag
        them; the segment (lent until :meth:`release`), or None if nothing
        goes in one."""
        placed: list[tuple[int, memoryview]] = []
        size = 0
        for i, view in enumerate(views[1:], 1):
            if view.nbytes >= _SHARED:
                placed.append((size, view.cast("B")))
                size += aligned(view.nbytes)
                flags[i] |= IN_SEGMENT
        if not placed:
            return None
        try:
            segment = self._pool.write(placed, size)
        except OSError:  # no shared memory to be had: the socket carries them
            for i in range(1, len(flags)):
                flags[i] &= ~IN_SEGMENT
            return None
        with self._lock:
            self._lent.add(segment.id)
        return segment

    def release(self, segment_ids: list[int]) -> None:
        """These segments are no longer mapped by the other side, or never
        will be: back to the pool."""
        with self._lock:
            for segment_id in segment_ids:
                if segment_id in self._lent:
                    self._lent.discard(segment_id)
                    self._pool.release(segment_id)

    # -- the other side's segments ------------------------------------------------------

    def take_fds(self, ancillary: list[tuple[int, int, bytes]], flags: int) -> None:
        """Keep the descriptors that came with a read (``recvmsg``'s ancillary data)."""
        fds = array.array("i")
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC or len(self._fds) > _MAX_FDS:
            # Not what a peer sends: a message and its one segment are read together.
            raise ConnectionClosed("too many descriptors came on the connection")

    def map(self, segment_id: int, lengths: list[int]) -> list[memoryview]:
        """A view of each buffer of ``lengths`` in the segment that came with
        the message being read."""
        if not self._fds:
            raise ConnectionClosed("a message refers to shared memory that did not come with it")
        size = sum(aligned(n) for n in lengths[:-1]) + lengths[-1]
        return map_segment(self._fds.popleft(), size, lengths, lambda: self._unmap(segment_id))

    def _unmap(self, segment_id: int) -> None:
        self._unmapped.append(segment_id)  # (a deque's append takes no lock)
        self._on_unmapped()

    def unmapped(self) -> list[int]:
        """The other side's segments no longer mapped here since last asked."""
        ids = []
        while self._unmapped:
            ids.append(self._unmapped.popleft())
        return ids

    def has_unmapped(self) -> bool:
        return bool(self._unmapped)

    def close(self) -> None:
        """The connection is closed: every lent segment goes back to the pool
        (the other side maps it, or never will), the descriptors not taken
        are closed, and ``on_unmapped`` is let go (nothing is released on a
        closed connection; and it refers back to the connection)."""
        self._on_unmapped = _nothing
        with self._lock:
            lent = list(self._lent)
        self.release(lent)
        while self._fds:  # (a descriptor received after this is closed by the socket's close)
            with contextlib.suppress(OSError):
                os.close(self._fds.popleft())
