"""The wire between the parent and a worker process: framed messages over a
Unix socket, with large buffers passed as shared-memory file descriptors.

Values are pickled with protocol 5. Buffers of at least ``LARGE_BUFFER``
bytes (numpy arrays wherever they sit in the value: in lists, in objects,
captured by a closure; bytearrays, ...) leave the pickle stream: they are
copied once into a shared-memory segment (a ``memfd``) whose descriptor
travels with the message (``SCM_RIGHTS``), and the receiver maps it and
rebuilds the arrays on top of the mapping without copying again. An array
that is not contiguous (a strided slice) is copied into the segment
contiguously, so it leaves the stream too. A pickle of ``LARGE_PICKLE``
bytes or more (a big ``bytes``, ``str`` or list) rides in the segment as
well, after the buffers, and the receiver unpickles it from the mapping; a
smaller one travels on the socket, read into one buffer of its size. Either
way a message costs time in proportion to its size.

A segment has no name, so nothing can be left behind in ``/dev/shm``: the
kernel frees it once the last descriptor and mapping are gone, even if
either process is killed. The sender keeps its descriptor so it can reuse
the segment's memory (already paged in) for a later message; the receiver
tells it when its mapping is gone (``released`` ids ride on the next frame).
Without ``os.memfd_create`` (not Linux) every buffer stays in the pickle.
"""

from __future__ import annotations

import copyreg
import mmap
import os
import pickle
import socket
import struct
import sys
import threading
import types
import weakref
from array import array
from collections import ChainMap, deque
from collections.abc import Callable, Iterable
from typing import Any

import cloudpickle

__all__ = ["Channel", "Frame", "Packed", "SegmentPool", "load_call", "pack", "pack_call"]

#: buffers at least this big travel in shared memory, smaller ones in the pickle
LARGE_BUFFER = 64 * 1024
#: a pickle at least this big travels in shared memory, a smaller one on the socket
LARGE_PICKLE = 1024 * 1024
#: free segment memory each process keeps for reuse before it gives memory back
SEGMENT_CACHE_BYTES = 256 * 1024 * 1024

_HAVE_MEMFD = hasattr(os, "memfd_create")
_ALIGN = 64  # buffers start on cache-line boundaries inside a segment

# kinds of frame; a TASK frame's t0 is 1 when the parent's profiler records
# the task, and the worker then sends a TRACE frame (what the task forked
# there) right before its RESULT or ERROR
TASK, RESULT, ERROR, READY, RELEASE, PATH, TRACE = 1, 2, 3, 4, 5, 6, 7

# kind, segment flags, buffer count, released-id count, message id,
# segment id, segment size, payload size, start and end times (ns)
_HEADER = struct.Struct("<BBxxIIxxxxqQQQqq")
# segment flags: there is a segment; the pickle is in it, after the buffers
_HAS_SEGMENT, _PICKLE_IN_SEGMENT = 1, 2
_ANC_SIZE = socket.CMSG_SPACE(16 * array("i").itemsize)
_ZERO_COPY_MAP = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _aligned(n: int) -> int:
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

    def write(self, placed: list[tuple[int, memoryview | Filler]], size: int) -> Segment:
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


class Packed:
    """A pickled value ready to send: the pickle, plus a segment for big buffers.

    ``lengths`` are the sizes of the buffers in the segment; a pickle of
    ``pickle_in_segment`` bytes follows them there (then ``payload`` is empty).
    """

    __slots__ = ("lengths", "payload", "pickle_in_segment", "pool", "segment")

    def __init__(
        self,
        payload: bytes,
        lengths: list[int],
        segment: Segment | None,
        pool: SegmentPool | None,
        pickle_in_segment: int = 0,
    ) -> None:
        self.payload = payload
        self.lengths = lengths
        self.segment = segment
        self.pool = pool
        self.pickle_in_segment = pickle_in_segment

    def discard(self) -> None:
        """Give the segment back: the value will never be sent."""
        if self.segment is not None and self.pool is not None:
            self.pool.release(self.segment.id)
            self.segment = None


def _pickle_by_value_modules() -> bool:
    """Whether modules were registered with ``cloudpickle.register_pickle_by_value``."""
    return bool(getattr(cloudpickle.cloudpickle, "_PICKLE_BY_VALUE_MODULES", True))


