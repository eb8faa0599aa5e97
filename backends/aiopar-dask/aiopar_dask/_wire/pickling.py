"""What a message carries: an object as a pickle (protocol 5) and its out-of-band buffers.

An array's data travels as a buffer of its own beside the pickle, so it is
written and read without a copy. Unpickling runs whatever code the pickle
names (a class's ``__setstate__``, a ``__reduce__``'s function): a thread
that must not wait on it reads only :func:`plain` data, which names none.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import re
import sys
import types
from typing import Any

import cloudpickle

from aiopar.rpc import RRef

from .core import Frames

__all__ = ["NOT_PLAIN", "dumps", "loads", "plain"]

_MAIN = re.compile(rb"__main__")
_PLAIN_MOST = 1 << 16  # bytes of plain data read at once: a millisecond's work at most

NOT_PLAIN: Any = object()  # what plain() returns for anything else


def dumps(obj: Any, main_by_name: bool = False) -> tuple[Frames, list[bool]]:
    """``obj`` as frames (a pickle and its out-of-band buffers) and their writeable flags.

    Plain pickle first, as dask's pickler does; cloudpickle (lambdas, what
    is defined in ``__main__``) only when that fails or refers to
    ``__main__``. With ``main_by_name`` (for a peer whose ``__main__`` is
    this process's script), the functions and classes of ``__main__``
    travel by name as plain pickle sends them, and only what cannot
    (lambdas, local functions) by value. A message that holds an RRef
    goes straight to cloudpickle: pickling an RRef makes a copy that its
    owner counts, so it must be pickled once.
    """
    buffers: list[pickle.PickleBuffer] = []
    data: Any = None
    try:
        stream = io.BytesIO()
        _PlainPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
        data = stream.getbuffer()  # no copy
    except Exception:  # an RRef, or what plain pickle cannot do
        pass
    # (re searches a memoryview without copying it)
    if data is None or (not main_by_name and _MAIN.search(data)):
        buffers.clear()
        stream = io.BytesIO()
        pickler = _MainByName if main_by_name else cloudpickle.Pickler
        pickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
        data = stream.getbuffer()
    # raw(): the bytes of any contiguous buffer, a zero-length dimension
    # included (a cast of a view with zeros in its shape fails).
    views = [b.raw() for b in buffers]
    return [data, *views], [True, *(not v.readonly for v in views)]


def loads(frames: Frames) -> Any:
    """The object :func:`dumps` made these frames of."""
    return pickle.loads(frames[0], buffers=frames[1:])


def plain(frames: Frames) -> Any:
    """The object of these frames if it is small plain data: built-in
    values and containers only (None, numbers, strings, bytes, lists,
    tuples, dicts, sets), at most 64 KiB, no out-of-band buffer. Nothing in
    such a pickle names a class or a function, so reading it runs no code
    but the unpickler's own, and takes a millisecond at most. Else
    :data:`NOT_PLAIN`, without having run anything of it."""
    if len(frames) > 1 or len(frames[0]) > _PLAIN_MOST:
        return NOT_PLAIN
    try:
        return _PlainUnpickler(io.BytesIO(frames[0])).load()
    except Exception:  # it names something, or it is no pickle: loads() says which
        return NOT_PLAIN


def _not_in_plain_pickle(obj: object) -> Any:
    raise pickle.PicklingError(f"{type(obj).__name__} is pickled once, by cloudpickle")


class _PlainPickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, RRef: _not_in_plain_pickle}


class _MainByName(cloudpickle.Pickler):  # type: ignore[misc]  # (cloudpickle has no types)
    """cloudpickle, but for the functions and classes of ``__main__`` that
    can be found there by name: those go by name, as plain pickle sends them."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | types.FunctionType) and obj.__module__ == "__main__":
            main = sys.modules["__main__"]
            if getattr(main, obj.__qualname__, None) is obj:
                return NotImplemented  # pickle's own way: by name
        return super().reducer_override(obj)


class _PlainUnpickler(pickle.Unpickler):
    """Refuses every global: the one way for a pickle to reach code to run."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
