"""The parent's handles on the process backend's work: a job (a task on its
way to a worker, already pickled) and a worker process with its socket."""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import socket
import subprocess
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any

from .._fresh import fresh_python
from .._future import Future
from . import _process_wire as wire
from ._base import Task

if TYPE_CHECKING:
    from .process import ProcessBackend

__all__ = ["Job", "Worker", "pidfd_open", "unregister"]


class Job:
    __slots__ = ("forks", "future", "id", "name", "packed", "task")

    def __init__(self, task: Task, packed: wire.Packed, job_id: int) -> None:
        assert task.future is not None  # a task is submitted before it runs
        self.task = task
        self.future: Future[Any] = task.future
        self.name = task.name
        self.packed = packed
        self.id = job_id
        self.forks: Any = None  # for the profiler: what the task forked in its worker
        # The pickle is all that is needed now: let the arguments go even
        # while the future (which refers to the task) is kept, and break the
        # future <-> task cycle so a dropped result is freed at once (its
        # shared memory then goes back to the worker without waiting for gc).
        task.fn = task.args = task.kwargs = None  # type: ignore[assignment]
        task.future = None


class Worker:
    """The parent's handle on one worker process."""

    def __init__(self, backend: ProcessBackend, index: int) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            command = fresh_python(
                "aiopar.backends._process_worker:main", child_end.fileno(), path=backend._path
            )
            self.process = subprocess.Popen(
                command, pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL
            )
        except BaseException:
            parent_end.close()
            raise
        finally:
            child_end.close()
        self.index = index
        self.pid = self.process.pid
        self.ready = False
        self.stopping = False
        self.eof = False  # its socket has been read to the end
        self.inflight: deque[Job] = deque()  # sent, in the order the worker runs them
        self.path_version = backend._path_version  # of the sys.path it has
        self.terminated: str | None = None  # why shutdown terminated it
        self.kill_at = math.inf  # when to kill it if it has not exited by then
        backend_ref = weakref.ref(backend)

        def unmapped(seg_id: int) -> None:
            # May run in any thread, from a garbage-collector finalizer: no locks.
            backend = backend_ref()
            if backend is not None:
                backend._segment_unmapped(self, seg_id)

        self.channel = wire.Channel(parent_end, backend._segments.release, unmapped)
        self.pidfd = pidfd_open(self.pid)

    def __repr__(self) -> str:
        return f"<worker {self.index} pid {self.pid}>"


def pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: the socket's EOF tells instead
        return None


def unregister(selector: selectors.BaseSelector, worker: Worker) -> None:
    for fileobj in (worker.channel, worker.pidfd):
        if fileobj is not None:
            with contextlib.suppress(KeyError, ValueError, OSError):
                selector.unregister(fileobj)
