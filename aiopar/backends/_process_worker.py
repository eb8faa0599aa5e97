"""The main loop of a worker process of the "process" backend.

A worker runs one task at a time, in the order they arrive, and answers each
with exactly one RESULT or ERROR frame carrying its start and end times
(on :func:`aiopar._trace.clock`, which every process on the machine shares).
A PATH frame replaces its ``sys.path`` with the parent's. It exits when the
parent closes its end of the socket, and at once, even in the middle of a
task, when the parent process dies. Forks made by a task run in the worker
on the thread backend; for a task the parent's profiler records, they are
recorded here and sent in a TRACE frame before the task's result.
"""

from __future__ import annotations

import importlib
import os
import pickle
import signal
import socket
import sys
import traceback
from collections import deque
from typing import Any

from .._trace import capture_forks, clock
from . import _process_wire as wire

__all__ = ["main"]


def main(fd: str) -> None:
    """Serve the parent on the socket ``fd`` (started by :func:`._fresh.fresh_python`,
    which also ends this process with its parent)."""
    # Ctrl-C in a terminal reaches the whole process group: the parent
    # decides what happens to the tasks, not each worker on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from .. import _config
    from . import process

    process.in_worker_backend = _config.set_backend("thread")

    pool = wire.SegmentPool()
    released: deque[int] = deque()  # parent segments this process no longer maps
    channel = wire.Channel(socket.socket(fileno=int(fd)), pool.release, released.append)
    try:
        channel.send(wire.READY, os.getpid())
        while True:
            frame = channel.recv()
            if frame is None:
                continue
            if frame.kind == wire.TASK:
                _run(frame, channel, pool, released)
            elif frame.kind == wire.PATH:
                sys.path[:] = frame.loads()
                importlib.invalidate_caches()
            del frame
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone or shut the pool down
    finally:
        pool.close()


def _drain(released: deque[int]) -> list[int]:
    ids = []
    while released:
        ids.append(released.popleft())
    return ids


def _run(
    frame: wire.Frame, channel: wire.Channel, pool: wire.SegmentPool, released: deque[int]
) -> None:
    msg_id = frame.msg_id
    forks = capture_forks() if frame.t0 else None  # t0: the parent profiles this task
    start = clock()
    kind = wire.ERROR
    try:
        packed = _call(frame, pool)
        kind = wire.RESULT
    except BaseException as exc:
        packed = _pack_error(exc)
    end = clock()
    if forks is not None and (report := forks.report()) is not None:
        trace = wire.Packed(pickle.dumps(report, protocol=5), [], None, None)
        channel.send(wire.TRACE, msg_id, trace)
    # Sent outside the except block, so the traceback (and the arguments it
    # keeps alive) is gone and their segments are reported released.
    channel.send(kind, msg_id, packed, released=_drain(released), t0=start, t1=end)


def _call(frame: wire.Frame, pool: wire.SegmentPool) -> wire.Packed:
    try:
        fn, args, kwargs = wire.load_call(frame)
    except BaseException as exc:
        exc.add_note(
            "(aiopar: raised while unpickling the task in a worker process; the worker "
            "must be able to import every module that the function and its arguments "
            "come from, and its sys.path is the parent's as of the fork)"
        )
        raise
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    result = fn(*args, **kwargs)
    del fn, args, kwargs
    try:
        return wire.pack(result, pool, by_value=False)
    except Exception as exc:
        raise TypeError(
            f"{name} returned a {type(result).__module__}.{type(result).__qualname__} "
            f"that cannot be pickled to send it back from the worker process "
            f"({type(exc).__name__}: {exc}); return plain data (numbers, strings, "
            f"lists, dicts, numpy arrays) instead"
        ) from None


def _round_trip(data: bytes) -> bytes:
    """``data`` once it is known to unpickle: an exception that pickles may still fail to."""
    pickle.loads(data)
    return data


def _pack_error(exc: BaseException) -> wire.Packed:
    """The exception as (pickled exception or None, type name, message, traceback text)."""
    # Start the traceback at the user's code, not at this loop.
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__ and tb.tb_next:
        tb = tb.tb_next
    tb_text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        exc_bytes: bytes | None = _round_trip(pickle.dumps(exc, protocol=5))
    except Exception:
        try:
            import cloudpickle

            exc_bytes = _round_trip(cloudpickle.dumps(exc, protocol=5))
        except Exception:
            exc_bytes = None
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}"
    try:
        message = str(exc)
    except Exception:
        message = "<str() of the exception failed>"
    info: Any = (exc_bytes, kind, message, tb_text)
    return wire.Packed(pickle.dumps(info, protocol=5), [], None, None)