#: writes an array into the segment memory it is given
Filler = Callable[[memoryview], None]

# pack()'s stand-ins for strided arrays, by id: (stand-in, the array)
_packing = threading.local()


def _contiguous_reduce(a: Any) -> Any:
    # numpy writes an array that is neither C- nor Fortran-contiguous (a
    # strided slice) into the pickle itself; a contiguous one leaves the
    # stream like any other. A big one is copied once, straight into the
    # segment: pickled meanwhile is an untouched stand-in (no page of it is
    # ever faulted in).
    if not (a.flags.c_contiguous or a.flags.f_contiguous) and not a.dtype.hasobject:
        stand_ins = getattr(_packing, "stand_ins", None)
        if stand_ins is not None and a.nbytes >= LARGE_BUFFER:
            contiguous = sys.modules["numpy"].empty(a.shape, a.dtype)
            stand_ins[id(contiguous)] = (contiguous, a)
            a = contiguous
        else:
            a = a.copy()
    return a.__reduce_ex__(5)


def _filler(array: Any) -> Filler:
    def fill(memory: memoryview) -> None:
        numpy = sys.modules["numpy"]
        numpy.copyto(numpy.ndarray(array.shape, array.dtype, buffer=memory), array)

    return fill


# (copyreg's table size, the plain and the cloudpickle Pickler)
_picklers: tuple[int, type[pickle.Pickler], type[pickle.Pickler]] | None = None


def _pickler_classes() -> tuple[type[pickle.Pickler], type[pickle.Pickler]]:
    """The plain and the cloudpickle Pickler, made to send every numpy array
    out of band once numpy is imported (without importing it here)."""
    global _picklers
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return pickle.Pickler, cloudpickle.Pickler
    cached = _picklers
    if cached is None or cached[0] != len(copyreg.dispatch_table):
        ndarray = numpy.ndarray
        # A plain dict (a ChainMap would cost a Python call per object
        # pickled), rebuilt when a library registers a reducer.
        plain_table = {**copyreg.dispatch_table, ndarray: _contiguous_reduce}
        cloud_table = ChainMap({ndarray: _contiguous_reduce}, cloudpickle.Pickler.dispatch_table)
        plain = type("Pickler", (pickle.Pickler,), {"dispatch_table": plain_table})
        cloud = type("Pickler", (cloudpickle.Pickler,), {"dispatch_table": cloud_table})
        cached = _picklers = (len(copyreg.dispatch_table), plain, cloud)
    return cached[1], cached[2]


class _Chunks(list):  # type: ignore[type-arg]
    """What a Pickler writes, piece by piece: it hands a big ``bytes`` over
    as the object itself, so pickling one copies nothing."""

    def write(self, data: Any) -> None:
        # A view of a mutable buffer (in-band only where there is no memfd)
        # is copied: the caller may change it before the message is sent.
        self.append(data if type(data) is bytes else bytes(data))


def _dumps(
    pickler: type[pickle.Pickler], obj: Any, buffer_callback: Callable[..., Any]
) -> list[bytes]:
    chunks = _Chunks()
    pickler(chunks, protocol=5, buffer_callback=buffer_callback).dump(obj)
    return chunks


def _mentions_of_main(chunks: list[bytes]) -> int:
    # A reference to __main__ is written by the pickler into one of its
    # frames (64 KiB or so); a bigger chunk is a user's bytes or str, never
    # scanned.
    return sum(chunk.count(b"__main__") for chunk in chunks if len(chunk) < 256 * 1024)


