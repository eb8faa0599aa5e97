"""Exceptions across processes: a remote failure arrives here, whatever it holds.

dask's ``error_message``/``clean_exception`` pair fails on the way back when
the traceback could only travel as text (a failure some 300 frames deep:
``clean_exception`` asserts), and lets anything that unpickling raises
escape. Here the exception and its traceback travel separately, each
checked by unpickling it before it leaves, and :func:`unpack` always
returns an exception: the original with the remote traceback when both
arrive, else the best that did (the traceback as text in a note, or a
``RuntimeError`` naming the exception that could not be rebuilt).
"""

from __future__ import annotations

import pickle
import traceback
import types
from collections.abc import Callable
from typing import Any

import cloudpickle
import tblib

__all__ = ["Packed", "RemoteFailure", "pack", "unpack"]

# the exception pickled, its traceback pickled (None if it cannot travel), both as text
Packed = tuple[bytes, bytes | None, str]


def pack(exc: BaseException) -> Packed:
    """``exc`` as a :data:`Packed`; never raises for what ``exc`` holds."""
    text = _text(exc)
    tb, cause, context = exc.__traceback__, exc.__cause__, exc.__context__
    try:  # the exception alone (tblib, which dask installs, would pickle these along)
        exc.__traceback__ = exc.__cause__ = exc.__context__ = None
        data = _round_trip(lambda: exc)
    finally:
        exc.__traceback__, exc.__cause__, exc.__context__ = tb, cause, context
    if data is None:
        data = pickle.dumps(RuntimeError(_describe(exc)))
    tb_data = None if tb is None else _round_trip(lambda: tblib.Traceback(tb).as_dict())
    return data, tb_data, text


def unpack(packed: Packed) -> BaseException:
    """The exception :func:`pack` packed, with its remote traceback where it
    arrives; never raises (what cannot be unpickled here is described)."""
    data, tb_data, text = packed
    try:
        exc = pickle.loads(data)
        if not isinstance(exc, BaseException):
            raise TypeError(f"got {type(exc).__name__}, not an exception")
    except BaseException as error:  # SystemExit too: what a pickle raises is data here
        exc = RuntimeError(
            f"a remote exception cannot be unpickled here ({type(error).__name__}: {error}); "
            f"it was:\n{text}"
        )
        return exc
    tb = None
    if tb_data is not None:
        try:
            tb = tblib.Traceback.from_dict(pickle.loads(tb_data)).as_traceback()
        except BaseException:
            tb = None
    if isinstance(tb, types.TracebackType):
        return exc.with_traceback(tb)
    exc.add_note(f"Remote traceback (it could not travel as a traceback):\n{text}")
    return exc


class RemoteFailure(Exception):
    """Carries a :data:`Packed` exception through code that would handle the
    original badly: a dask task returns it as its value (so dask neither
    logs nor transports the original), a shallow object of plain data."""

    def __init__(self, packed: Packed) -> None:
        super().__init__(packed)
        self.packed = packed

    def __str__(self) -> str:  # what dask shows of it: the exception's own last line
        lines = self.packed[2].strip().splitlines()
        return lines[-1] if lines else "an exception"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self)!r})"


def _round_trip(make: Callable[[], Any]) -> bytes | None:
    """What ``make()`` returns, pickled (cloudpickle for what plain pickle
    cannot), if it unpickles again; None if any of it fails."""
    try:
        obj = make()
        try:
            data = pickle.dumps(obj, protocol=5)
        except Exception:
            data = cloudpickle.dumps(obj, protocol=5)
        pickle.loads(data)
    except BaseException:
        return None
    return data


def _describe(exc: BaseException) -> str:
    try:
        return f"{type(exc).__qualname__}: {exc} (it could not be pickled)"
    except BaseException:
        return f"{type(exc).__qualname__} (it could not be pickled or shown)"


def _text(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(exc))
    except BaseException:
        return _describe(exc)
