"""The main loop of a worker process of the "process" backend.

A worker runs one task at a time, in the order they arrive, and answers each
with exactly one RESULT or ERROR frame carrying its start and end times
(on :func:`aiopar._trace.clock`, which every process on the machine shares).
A PATH frame replaces its ``sys.path`` with the parent's. Before it says it
is ready, it takes the parent's multiprocessing authkey and calls the pool's
initializer, if any: one that raises is logged, as ProcessPoolExecutor logs
it, and the worker exits with ``INITIALIZER_FAILED``. It exits when the
parent closes its end of the socket, and at once, even in the middle of a
task, when the parent process dies. Forks made by a task run in the worker,
on the backend the parent names at start-up; for a task the parent's
profiler records, they are recorded here and sent in a TRACE frame before
the task's result.
"""

from __future__ import annotations

import functools
import importlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import Any

from .._shm import SegmentPool
from .._trace import capture_forks, clock
from . import _process_wire as wire
from . import create_backend
from ._process_handle import INITIALIZER_FAILED
from ._process_pickle import ErrorInfo, Packed, error_info, load_call, pack, pack_error
from .process import redirect_forks

__all__ = ["main"]


def main(fd: str, nested_backend: str, setup: str) -> None:
    """Serve the parent on the socket ``fd``, running the forks its tasks
    make on the backend called ``nested_backend``, once set up as the file
    ``setup`` says (started by :func:`aiopar._fresh.fresh_python`, which
    also ends this process with its parent)."""
    # Ctrl-C in a terminal reaches the whole process group: the parent
    # decides what happens to the tasks, not each worker on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    redirect_forks(create_backend(nested_backend))
    _set_up(int(setup))
    pool = SegmentPool()
    released: deque[int] = deque()  # parent segments this process no longer maps
    channel = wire.Channel(socket.socket(fileno=int(fd)), pool.release, released.append)
    skip: list[int] = []  # the calls of the next chunk not to make
    # A parent whose send a signal cut short sends the task's frame again.
    last_task = 0
    try:
        channel.send(wire.READY, os.getpid())
        while True:
            frame = channel.recv()
            if frame is None:
                continue
            if frame.kind == wire.TASK:
                if frame.msg_id == last_task:
                    continue  # a second copy
                last_task = frame.msg_id
                _run(frame, channel, pool, released, _call)
            elif frame.kind == wire.CHUNK:
                _run(frame, channel, pool, released, functools.partial(_call_chunk, skip=skip))
                skip = []
            elif frame.kind == wire.SKIP:
                skip = frame.loads()
            elif frame.kind == wire.PATH:
                sys.path[:] = frame.loads()
                importlib.invalidate_caches()
            del frame
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the parent is gone or shut the pool down
    finally:
        pool.close()


def _set_up(fd: int) -> None:
    """Take the parent's authkey, then call the pool's initializer."""
    with open(fd, "rb") as file:
        authkey, call = pickle.load(file)
    multiprocessing.current_process().authkey = authkey
    if call is None:
        return
    try:
        initializer, initargs = pickle.loads(call)
        initializer(*initargs)
    except BaseException:
        # Where ProcessPoolExecutor's workers log it, so an initializer that
        # sends that logger's records to its parent sends this one too.
        logging.getLogger("concurrent.futures").critical(
            "Exception in initializer of an aiopar process worker:", exc_info=True
        )
        sys.exit(INITIALIZER_FAILED)


def _drain(released: deque[int]) -> list[int]:
    ids = []
    while released:
        ids.append(released.popleft())
    return ids


def _run(
    frame: wire.Frame,
    channel: wire.Channel,
    pool: SegmentPool,
    released: deque[int],
    call: Callable[[wire.Frame, SegmentPool], Packed],
) -> None:
    msg_id = frame.msg_id
    forks = capture_forks() if frame.t0 else None  # t0: the parent profiles this task
    start = clock()
    kind = wire.ERROR
    try:
        packed = call(frame, pool)
        kind = wire.RESULT
    except BaseException as exc:
        packed = _pack_error(exc)
    end = clock()
    if forks is not None and (report := forks.report()) is not None:
        trace = Packed(pickle.dumps(report, protocol=5), [], None, None)
        channel.send(wire.TRACE, msg_id, trace)
    # Sent outside the except block, so the traceback (and the arguments it
    # keeps alive) is gone and their segments are reported released.
    channel.send(kind, msg_id, packed, released=_drain(released), t0=start, t1=end)


def _pack_error(exc: BaseException) -> Packed:
    return pack_error(exc, _users_traceback(exc))


def _error_info(exc: BaseException) -> ErrorInfo:
    return error_info(exc, _users_traceback(exc))


def _users_traceback(exc: BaseException) -> TracebackType | None:
    """The exception's traceback from the user's code on, not from this loop."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__ and tb.tb_next:
        tb = tb.tb_next
    return tb


_UNPICKLING_NOTE = (
    "(aiopar: raised while unpickling the task in a worker process; the worker "
    "must be able to import every module that the function and its arguments "
    "come from, and its sys.path is the parent's as of the fork)"
)


def _load(frame: wire.Frame) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """The task's call, unpickled. What unpickling raises fails the task;
    a SystemExit or KeyboardInterrupt from a pickle's code becomes an
    UnpicklingError, so data never exits the parent that reads the error."""
    try:
        return load_call(frame.loads())
    except Exception as exc:
        exc.add_note(_UNPICKLING_NOTE)
        raise
    except BaseException as exc:
        error = pickle.UnpicklingError(f"unpickling the task raised {exc!r}")
        error.add_note(_UNPICKLING_NOTE)
        raise error from exc


def _call(frame: wire.Frame, pool: SegmentPool) -> Packed:
    fn, args, kwargs = _load(frame)
    name = _name(fn)
    result = fn(*args, **kwargs)
    del fn, args, kwargs
    try:
        return pack(result, pool, by_value=False)
    except Exception as exc:
        raise _unpicklable_result(name, result, exc) from None


def _call_chunk(frame: wire.Frame, pool: SegmentPool, skip: list[int]) -> Packed:
    """Make each call of a chunk but those in ``skip``; the outcomes, one per
    call: None (skipped), (True, the value) or (False, the error's info)."""
    fn, items, _ = _load(frame)
    skipped = set(skip)
    outcomes: list[tuple[bool, Any] | None] = []
    for i, args in enumerate(items):
        if i in skipped:
            outcomes.append(None)
            continue
        try:
            outcomes.append((True, fn(*args)))
        except BaseException as exc:
            outcomes.append((False, _error_info(exc)))
    del items
    try:
        return pack(outcomes, pool, by_value=False)
    except Exception:
        pass  # a value does not pickle: that call alone fails
    name = _name(fn)
    for i, outcome in enumerate(outcomes):
        if outcome is not None and outcome[0]:
            try:
                pack(outcome[1], pool, by_value=False).discard()
            except Exception as exc:
                error = _unpicklable_result(name, outcome[1], exc)
                outcomes[i] = (False, error_info(error, None))
    return pack(outcomes, pool, by_value=False)


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


def _unpicklable_result(name: str, result: Any, exc: Exception) -> TypeError:
    return TypeError(
        f"{name} returned a {type(result).__module__}.{type(result).__qualname__} "
        f"that cannot be pickled to send it back from the worker process "
        f"({type(exc).__name__}: {exc}); return plain data (numbers, strings, "
        f"lists, dicts, numpy arrays) instead"
    )