def pack(
    obj: Any,
    pool: SegmentPool,
    *,
    by_value: bool = True,
    plain_first: bool = True,
    _mains: int = 0,
) -> Packed:
    """Pickle ``obj``, moving its large buffers into a segment from ``pool``.

    ``by_value`` makes what a fresh interpreter cannot import (lambdas,
    closures, functions and classes of ``__main__``) travel by value, as
    cloudpickle does; otherwise cloudpickle is only the fallback.
    ``plain_first=False`` skips the plain pickler when it is known to fail.
    """
    large: list[memoryview] = []

    def buffer_callback(buf: pickle.PickleBuffer) -> bool:
        view = buf.raw()
        if view.nbytes < LARGE_BUFFER or not _HAVE_MEMFD:
            return True  # in-band: part of the pickle
        large.append(view)
        return False

    plain, cloud = _pickler_classes()
    chunks = None
    stand_ins: dict[int, tuple[Any, Any]] = {}
    _packing.stand_ins = stand_ins if _HAVE_MEMFD else None
    try:
        if plain_first and (not by_value or not _pickle_by_value_modules()):
            # The C pickler is several times faster than cloudpickle; its
            # output is the same unless something refers to __main__ (which
            # a worker does not import) or cannot be pickled by reference.
            try:
                chunks = _dumps(plain, obj, buffer_callback)
            except Exception:
                chunks = None
            if by_value and chunks is not None and _mentions_of_main(chunks) > _mains:
                chunks = None
        if chunks is None:
            large.clear()
            stand_ins.clear()
            chunks = _dumps(cloud, obj, buffer_callback)
    finally:
        _packing.stand_ins = None
    pickle_size = sum(len(chunk) for chunk in chunks)
    in_segment = pickle_size >= LARGE_PICKLE and _HAVE_MEMFD
    if not large and not in_segment:
        return Packed(chunks[0] if len(chunks) == 1 else b"".join(chunks), [], None, None)
    placed: list[tuple[int, memoryview | Filler]] = []
    offset = 0
    for view in large:
        stand_in = stand_ins.get(id(view.obj))
        placed.append((offset, view if stand_in is None else _filler(stand_in[1])))
        offset += _aligned(view.nbytes)
    if in_segment:
        for chunk in chunks:  # back to back: the receiver reads one pickle
            placed.append((offset, memoryview(chunk)))
            offset += len(chunk)
        payload = b""
    else:
        payload = b"".join(chunks)
    segment = pool.write(placed, offset)
    lengths = [view.nbytes for view in large]
    return Packed(payload, lengths, segment, pool, pickle_size if in_segment else 0)


# -- functions that travel by value ---------------------------------------------
#
# cloudpickle writes a function from __main__ (or a lambda, or a closure) out
# in full, code and referenced globals included: some 15 us a call. The
# bytes are reused while everything they were made from is provably the same:
# the same code, defaults and closure cells, and referenced globals that are
# the same immutable objects (or such functions, recursively). A function
# that refers to a mutable global (a list, a dict, an array) is pickled anew
# each call, so the worker always sees what the parent sees at fork time.

_IMMUTABLE = (
    int,
    float,
    complex,
    str,
    bytes,
    bool,
    type(None),
    range,
    types.ModuleType,
    types.BuiltinFunctionType,
)
_by_value_cache: weakref.WeakKeyDictionary[Any, tuple[Any, bytes, list[Any]]] = (
    weakref.WeakKeyDictionary()
)
_extract_code_globals = getattr(cloudpickle.cloudpickle, "_extract_code_globals", None)


def _fingerprint(value: Any, refs: list[Any], depth: int = 0) -> Any:
    """Something equal as long as cloudpickle would write ``value`` the same
    way; None when that cannot be told cheaply. ``refs`` keeps the objects
    whose ids are used alive, so no id can be reused meanwhile (but never a
    by-value function itself, which would keep its cache entry alive)."""
    if isinstance(value, _IMMUTABLE):
        refs.append(value)
        return id(value)
    if isinstance(value, type) or type(value) is types.FunctionType:
        module = getattr(value, "__module__", None)
        if module != "__main__" and module in sys.modules and "<" not in value.__qualname__:
            refs.append(value)
            return id(value)  # pickled by reference
    if type(value) is tuple:
        items = tuple(_fingerprint(item, refs, depth + 1) for item in value)
        return None if None in items else items
    if type(value) is not types.FunctionType or depth > 3 or value.__dict__:
        return None
    if value.__kwdefaults__:
        return None
    refs.append(value.__code__)
    fn_globals = value.__globals__
    parts: list[Any] = [id(value.__code__)]
    for name in _extract_code_globals(value.__code__):  # type: ignore[misc]
        parts.append(_fingerprint(fn_globals.get(name), refs, depth + 1))
    parts.append(_fingerprint(value.__defaults__, refs, depth + 1))
    for cell in value.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # an empty cell
            return None
        parts.append(_fingerprint(contents, refs, depth + 1))
    return None if None in parts else tuple(parts)


