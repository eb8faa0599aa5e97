"""What travels on the process backend's wire: a call, a value or a task's
exception, pickled with protocol 5, large buffers moved into a shared-memory
segment; and what the parent makes of what did not pickle or unpickle.

Buffers of at least ``LARGE_BUFFER`` bytes (numpy arrays wherever they sit
in the value: in lists, in objects, captured by a closure; bytearrays, ...)
leave the pickle stream: they are copied once into a segment, and the
receiver rebuilds the arrays on top of its mapping without copying again.
An array that is not contiguous (a strided slice) is copied into the
segment contiguously, so it leaves the stream too. A pickle of
``LARGE_PICKLE`` bytes or more (a big ``bytes``, ``str`` or list) rides in
the segment as well, after the buffers. What a fresh interpreter cannot
import (lambdas, closures, ``__main__``) travels by value, as cloudpickle
writes it.
"""

from __future__ import annotations

import copyreg
import pickle
import sys
import threading
import traceback
import types
import weakref
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle

from .._shm import HAVE_MEMFD, Filler, Segment, SegmentPool, aligned

__all__ = [
    "LARGE_BUFFER",
    "LARGE_PICKLE",
    "ErrorInfo",
    "Packed",
    "RemoteError",
    "RemoteTraceback",
    "error_info",
    "load_call",
    "pack",
    "pack_call",
    "pack_error",
    "remote_exception",
    "unpicklable_part",
    "unpickling_failed",
]

#: buffers at least this big travel in shared memory, smaller ones in the pickle
LARGE_BUFFER = 64 * 1024
#: a pickle at least this big travels in shared memory, a smaller one on the socket
LARGE_PICKLE = 1024 * 1024


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


_cloudpickle_code_reduce = cloudpickle.Pickler.dispatch_table[types.CodeType]


def _code_reduce(code: types.CodeType) -> Any:
    # cloudpickle writes "<dynamic-code>" for the file name of the code it
    # sends by value (so that its bytes do not depend on where the code
    # was defined): a traceback in the worker then names no file and shows
    # no source line. The real name makes it show both where the worker can
    # read the file (on this machine, it can).
    rebuild, args = _cloudpickle_code_reduce(code)
    if "<dynamic-code>" in args:
        where = args.index("<dynamic-code>")
        args = (*args[:where], code.co_filename, *args[where + 1 :])
    return rebuild, args


class _CloudPickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    """cloudpickle's Pickler, keeping the file names of the code it sends."""

    dispatch_table = ChainMap({types.CodeType: _code_reduce}, cloudpickle.Pickler.dispatch_table)


# (copyreg's table size, the plain and the cloudpickle Pickler)
_picklers: tuple[int, type[pickle.Pickler], type[pickle.Pickler]] | None = None


def _pickler_classes() -> tuple[type[pickle.Pickler], type[pickle.Pickler]]:
    """The plain and the cloudpickle Pickler, made to send every numpy array
    out of band once numpy is imported (without importing it here)."""
    global _picklers
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return pickle.Pickler, _CloudPickler
    cached = _picklers
    if cached is None or cached[0] != len(copyreg.dispatch_table):
        ndarray = numpy.ndarray
        # A plain dict (a ChainMap would cost a Python call per object
        # pickled), rebuilt when a library registers a reducer.
        plain_table = {**copyreg.dispatch_table, ndarray: _contiguous_reduce}
        cloud_table = ChainMap({ndarray: _contiguous_reduce}, _CloudPickler.dispatch_table)
        plain = type("Pickler", (pickle.Pickler,), {"dispatch_table": plain_table})
        cloud = type("Pickler", (_CloudPickler,), {"dispatch_table": cloud_table})
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
    mentions = 0
    for chunk in chunks:  # a loop, not a generator: this runs on every fork
        if len(chunk) < 256 * 1024:
            mentions += chunk.count(b"__main__")
    return mentions


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
        if view.nbytes < LARGE_BUFFER or not HAVE_MEMFD:
            return True  # in-band: part of the pickle
        large.append(view)
        return False

    plain, cloud = _pickler_classes()
    chunks = None
    stand_ins: dict[int, tuple[Any, Any]] = {}
    _packing.stand_ins = stand_ins if HAVE_MEMFD else None
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
    pickle_size = sum(map(len, chunks))
    in_segment = pickle_size >= LARGE_PICKLE and HAVE_MEMFD
    if not large and not in_segment:
        return Packed(chunks[0] if len(chunks) == 1 else b"".join(chunks), [], None, None)
    placed: list[tuple[int, memoryview | Filler]] = []
    offset = 0
    for view in large:
        stand_in = stand_ins.get(id(view.obj))
        placed.append((offset, view if stand_in is None else _filler(stand_in[1])))
        offset += aligned(view.nbytes)
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
    data = b"".join(_dumps(_CloudPickler, fn, lambda _: True))
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


