"""The parent's handles on the process backend's work: a job (a task on its
way to a worker, already pickled) and a worker process with its socket."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import selectors
import signal
import socket
import subprocess
from collections import deque
from collections.abc import Callable
from typing import Any

from .._fresh import fresh_python
from .._future import Future
from .._shm import SegmentPool
from . import _process_wire as wire
from ._base import Task
from ._process_pickle import Packed

__all__ = ["Job", "Worker", "describe_exit"]

#: what a worker runs the forks made by its tasks on: never processes of its own
NESTED_BACKEND = "thread"

_job_ids = itertools.count(1)


class Job:
    """A task on its way to a worker, already pickled: one call (a TASK
    frame), or a chunk of :meth:`~aiopar.backends.Backend.map` (a CHUNK
    frame) whose ``items`` are the futures of its calls."""

    __slots__ = (
        "forks",
        "future",
        "id",
        "items",
        "kind",
        "name",
        "packed",
        "record",
        "skip",
        "task",
    )

    def __init__(self, task: Task, packed: Packed, items: list[Future[Any]] | None = None) -> None:
        assert task.future is not None  # a task is submitted before it runs
        self.task: Task | None = task  # until it is claimed
        self.future: Future[Any] = task.future
        self.name = task.name
        self.record = task.record  # the profiler's, or None
        self.packed = packed
        self.id = next(_job_ids)
        self.forks: Any = None  # for the profiler: what the task forked in its worker
        self.kind = wire.TASK if items is None else wire.CHUNK
        self.items = items
        self.skip: list[int] = []  # calls of a chunk not to make (cancelled)
        # The pickle is all that is needed now: let the arguments go even
        # while the future (which refers to the task) is kept.
        task.fn = task.args = task.kwargs = None  # type: ignore[assignment]

    def claim(self) -> bool:
        """Whether the job is to be sent: its task just started, or it was
        sent before to a worker that died before it began. False if it was
        cancelled, and then its pickle is let go."""
        task, self.task = self.task, None
        if task is not None and task.claim() is not None:
            if self.items is not None:
                # An item whose future was cancelled (or settled by hand) is not called.
                self.skip = [i for i, item in enumerate(self.items) if not item._claim()]
            return True
        if self.future.running():
            return True
        self.packed.discard()
        return False


class Worker:
    """The parent's handle on one worker process.

    ``path`` is the ``sys.path`` it starts with (``path_version`` counts the
    changes the pool saw); ``segments`` is where the segments it reports
    released go back to; ``on_unmapped(worker, seg_id)`` is called, from any
    thread, once this process no longer maps a segment the worker sent.
    """

    def __init__(
        self,
        index: int,
        path: list[str],
        path_version: int,
        segments: SegmentPool,
        on_unmapped: Callable[[Worker, int], None],
    ) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            command = fresh_python(
                "aiopar.backends._process_worker:main",
                child_end.fileno(),
                NESTED_BACKEND,
                path=path,
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
        self.path_version = path_version  # of the sys.path it has
        self.terminated: str | None = None  # why shutdown terminated it
        self.kill_at = math.inf  # when to kill it if it has not exited by then
        self.channel = wire.Channel(
            parent_end, segments.release, lambda seg_id: on_unmapped(self, seg_id)
        )
        self.pidfd = _pidfd_open(self.pid)

    def unregister(self, selector: selectors.BaseSelector) -> None:
        """Take its socket and pidfd off ``selector``, if they are on it."""
        for fileobj in (self.channel, self.pidfd):
            if fileobj is not None:
                with contextlib.suppress(KeyError, ValueError, OSError):
                    selector.unregister(fileobj)

    def close(self) -> None:
        """Close its socket (the worker exits when it reads the end) and pidfd."""
        self.channel.close()
        if self.pidfd is not None:
            os.close(self.pidfd)

    def __repr__(self) -> str:
        return f"<worker {self.index} pid {self.pid}>"


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: the socket's EOF tells instead
        return None


def describe_exit(returncode: int) -> str:
    """How a worker exited, in words (with the usual cause of a signal)."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = {
            "SIGKILL": " (the out-of-memory killer, or someone, killed it)",
            "SIGSEGV": " (a segmentation fault, usually in a C extension)",
        }.get(name, "")
        return f"it was killed by {name}{hint}"
    return f"it exited with code {returncode}"