def _function_by_value(fn: Any) -> bytes | None:
    """cloudpickle's bytes for ``fn``, reused while they would not change;
    None when that cannot be told cheaply (it refers to a list, an array...)."""
    if _extract_code_globals is None:
        return None
    refs: list[Any] = []
    fingerprint = _fingerprint(fn, refs)
    if fingerprint is None:
        return None
    entry = _by_value_cache.get(fn)
    if entry is not None and entry[0] == fingerprint:
        return entry[1]
    data: bytes = cloudpickle.dumps(fn, protocol=5)
    _by_value_cache[fn] = (fingerprint, data, refs)
    return data


def pack_call(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], pool: SegmentPool) -> Packed:
    """Pack a call as ``(fn or its pickle, pickled?, args, kwargs)`` for :func:`load_call`."""
    if type(fn) is types.FunctionType:
        module = fn.__module__
        if module == "__main__" or "<" in fn.__qualname__ or module not in sys.modules:
            data = _function_by_value(fn)
            if data is None:
                # Pickled with the call, so the arrays it refers to leave
                # the pickle like the arguments' do.
                return pack((fn, False, args, kwargs), pool, plain_first=False)
            # The function's own mentions of __main__ are fine: it travels by value.
            return pack((data, True, args, kwargs), pool, _mains=data.count(b"__main__"))
    return pack((fn, False, args, kwargs), pool)


_loaded_functions: dict[bytes, Any] = {}