def load_call(call: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The ``(fn, args, kwargs)`` of a call that :func:`pack_call` packed,
    once unpickled."""
    fn, pickled, args, kwargs = call
    if pickled:
        data = fn
        fn = _loaded_functions.get(data)
        if fn is None:
            if len(_loaded_functions) >= 256:
                _loaded_functions.clear()
            fn = _loaded_functions[data] = pickle.loads(data)
    return fn, args, kwargs


def unpicklable_part(
    fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any], arg: str = "argument", first: int = 0
) -> str:
    """Name the first part of a call that does not pickle, for the error
    message (``arg`` is what an item of ``args`` is called, the first one
    numbered ``first``)."""
    parts: list[tuple[str, Any]] = [("the function", fn)]
    parts += [(f"{arg} {i}", value) for i, value in enumerate(args, first)]
    parts += [(f"keyword argument {key!r}", value) for key, value in kwargs.items()]
    for label, value in parts:
        try:
            cloudpickle.dumps(value, protocol=5, buffer_callback=lambda _: False)
        except Exception:
            return f"{label} (a {type(value).__module__}.{type(value).__qualname__})"
    return "part of the call"


def unpickling_failed(exc: BaseException, task_name: str) -> BaseException:
    """The error for a result that came back but does not unpickle here."""
    error = TypeError(
        f"the result of {task_name}() came back from the worker process but could not be "
        f"unpickled here ({type(exc).__name__}: {exc}); is its class importable in this process?"
    )
    error.__cause__ = exc
    return error


# -- a task's exception -----------------------------------------------------------
#
# It travels as (the pickled exception or None, its type's name, its message,
# the traceback text), so what cannot pickle, or unpickle in the parent,
# still reaches the user with its story.


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text.

    Attached as the ``__cause__`` of the exception that ``wait`` raises, so
    a printed traceback shows where the task failed inside the worker.
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n\nTraceback in the worker process:\n"""\n{self.tb}"""'


class RemoteError(Exception):
    """Stands in for an exception raised in a worker that could not be pickled."""


def _round_trip(data: bytes) -> bytes:
    """``data`` once it is known to unpickle: an exception that pickles may still fail to."""
    pickle.loads(data)
    return data


ErrorInfo = tuple[bytes | None, str, str, str]


def pack_error(exc: BaseException, tb: types.TracebackType | None) -> Packed:
    """``exc`` ready to send, its traceback text starting at ``tb``."""
    return Packed(pickle.dumps(error_info(exc, tb), protocol=5), [], None, None)


def error_info(exc: BaseException, tb: types.TracebackType | None) -> ErrorInfo:
    """``exc`` as plain data that always pickles, its traceback text starting
    at ``tb``, for :func:`remote_exception`."""
    tb_text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        exc_bytes: bytes | None = _round_trip(pickle.dumps(exc, protocol=5))
    except Exception:
        try:
            exc_bytes = _round_trip(cloudpickle.dumps(exc, protocol=5))
        except Exception:
            exc_bytes = None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        message = str(exc)
    except Exception:
        message = "<str() of the exception failed>"
    return (exc_bytes, kind, message, tb_text)


def remote_exception(info: ErrorInfo, task_name: str) -> BaseException:
    """The exception that :func:`error_info` described, with the traceback text
    as its ``__cause__``; a :class:`RemoteError` if it does not unpickle."""
    exc_bytes, kind, message, tb_text = info
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:
            exc = None
    if exc is None:
        exc = RemoteError(
            f"{kind}: {message} (raised by {task_name}() in a worker process; the exception "
            f"itself could not be pickled, so this stands in for it)"
        )
    exc.__cause__ = RemoteTraceback(tb_text)
    return exc
