"""The parent's handles on the process backend's work: a job (a task on its
way to a worker, already pickled) and a worker process with its socket."""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import math
import multiprocessing
import multiprocessing.reduction
import os
import pickle
import selectors
import signal
import socket
import subprocess
import tempfile
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing import context, resource_sharer
from typing import IO, Any

import cloudpickle

from .._fresh import fresh_python
from .._future import Future, claim
from .._shm import SegmentPool
from . import _process_wire as wire
from ._base import Task
from ._process_pickle import Packed

__all__ = ["INITIALIZER_FAILED", "Job", "Worker", "check_setup", "describe_exit"]

#: what a worker runs the forks made by its tasks on: never processes of its own
NESTED_BACKEND = "thread"

#: the exit code of a worker whose initializer raised (see _process_worker)
INITIALIZER_FAILED = 3

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
                self.skip = [i for i, item in enumerate(self.items) if not claim(item)]
            return True
        if self.future.running():
            return True
        self.packed.discard()
        return False


class Inflight(deque[Job]):
    """The jobs sent to a worker, in the order it runs them, counting the
    bytes of those behind the first: sent ahead, they wait in its socket's
    buffer, which a send must never overfill. Kept as the jobs come and go
    (the pool's prefetch asks on every hand-over), so only the methods the
    pool uses are here, and each keeps the count."""

    def __init__(self) -> None:
        super().__init__()
        self._bytes = 0  # of every job in it

    @property
    def queued_bytes(self) -> int:
        """The bytes of the jobs behind the first."""
        return self._bytes - len(self[0].packed.payload) if self else 0

    def append(self, job: Job) -> None:
        deque.append(self, job)
        self._bytes += len(job.packed.payload)

    def popleft(self) -> Job:
        job = deque.popleft(self)
        self._bytes -= len(job.packed.payload)
        return job

    def remove(self, job: Job) -> None:
        deque.remove(self, job)
        self._bytes -= len(job.packed.payload)

    def clear(self) -> None:
        deque.clear(self)
        self._bytes = 0


class Worker:
    """The parent's handle on one worker process.

    ``path`` is the ``sys.path`` it starts with (``path_version`` counts the
    changes the pool saw); ``segments`` is where the segments it reports
    released go back to; ``on_unmapped(worker, seg_id)`` is called, from any
    thread, once this process no longer maps a segment the worker sent.

    The worker shares this process's ``multiprocessing`` authkey, as
    multiprocessing's own children do, so the proxies of a
    ``multiprocessing.Manager()`` work in its tasks. It calls
    ``initializer(*initargs)``, if given, before it says it is ready; if
    that raises, it exits with :data:`INITIALIZER_FAILED`.
    """

    def __init__(
        self,
        index: int,
        path: list[str],
        path_version: int,
        segments: SegmentPool,
        on_unmapped: Callable[[Worker, int], None],
        *,
        initializer: Callable[..., object] | None = None,
        initargs: tuple[Any, ...] = (),
    ) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with _setup_file(initializer, initargs) as setup:
                command = fresh_python(
                    "aiopar.backends._process_worker:main",
                    child_end.fileno(),
                    NESTED_BACKEND,
                    setup.fileno(),
                    path=path,
                )
                self.process = subprocess.Popen(
                    command,
                    pass_fds=[child_end.fileno(), setup.fileno()],
                    stdin=subprocess.DEVNULL,
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
        self.inflight = Inflight()
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


def check_setup(initializer: Callable[..., object] | None, initargs: tuple[Any, ...]) -> None:
    """Raise TypeError unless ``initializer(*initargs)`` can reach a worker."""
    try:
        _pack_setup(initializer, initargs, share=False)
    except Exception as exc:
        raise TypeError(
            f"cannot send the initializer {initializer!r:.60} and its initargs to a worker "
            f"process ({type(exc).__name__}: {exc}): they must pickle (cloudpickle), or be "
            f"multiprocessing's locks, queues and proxies of a 'spawn' or 'forkserver' context"
        ) from exc


@contextlib.contextmanager
def _setup_file(
    initializer: Callable[..., object] | None, initargs: tuple[Any, ...]
) -> Iterator[IO[bytes]]:
    """A file that a new worker reads as it starts: this process's authkey,
    then its initializer and arguments (pickled apart, so the worker has the
    authkey before it unpickles them)."""
    call = None if initializer is None else _pack_setup(initializer, initargs, share=True)
    with tempfile.TemporaryFile() as setup:  # unnamed: nothing is left behind
        pickle.dump((bytes(multiprocessing.current_process().authkey), call), setup)
        setup.seek(0)
        yield setup


def _pack_setup(initializer: object, initargs: tuple[Any, ...], *, share: bool) -> bytes:
    """The pickle of ``(initializer, initargs)``; unless ``share``, the file
    descriptors in it are not offered to any process (a trial)."""
    buffer = io.BytesIO()
    # multiprocessing asks a spawning popen only for what _SpawningWorker has.
    context.set_spawning_popen(_SpawningWorker(share))  # type: ignore[arg-type]
    try:
        _SetupPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((initializer, tuple(initargs)))
    finally:
        context.set_spawning_popen(None)
    return buffer.getvalue()


class _SetupPickler(cloudpickle.Pickler):  # type: ignore[misc]  # cloudpickle is untyped
    """cloudpickle, with the reducers multiprocessing registers for its own
    pickler (of pipes, queues, locks), which plain pickling lacks."""

    @property
    def dispatch_table(self) -> collections.ChainMap[Any, Any]:
        # Read as the pickler is made: reducers registered since count too.
        forking = multiprocessing.reduction.ForkingPickler(io.BytesIO()).dispatch_table
        return collections.ChainMap(cloudpickle.Pickler.dispatch_table, forking)


class _SpawningWorker:
    """What multiprocessing's objects ask of a process being started when
    they are pickled for it (the way ``initargs`` reach ProcessPoolExecutor's
    workers): a queue's or a pipe's file descriptors travel through
    multiprocessing's resource sharer, which the worker, sharing this
    process's authkey, may fetch them from (unless ``share`` is false). Its
    locks and semaphores travel by name, as they do to a "spawn" child."""

    def __init__(self, share: bool) -> None:
        self.share = share

    def duplicate_for_child(self, fd: int) -> int:
        return fd

    def DupFd(self, fd: int) -> Any:
        return resource_sharer.DupFd(fd) if self.share else fd


def _pidfd_open(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: the socket's EOF tells instead
        return None


def describe_exit(returncode: int) -> str:
    """How a worker exited, in words (with the usual cause of a signal, or
    of the code a failing initializer exits with)."""
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
    if returncode == INITIALIZER_FAILED:
        return f"it exited with code {returncode}, as a worker does whose initializer raised"
    return f"it exited with code {returncode}"