def load_call(frame: Frame) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The ``(fn, args, kwargs)`` of a frame made by :func:`pack_call`."""
    fn, pickled, args, kwargs = frame.loads()
    if pickled:
        data = fn
        fn = _loaded_functions.get(data)
        if fn is None:
            if len(_loaded_functions) >= 256:
                _loaded_functions.clear()
            fn = _loaded_functions[data] = pickle.loads(data)
    return fn, args, kwargs


class Frame:
    """One received message."""

    __slots__ = ("buffers", "kind", "msg_id", "payload", "t0", "t1")

    def __init__(
        self,
        kind: int,
        msg_id: int,
        payload: bytes | bytearray | memoryview,
        buffers: list[memoryview],
        t0: int,
        t1: int,
    ) -> None:
        self.kind = kind
        self.msg_id = msg_id
        self.payload = payload
        self.buffers = buffers
        self.t0 = t0
        self.t1 = t1

    def loads(self) -> Any:
        """Unpickle the payload on top of the received buffers, then let go
        of both (the arrays built on a segment keep it mapped)."""
        try:
            return pickle.loads(self.payload, buffers=self.buffers)
        finally:
            self.payload = b""
            self.buffers = []


def _map_segment(
    fd: int, size: int, lengths: list[int], on_unmapped: Callable[[], None]
) -> list[memoryview]:
    try:
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
        offset += _aligned(n)
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


class Channel:
    """Framed messages over one end of a Unix stream socket.

    ``send`` is not thread-safe: callers serialize it. ``on_released(seg_id)``
    is called for every segment the peer reports it no longer maps;
    ``on_unmapped(seg_id)`` once this process stops mapping one the peer sent.
    """

    def __init__(
        self,
        sock: socket.socket,
        on_released: Callable[[int], None],
        on_unmapped: Callable[[int], None],
    ) -> None:
        self.sock = sock
        self._on_released = on_released
        self._on_unmapped = on_unmapped
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        # A reused read buffer: a fresh big bytes object per read costs an
        # mmap and page faults.
        self._chunk = bytearray(64 * 1024)
        self._chunk_view = memoryview(self._chunk)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(
        self,
        kind: int,
        msg_id: int = 0,
        packed: Packed | None = None,
        *,
        released: Iterable[int] = (),
        t0: int = 0,
        t1: int = 0,
        owner: object = None,
    ) -> None:
        released = list(released)
        if packed is None:
            seg, payload, lengths, in_segment = None, b"", [], 0
        else:
            seg, payload, lengths = packed.segment, packed.payload, packed.lengths
            in_segment = packed.pickle_in_segment
        flags = 0
        if seg is not None:
            flags = _HAS_SEGMENT | (_PICKLE_IN_SEGMENT if in_segment else 0)
        header = _HEADER.pack(
            kind,
            flags,
            len(lengths),
            len(released),
            msg_id,
            seg.id if seg is not None else 0,
            sum(_aligned(n) for n in lengths) + in_segment,
            in_segment or len(payload),
            t0,
            t1,
        )
        if lengths or released:
            parts = [header, array("Q", lengths + released).tobytes(), payload]
        else:
            parts = [header, payload]
        ancdata = []
        if seg is not None:
            seg.owner = owner
            ancdata = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", [seg.fd]))]
        sent = self.sock.sendmsg(parts, ancdata)
        for part in parts:
            # A partial send (a signal interrupted it): the rest, part by part
            # rather than joined into one more copy.
            if sent >= len(part):
                sent -= len(part)
            else:
                self.sock.sendall(memoryview(part)[sent:])
                sent = 0

    def has_frame(self) -> bool:
        """Whether a whole frame is already buffered (recv will not block)."""
        return len(self._buf) >= _HEADER.size and self._frame_size() <= len(self._buf)

    def _frame_size(self) -> int:
        _, flags, nbufs, nrel, _, _, _, plen, _, _ = _HEADER.unpack_from(self._buf)
        size: int = _HEADER.size + 8 * (nbufs + nrel) + (0 if flags & _PICKLE_IN_SEGMENT else plen)
        return size

    def recv(self) -> Frame | None:
        """The next frame, blocking until it is whole; None for a frame that
        only carried released segment ids. Raises EOFError when the peer is gone."""
        buf = self._buf
        while len(buf) < _HEADER.size:
            self._fill()
        kind, flags, nbufs, nrel, msg_id, seg_id, seg_size, plen, t0, t1 = _HEADER.unpack_from(buf)
        in_segment = plen if flags & _PICKLE_IN_SEGMENT else 0
        if in_segment:
            plen = 0  # on the socket
        start = _HEADER.size + 8 * (nbufs + nrel)
        end = start + plen
        # Small frames come through the chunk (a read may take several);
        # a big one is read straight into a buffer of its own size, so a
        # frame costs time in proportion to its size.
        while len(buf) < start or len(buf) < end <= len(buf) + len(self._chunk):
            self._fill()
        ids = array("Q")
        payload: bytes | bytearray | memoryview
        with memoryview(buf) as view:
            ids.frombytes(view[_HEADER.size : start])
            if len(buf) >= end:
                payload = bytes(view[start:end])
                have = plen
            else:
                payload = bytearray(plen)
                have = len(buf) - start
                payload[:have] = view[start:]
        del buf[: start + have]
        if have < plen:
            self._recv_into(memoryview(payload)[have:])
        for released_id in ids[nbufs:]:
            self._on_released(released_id)
        buffers: list[memoryview] = []
        if flags & _HAS_SEGMENT:
            if not self._fds:
                raise EOFError("a frame announced a shared-memory segment that did not arrive")
            fd = self._fds.popleft()
            on_unmapped = self._on_unmapped
            lengths = list(ids[:nbufs])
            if in_segment:
                lengths.append(in_segment)
            buffers = _map_segment(fd, seg_size, lengths, lambda: on_unmapped(seg_id))
            if in_segment:
                payload = buffers.pop()
        if kind == RELEASE:
            return None
        return Frame(kind, msg_id, payload, buffers, t0, t1)

    def _fill(self) -> None:
        """Read what is there (up to a chunk) onto the end of the buffer."""
        nbytes = self._recvmsg(self._chunk_view)
        self._buf += self._chunk_view[:nbytes]

    def _recv_into(self, view: memoryview) -> None:
        """Fill ``view`` from the socket."""
        while view:
            nbytes = self._recvmsg(view)
            view = view[nbytes:]

    def _recvmsg(self, view: memoryview) -> int:
        nbytes, ancdata, flags, _ = self.sock.recvmsg_into([view], _ANC_SIZE)
        for level, kind, cdata in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array("i")
                fds.frombytes(cdata[: len(cdata) - len(cdata) % fds.itemsize])
                self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise EOFError("file descriptors were lost in transit (MSG_CTRUNC)")
        if not nbytes:
            raise EOFError("the peer closed its end of the socket")
        return nbytes

    def close(self) -> None:
        """Close the socket and every descriptor received but not yet mapped."""
        while self._fds:
            os.close(self._fds.popleft())
        self.sock.close()
