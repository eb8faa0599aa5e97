"""What runs inside a dask worker: the task wrapper and its thread's waiter.

A forked task runs under ``use_backend`` of a backend on the worker's own
client (the forking backend says which, as the task's first argument), so
the forks it makes go to the cluster too, and with a :class:`Seceder` as its
thread's waiter, so waiting on them gives the thread back to the worker.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import distributed
from distributed.threadpoolexecutor import secede as _leave_pool
from distributed.threadpoolexecutor import thread_state as _pool_thread_state

import aiopar
from aiopar.lowlevel import set_waiter

from ._errors import RemoteFailure, pack

__all__ = ["Opaque", "Seceder", "run_chunk", "run_task", "run_task_async"]


class Opaque:
    """A task's function and arguments, hidden from dask's graph: dask reads
    a task's arguments as part of its graph (a dask ``Task`` among them would
    be computed first, a dask future replaced by its value), and a fork's
    function gets its arguments as given, as on every other backend."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, ...]:
        return Opaque, (self.value,)


class Seceder:
    """Waiter of a dask worker thread: it leaves the worker's thread pool while
    it is blocked in ``wait()`` and rejoins after, so a 1-thread worker whose
    task waits on a task of its own still runs that task.

    A dask task secedes as soon as it blocks (what it waits for is at least a
    scheduler round trip away, and the scheduler must learn that the slot is
    free); an rpc call secedes only once it has been blocked for 0.1 s, since
    most nested calls are answered sooner than a thread is replaced.
    """

    __slots__ = ("_is_task", "_seceded")

    def __init__(self, is_task: bool) -> None:
        self._is_task = is_task
        self._seceded = False

    def blocked(self) -> None:
        if self._is_task and not self._seceded and _in_dask_pool():
            distributed.secede()
            self._seceded = True

    def blocked_long(self) -> None:
        if not self._seceded and _in_dask_pool():
            _leave_pool()
            self._seceded = True

    def resumed(self) -> None:
        if self._seceded:
            self._seceded = False
            distributed.rejoin()  # blocks until the pool has a free slot


def _in_dask_pool() -> bool:
    """Whether this thread is one of a dask worker's pool (a task given to a
    worker's other executors cannot leave or rejoin it)."""
    return getattr(_pool_thread_state, "executor", None) is not None


def _timing(t0: int, value: Any) -> tuple[Any, int, int, int, int, str]:
    worker = distributed.get_worker()
    return value, t0, time.time_ns(), os.getpid(), threading.get_native_id(), worker.name


def run_task(nested: Callable[[], aiopar.Backend], call: Opaque, timed: bool) -> Any:
    """Run a forked call, ``fn(*args, **kwargs)`` for ``call.value`` of
    ``(fn, args, kwargs)``, in a dask worker thread, its forks going to
    ``nested()`` (with wall-clock times if ``timed``). A failure is
    returned, not raised, as a :class:`RemoteFailure`: to dask the task
    succeeded, so its worker logs no "Compute Failed" for a failure that the
    user's code handles (the future reports one nobody retrieves)."""
    t0 = time.time_ns() if timed else 0
    fn, args, kwargs = call.value
    previous = set_waiter(Seceder(is_task=True))
    try:
        with aiopar.use_backend(nested()):
            value = fn(*args, **kwargs)
    except Exception as exc:
        return RemoteFailure(pack(exc))
    finally:
        set_waiter(previous)
    return _timing(t0, value) if timed else value


async def run_task_async(nested: Callable[[], aiopar.Backend], call: Opaque, timed: bool) -> Any:
    """Await a forked coroutine function on the dask worker's event loop; its
    forks and a failure go as :func:`run_task`'s do."""
    t0 = time.time_ns() if timed else 0
    fn, args, kwargs = call.value
    try:
        with aiopar.use_backend(nested()):
            value = await fn(*args, **kwargs)
    except Exception as exc:
        return RemoteFailure(pack(exc))
    return _timing(t0, value) if timed else value


def run_chunk(nested: Callable[[], aiopar.Backend], call: Opaque) -> list[Any]:
    """Run a chunk of ``map``, ``fn(*args)`` for each ``args`` of ``items``
    for ``call.value`` of ``(fn, items)``, in a dask worker thread, as
    :func:`run_task` runs a fork, and return what each gave:
    its value, or its failure as a :class:`RemoteFailure`. A failure fails its
    own item only; a ``BaseException`` (``SystemExit``, say) ends the chunk
    there, and the items after it are not run."""
    fn, items = call.value
    results: list[Any] = []
    previous = set_waiter(Seceder(is_task=True))
    try:
        with aiopar.use_backend(nested()):
            for args in items:
                try:
                    results.append(fn(*args))
                except BaseException as exc:
                    results.append(RemoteFailure(pack(exc)))
                    if not isinstance(exc, Exception):
                        break
    finally:
        set_waiter(previous)
    return results
