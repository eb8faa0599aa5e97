"""The recorder: what a profile records, and how.

The backends and the core reach it only through :mod:`aiopar._trace`
(``_trace.active`` is the one :data:`recorder` while any recording is open);
the profile (:class:`aiopar.profiler.Profile`) builds its reports, the table
and the Chrome trace, on top of a :class:`Recording`. :class:`WorkerCapture`
records, in a worker process, what a task forked there, for its record in
the parent; loading this module registers it with ``_trace`` for that.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import types
from collections.abc import Callable, Generator
from typing import Any, NamedTuple, Self

import sniffio

from .. import _trace

__all__ = ["Recording", "TaskRecord", "Wait", "Worker", "WorkerCapture", "clock", "recorder"]

clock = _trace.clock
_logger = logging.getLogger("aiopar")


class Worker(NamedTuple):
    """A row of the timeline: a thread of a process."""

    pid: int
    tid: int
    name: str


_local = threading.local()  # .worker: this thread's Worker; .record: the task it runs
_ids = itertools.count(1)


def _this_worker() -> Worker:
    worker = getattr(_local, "worker", None)
    if worker is None:
        thread = threading.current_thread()
        worker = _local.worker = Worker(os.getpid(), threading.get_native_id(), thread.name)
    return worker


def _loop_library() -> str:
    """The kind of event loop running in this thread: asyncio, uvloop or trio."""
    loop = asyncio._get_running_loop()
    if loop is not None:
        return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
    return sniffio.thread_local.name or "event loop"


def _forget_threads_in_child() -> None:
    global _local
    _local = threading.local()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_threads_in_child)


class TaskRecord:
    """What one forked task did. Times are ``perf_counter_ns`` values; ``None`` until known.

    For a coroutine fork, ``backend`` is the kind of event loop that ran it
    (``"asyncio"``, ``"uvloop"`` or ``"trio"``), ``worker`` the loop's thread,
    ``start_ns`` and ``end_ns`` its first step's start and last step's end,
    and :attr:`steps` the stretches it ran between awaits.
    """

    __slots__ = (
        "_outer",
        "_remote",
        "_steps",
        "backend",
        "blocked_ns",
        "end_ns",
        "fork_ns",
        "forker",
        "id",
        "name",
        "parent",
        "start_ns",
        "worker",
    )

    def __init__(self, name: str, backend: str, parent: TaskRecord | None) -> None:
        #: unique within the process
        self.id: int = next(_ids)
        self.name = name
        self.backend = backend
        #: the task that was running in the thread that forked this one
        self.parent = parent
        #: the thread that called fork
        self.forker: Worker = _this_worker()
        #: the thread (or worker process) that ran the task
        self.worker: Worker | None = None
        self.fork_ns: int = clock()
        self.start_ns: int | None = None
        self.end_ns: int | None = None
        #: time the running task spent blocked in ``wait``
        self.blocked_ns: int = 0
        self._outer: TaskRecord | None = None
        # A coroutine's step times, start and end alternating; None for a task.
        self._steps: list[int] | None = None
        # For a task that ran in a worker process: the records and waits of
        # what it forked there.
        self._remote: tuple[list[TaskRecord], list[Wait]] | None = None

    # -- the hooks (see aiopar._trace) ---------------------------------------

    def on_start(self) -> None:
        local = _local
        self._outer = getattr(local, "record", None)
        local.record = self
        self.worker = getattr(local, "worker", None) or _this_worker()
        self.start_ns = clock()

    def on_end(self) -> None:
        self.end_ns = clock()
        _local.record = self._outer
        self._outer = None

    def on_remote_run(
        self,
        start_ns: int,
        end_ns: int,
        pid: int,
        tid: int | None = None,
        thread_name: str | None = None,
    ) -> None:
        self.worker = Worker(pid, pid if tid is None else tid, thread_name or f"worker {pid}")
        self.start_ns = start_ns
        self.end_ns = end_ns

    def on_remote_forks(self, report: Any) -> None:
        """Adopt what this task forked in its worker process (``report`` is
        what :meth:`_InWorker.report` made there), after :meth:`on_remote_run`.
        Never raises: it runs in the thread that reads the workers' results."""
        try:
            self._remote = self._adopt(report)
        except Exception:
            _logger.exception("aiopar.profiler: could not read what %r forked in its worker", self)

    def _adopt(self, report: Any) -> tuple[list[TaskRecord], list[Wait]]:
        blocked_ns, rows, records, waits = report
        home = self.worker  # the worker's main thread, named as this process names it
        workers = [
            home
            if home is not None and (pid, tid) == (home.pid, home.tid)
            else Worker(pid, tid, name)
            for pid, tid, name in rows
        ]
        made = [self]  # index 0 stands for this task, i + 1 for the report's record i
        for name, backend, parent, forker, worker, fork_ns, start, end, blocked, steps in records:
            record = TaskRecord(name, backend, None if parent is None else made[parent])
            record.forker = workers[forker]
            record.worker = None if worker < 0 else workers[worker]
            record.fork_ns, record.start_ns, record.end_ns = fork_ns, start, end
            record.blocked_ns, record._steps = blocked, steps
            made.append(record)

        def record_at(i: int | None) -> TaskRecord | None:
            return None if i is None else made[i]

        self.blocked_ns += blocked_ns
        return made[1:], [
            Wait(workers[row], start, end, record_at(task), record_at(awaited))
            for row, start, end, task, awaited in waits
        ]

    def run_in_steps(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """``await fn(*args, **kwargs)``, timing each step of it for this record."""
        return _run_in_steps(self, fn, args, kwargs)

    def _resume(self) -> None:
        """A step of the coroutine begins in this thread."""
        now = clock()
        if self.start_ns is None:
            self.start_ns = now
            self.worker = _this_worker()
            self.backend = _loop_library()
        local = _local
        self._outer = getattr(local, "record", None)
        local.record = self  # what it forks and waits for counts as its own
        self._steps.append(now)  # type: ignore[union-attr]

    def _suspend(self, *, last: bool = False) -> None:
        """The step that began last ends; with ``last``, so does the coroutine."""
        now = clock()
        self._steps.append(now)  # type: ignore[union-attr]
        _local.record = self._outer
        self._outer = None
        if last:
            self.end_ns = now

    # -- derived ---------------------------------------------------------------

    @property
    def is_coroutine(self) -> bool:
        """Whether this is a coroutine fork, run on an event loop."""
        return self._steps is not None

    @property
    def steps(self) -> list[tuple[int, int]]:
        """For a coroutine, ``(start_ns, end_ns)`` of each step it has run
        (the stretches between its awaits), in order; empty for a task."""
        times = self._steps or []
        return list(zip(times[::2], times[1::2], strict=False))

    @property
    def awaiting_ns(self) -> int:
        """For a finished coroutine, the time it was suspended at an ``await``
        between its first step and its completion; 0 otherwise."""
        if self._steps is None or self.duration_ns is None:
            return 0
        return self.duration_ns - sum(end - start for start, end in self.steps)

    @property
    def finished(self) -> bool:
        return self.end_ns is not None

    @property
    def duration_ns(self) -> int | None:
        """Run time, from start to end."""
        if self.start_ns is None or self.end_ns is None:
            return None
        return self.end_ns - self.start_ns

    @property
    def queue_delay_ns(self) -> int | None:
        """Time from fork to start: how long the task waited for a worker."""
        return None if self.start_ns is None else self.start_ns - self.fork_ns

    def __repr__(self) -> str:
        state = "finished" if self.finished else "started" if self.start_ns else "not started"
        return f"<TaskRecord #{self.id} {self.name!r} on {self.backend!r} {state}>"


@types.coroutine
def _run_in_steps(
    record: TaskRecord, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Generator[Any, Any, Any]:
    """``await fn(*args, **kwargs)`` as ``yield from`` does it (PEP 380), with
    the record told when each step of the awaitable begins and ends."""
    record._resume()
    try:
        inner = fn(*args, **kwargs).__await__()
        try:
            yielded = next(inner)
            while True:
                record._suspend()
                try:
                    sent = yield yielded
                except GeneratorExit:
                    record._resume()
                    close = getattr(inner, "close", None)
                    if close is not None:
                        close()
                    raise
                except BaseException as exc:
                    record._resume()
                    throw = getattr(inner, "throw", None)
                    if throw is None:
                        raise
                    yielded = throw(exc)
                else:
                    record._resume()
                    yielded = next(inner) if sent is None else inner.send(sent)
        except StopIteration as stop:
            return stop.value
    finally:
        record._suspend(last=True)


class Wait(NamedTuple):
    worker: Worker
    start_ns: int
    end_ns: int
    task: TaskRecord | None  # the task that was blocked, if any
    awaited: TaskRecord | None  # the task it waited for, if recorded


class _Recorder:
    """The one object in ``_trace.active`` while any recording is open."""

    def __init__(self) -> None:
        self.profiles: tuple[Recording, ...] = ()
        self.lock = threading.Lock()

    def open(self, profile: Recording) -> None:
        with self.lock:
            self.profiles = (*self.profiles, profile)
            _trace.active = self

    def close(self, profile: Recording) -> None:
        with self.lock:
            self.profiles = tuple(p for p in self.profiles if p is not profile)
            if not self.profiles:
                _trace.active = None

    def on_fork(self, task: Any) -> TaskRecord:
        return self._add(TaskRecord(task.name, task.backend.name, getattr(_local, "record", None)))

    def on_fork_coroutine(self, fn: Callable[..., Any]) -> TaskRecord:
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        # The loop's kind is known at its first step; until then, this.
        record = TaskRecord(name, "event loop", getattr(_local, "record", None))
        record._steps = []
        return self._add(record)

    def _add(self, record: TaskRecord) -> TaskRecord:
        for profile in self.profiles:
            profile._records.append(record)
        return record

    def on_blocked(self, seconds: float, awaited_task: Any) -> None:
        end = clock()
        task = getattr(_local, "record", None)
        blocked = int(seconds * 1e9)
        if task is not None:
            task.blocked_ns += blocked
        awaited = getattr(awaited_task, "record", None)
        wait = Wait(_this_worker(), end - blocked, end, task, awaited)
        for profile in self.profiles:
            profile._waits.append(wait)


recorder = _Recorder()


class Recording:
    """Every task forked, and every wait, while it is open (``with``); see
    :class:`aiopar.profiler.Profile`, which reports on one."""

    def __init__(self) -> None:
        self._records: list[TaskRecord] = []
        self._waits: list[Wait] = []
        self._recording = False
        self.start_ns: int | None = None
        self.end_ns: int | None = None

    def __enter__(self) -> Self:
        if self._recording:
            raise RuntimeError("this profile is already recording; open a new profile() to nest")
        self._recording = True
        if self.start_ns is None:
            self.start_ns = clock()
        self.end_ns = None
        recorder.open(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        recorder.close(self)
        self._recording = False
        self.end_ns = clock()

    @property
    def recording(self) -> bool:
        return self._recording

    @property
    def records(self) -> list[TaskRecord]:
        """Every task forked while the profile was open, in fork order, each
        process task followed by what it forked in its worker process."""
        return self._snapshot()[0]

    def _snapshot(self) -> tuple[list[TaskRecord], list[Wait]]:
        records, waits = [], list(self._waits)
        for record in list(self._records):
            records.append(record)
            remote = record._remote
            if remote is not None:
                records += remote[0]
                waits += remote[1]
        return records, waits


class WorkerCapture:
    """In a worker process, while a task runs there that its parent's
    profiler records: every fork made in the process meanwhile, for
    :meth:`TaskRecord.on_remote_forks` in the parent."""

    def __init__(self) -> None:
        self._profile = Recording()
        self._profile.__enter__()
        # Stands for the task (its record is the parent's): what this thread
        # forks while the task runs are its children.
        self._task = TaskRecord("", "process", None)
        self._task.on_start()

    def report(self) -> tuple[int, list[Any], list[Any], list[Any]] | None:
        """Stop recording; what was recorded, as plain data, or None if nothing was."""
        self._task.on_end()
        self._profile.__exit__()
        records, waits = self._profile._records, self._profile._waits
        if not records and not waits:
            return None
        rows: dict[Worker, int] = {}

        def row(worker: Worker) -> int:
            return rows.setdefault(worker, len(rows))

        # 0 is the task, i + 1 the i-th record; None: no task, or one
        # forked before this task ran.
        index: dict[TaskRecord | None, int] = {
            record: i for i, record in enumerate([self._task, *records])
        }
        forks = [
            (
                r.name,
                r.backend,
                index.get(r.parent),
                row(r.forker),
                -1 if r.worker is None else row(r.worker),
                r.fork_ns,
                r.start_ns,
                r.end_ns,
                r.blocked_ns,
                None if r._steps is None else list(r._steps),
            )
            for r in records
        ]
        blocked = [
            (row(w.worker), w.start_ns, w.end_ns, index.get(w.task), index.get(w.awaited))
            for w in waits
        ]
        # rows last: row() fills it while the lists above are made
        return self._task.blocked_ns, [tuple(worker) for worker in rows], forks, blocked


_trace.worker_capture = WorkerCapture
