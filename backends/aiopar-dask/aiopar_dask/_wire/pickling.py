"""What a message carries: an object as a pickle (protocol 5) and its out-of-band buffers.

An array's data travels as a buffer of its own beside the pickle, so it is
written and read without a copy.
"""

from __future__ import annotations

import copyreg
import io
import pickle
import re
from typing import Any

import cloudpickle

from aiopar.rpc import RRef

from .core import Frames

__all__ = ["dumps", "loads"]

_MAIN = re.compile(rb"__main__")


def dumps(obj: Any) -> tuple[Frames, list[bool]]:
    """``obj`` as frames (a pickle and its out-of-band buffers) and their writeable flags.

    Plain pickle first, as dask's pickler does; cloudpickle (lambdas, what is
    defined in ``__main__``) only when that fails or refers to ``__main__``.
    A message that holds an RRef goes straight to cloudpickle: pickling an
    RRef makes a copy that its owner counts, so it must be pickled once.
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        stream = io.BytesIO()
        _PlainPickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
        data: Any = stream.getbuffer()  # no copy
    except Exception:  # an RRef, or what plain pickle cannot do
        data = b"__main__"
    if _MAIN.search(data):  # (re searches a memoryview without copying it)
        buffers.clear()
        data = cloudpickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    # raw(): the bytes of any contiguous buffer, a zero-length dimension
    # included (a cast of a view with zeros in its shape fails).
    views = [b.raw() for b in buffers]
    return [data, *views], [True, *(not v.readonly for v in views)]


def loads(frames: Frames) -> Any:
    """The object :func:`dumps` made these frames of."""
    return pickle.loads(frames[0], buffers=frames[1:])


def _not_in_plain_pickle(obj: object) -> Any:
    raise pickle.PicklingError(f"{type(obj).__name__} is pickled once, by cloudpickle")


class _PlainPickler(pickle.Pickler):
    dispatch_table = {**copyreg.dispatch_table, RRef: _not_in_plain_pickle}
