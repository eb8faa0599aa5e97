"""Shared memory for wires between processes of one machine (the process
backend's, the rpc plugin's): anonymous segments a process writes big
buffers into, recycled once the receiver lets go, and the receiver's
mapping of them.

A segment has no name, so nothing can be left behind in ``/dev/shm``: the
kernel frees it once the last descriptor and mapping are gone, even if
either process is killed. The sender keeps its descriptor so it can reuse
the segment's memory (already paged in) for a later message; the receiver
tells it when its mapping is gone. Without ``os.memfd_create`` (not Linux)
there are no segments: every buffer stays in the pickle.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["HAVE_MEMFD", "Filler", "Segment", "SegmentPool", "aligned", "map_segment"]

#: free segment memory each process keeps for reuse before it gives memory back
SEGMENT_CACHE_BYTES = 256 * 1024 * 1024

HAVE_MEMFD = hasattr(os, "memfd_create")
_ALIGN = 64  # buffers start on cache-line boundaries inside a segment
_ZERO_COPY_MAP = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)

#: writes an array into the segment memory it is given
Filler = Callable[[memoryview], None]


def aligned(n: int) -> int:
    """``n`` rounded up to where the next buffer starts in a segment."""
    return (n + _ALIGN - 1) & ~(_ALIGN - 1)


class Segment:
    """A shared-memory segment owned by the process that writes into it."""

    __slots__ = ("fd", "id", "mapping", "owner", "size")

    def __init__(self, id: int, fd: int, size: int) -> None:
        self.id = id
        self.fd = fd
        self.size = size
        self.mapping: mmap.mmap | None = None  # this process's own view, once reused
        self.owner: object = None  # the peer it was last sent to

    def close(self) -> None:
        if self.mapping is not None:
            self.mapping.close()
        os.close(self.fd)


class SegmentPool:
    """The segments one process writes, recycled once their receiver lets go."""

    def __init__(self, cache_bytes: int = SEGMENT_CACHE_BYTES) -> None:
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._busy: dict[int, Segment] = {}
        self._cache_bytes = cache_bytes
        self._next_id = 1

    def write(self, placed: Sequence[tuple[int, memoryview | Filler]], size: int) -> Segment:
        """A segment of ``size`` bytes or more holding each view at its offset
        (or, for a filler, whatever it writes into the memory from there)."""
        with self._lock:
            seg = self._take(size)
            self._busy[seg.id] = seg
        try:
            if seg.size < size:
                if seg.mapping is not None:
                    seg.mapping.close()
                    seg.mapping = None
                os.ftruncate(seg.fd, size)
                seg.size = size
                views = [(offset, part) for offset, part in placed if type(part) is memoryview]
                if len(views) == len(placed):
                    for offset, view in views:
                        # New pages: pwrite fills them without faulting each one in here.
                        written = os.pwrite(seg.fd, view, offset)
                        while written < view.nbytes:
                            written += os.pwrite(seg.fd, view[written:], offset + written)
                    return seg
            # A reused segment's pages exist, so a mapping kept from one use
            # to the next makes the copy a plain memcpy.
            if seg.mapping is None:
                seg.mapping = mmap.mmap(seg.fd, seg.size, flags=_ZERO_COPY_MAP)
            with memoryview(seg.mapping) as whole:
                for offset, part in placed:
                    if type(part) is memoryview:
                        whole[offset : offset + part.nbytes] = part
                    else:
                        part(whole[offset:])
        except BaseException:
            self.release(seg.id)
            raise
        return seg

    def _take(self, size: int) -> Segment:
        # Called with the lock held: the smallest free segment that fits,
        # else the biggest one (grown), else a new one.
        fits = [s for s in self._free if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
        elif self._free:
            seg = max(self._free, key=lambda s: s.size)
        else:
            fd = os.memfd_create("aiopar", os.MFD_CLOEXEC)
            seg = Segment(self._next_id, fd, 0)
            self._next_id += 1
            return seg
        self._free.remove(seg)
        return seg

    def release(self, seg_id: int) -> None:
        """The receiver is done with the segment: keep it for reuse or free it."""
        with self._lock:
            seg = self._busy.pop(seg_id, None)
            if seg is None:
                return
            seg.owner = None
            self._free.append(seg)
            cached = sum(s.size for s in self._free)
            while cached > self._cache_bytes and self._free:
                oldest = self._free.pop(0)
                cached -= oldest.size
                oldest.close()

    def release_owner(self, owner: object) -> None:
        """Release every segment last sent to ``owner`` (a peer that died)."""
        with self._lock:
            ids = [seg.id for seg in self._busy.values() if seg.owner is owner]
        for seg_id in ids:
            self.release(seg_id)

    def close(self) -> None:
        """Close every descriptor; mappings that receivers still hold stay valid."""
        with self._lock:
            segs = self._free + list(self._busy.values())
            self._free, self._busy = [], {}
        for seg in segs:
            seg.close()

    def close_after_fork(self) -> None:
        """In a child made by os.fork(): close this process's copies of the
        descriptors, without the lock (a thread of the parent may hold it)."""
        self._lock = threading.Lock()
        self.close()


def map_segment(
    fd: int, size: int, lengths: list[int], on_unmapped: Callable[[], None]
) -> list[memoryview]:
    """Map the segment ``fd`` (closing the descriptor) and return a view of each
    buffer of ``lengths`` in it; ``on_unmapped`` once the last view is gone.

    ValueError if the segment is shorter than ``size``: reading past its end
    would kill the process (SIGBUS), not raise.
    """
    try:
        held = os.fstat(fd).st_size
        if held < size:
            raise ValueError(
                f"a shared-memory segment of {held} bytes holds no {size}-byte message"
            )
        mapping = _mmap(fd, size)
    finally:
        os.close(fd)
    # Called once the last array built on the mapping is gone.
    finalizer = weakref.finalize(mapping, on_unmapped)
    finalizer.atexit = False
    whole = memoryview(mapping).cast("B")
    views = []
    offset = 0
    for n in lengths:
        views.append(whole[offset : offset + n])
        offset += aligned(n)
    return views


def _libc_mmap() -> Callable[[int, int], Any] | None:
    """mmap through libc: Python's mmap object keeps a duplicate descriptor
    open for its whole life, so a thousand received arrays would hold a
    thousand descriptors and run into the process's limit."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        c_mmap, c_munmap = libc.mmap, libc.munmap
    except (ImportError, OSError, AttributeError):
        return None
    c_mmap.restype = ctypes.c_void_p
    c_mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    c_munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    map_failed = ctypes.c_void_p(-1).value
    prot = mmap.PROT_READ | mmap.PROT_WRITE

    def map_shared(fd: int, size: int) -> Any:
        address = c_mmap(None, size, prot, _ZERO_COPY_MAP, fd, 0)
        if address in (None, map_failed):
            err = ctypes.get_errno()
            raise OSError(err, f"mmap of a {size}-byte shared-memory segment: {os.strerror(err)}")
        memory = (ctypes.c_char * size).from_address(address)
        # Unmapped when the last view of it is gone (nothing can read it then).
        weakref.finalize(memory, c_munmap, address, size).atexit = False
        return memory

    return map_shared


def _python_mmap(fd: int, size: int) -> Any:
    return mmap.mmap(fd, size, flags=_ZERO_COPY_MAP)


_mmap = _libc_mmap() or _python_mmap
