"""See where forked tasks ran: a timeline for chrome://tracing or Perfetto, and a table.

```
with aiopar.profiler.profile() as prof:
    ens(x)
prof.export_chrome_trace("trace.json")   # open in https://ui.perfetto.dev
print(prof.table())
```

What a profile records and guarantees:

- **Every task forked on any backend** while it is open: its name, backend,
  the worker that ran it (thread, or worker process), when it was forked,
  started and ended, the task that forked it (the task running in the
  forking thread at that moment, or none), and how long its thread was
  blocked in ``wait``.
- **Every coroutine fork** too (a coroutine function forked onto the
  caller's event loop or aiopar's own loop thread): its record runs from its
  first step to its completion on the loop's thread, with each step (the
  stretch it ran between two awaits) in ``steps``; on the timeline the steps
  are slices on the loop thread's row and its awaits the gaps between them.
- **Process-wide, and into worker processes.** An open profile sees forks
  from every thread of the process, not only the one that opened it,
  because forked work hops threads. A task that runs in a worker process
  reports its own start and end, and every fork made in that worker while
  it runs (tasks, coroutines, nested forks: their records, waits and
  steps), on the worker's own rows and the same clock, as children of the
  task. Those still running when the task returns are counted unfinished.
- **Nesting and overlap are fine.** Every profile open at the moment of a
  fork records that task; an outer profile therefore sees everything an
  inner one does.
- **Late finishers are kept.** A task forked while the profile was open is
  completed in the record whenever it ends, even after the ``with`` block;
  a task still unfinished when you export is left out of the trace and
  counted as unfinished in the table. Wait for your futures inside the block.
- **Off, it costs one attribute check per task** (and per blocking wait);
  a process task costs one more in this process and one in its worker.
  On, a few microseconds per task, and about half a microsecond per step of
  a recorded coroutine.

Times are nanoseconds of :func:`time.perf_counter_ns`, a system-wide clock
(CLOCK_MONOTONIC on Linux), so worker processes on the same machine share it.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import itertools
import json
import logging
import os
import threading
import types
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import sniffio

from . import _trace

__all__ = ["Profile", "TaskRecord", "TaskStats", "Worker", "profile"]

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
        self._remote: tuple[list[TaskRecord], list[_Wait]] | None = None

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

    def _adopt(self, report: Any) -> tuple[list[TaskRecord], list[_Wait]]:
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
            _Wait(workers[row], start, end, record_at(task), record_at(awaited))
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


class _Wait(NamedTuple):
    worker: Worker
    start_ns: int
    end_ns: int
    task: TaskRecord | None  # the task that was blocked, if any
    awaited: TaskRecord | None  # the task it waited for, if recorded


class _Recorder:
    """The one object in ``_trace.active`` while any profile is open."""

    def __init__(self) -> None:
        self.profiles: tuple[Profile, ...] = ()
        self.lock = threading.Lock()

    def open(self, profile: Profile) -> None:
        with self.lock:
            self.profiles = (*self.profiles, profile)
            _trace.active = self

    def close(self, profile: Profile) -> None:
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
        wait = _Wait(_this_worker(), end - blocked, end, task, awaited)
        for profile in self.profiles:
            profile._waits.append(wait)


_recorder = _Recorder()


@dataclass(frozen=True)
class TaskStats:
    """Totals for the finished tasks of one name. Times in seconds."""

    name: str
    backends: tuple[str, ...]
    count: int
    total: float
    mean: float
    max: float
    #: mean and worst time from fork to start
    queue_mean: float
    queue_max: float
    #: time these tasks spent blocked in ``wait``
    blocked: float
    #: forked but not finished (still queued or running, or cancelled)
    unfinished: int = 0
    #: time these coroutines spent suspended at an ``await`` (0 for tasks)
    awaiting: float = 0.0


_SORT_KEYS = {
    "total": lambda s: -s.total,
    "count": lambda s: -s.count,
    "mean": lambda s: -s.mean,
    "max": lambda s: -s.max,
    "queue": lambda s: -s.queue_mean,
    "blocked": lambda s: -s.blocked,
    "awaiting": lambda s: -s.awaiting,
    "name": lambda s: s.name,
}


class Profile:
    """A recording of forked tasks; open it with :func:`profile`.

    Reading it (``records``, ``stats()``, ``table()``, the Chrome trace) is
    safe at any time, also while it records; each read is a snapshot.
    """

    def __init__(self) -> None:
        self._records: list[TaskRecord] = []
        self._waits: list[_Wait] = []
        self._recording = False
        self.start_ns: int | None = None
        self.end_ns: int | None = None

    def __enter__(self) -> Profile:
        if self._recording:
            raise RuntimeError("this profile is already recording; open a new profile() to nest")
        self._recording = True
        if self.start_ns is None:
            self.start_ns = clock()
        self.end_ns = None
        _recorder.open(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _recorder.close(self)
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

    def _snapshot(self) -> tuple[list[TaskRecord], list[_Wait]]:
        records, waits = [], list(self._waits)
        for record in list(self._records):
            records.append(record)
            remote = record._remote
            if remote is not None:
                records += remote[0]
                waits += remote[1]
        return records, waits

    # -- the table -------------------------------------------------------------

    def stats(self, sort_by: str = "total") -> list[TaskStats]:
        """Per task name: count, total, mean and max run time, queue delay, time blocked.

        ``sort_by`` is one of ``total``, ``count``, ``mean``, ``max``,
        ``queue``, ``blocked``, ``awaiting`` (largest first) or ``name``.
        A coroutine's run time counts from its first step to its completion,
        its awaits included; ``awaiting`` is the part spent suspended.
        """
        if sort_by not in _SORT_KEYS:
            raise ValueError(f"sort_by must be one of {', '.join(_SORT_KEYS)}, got {sort_by!r}")
        groups: dict[str, list[TaskRecord]] = {}
        for record in self.records:
            groups.setdefault(record.name, []).append(record)
        stats = [_summarize(name, records) for name, records in groups.items()]
        return sorted(stats, key=_SORT_KEYS[sort_by])

    def rich_table(self, sort_by: str = "total", row_limit: int | None = None) -> Any:
        """The table of :meth:`stats` as a :class:`rich.table.Table`, for ``console.print``.

        "queue" is the mean time from fork to start, "blocked" the time the
        tasks spent blocked in ``wait``, "awaiting" (shown when coroutines
        were recorded) the time coroutines spent suspended at an ``await``.
        """
        from rich import box
        from rich.table import Table

        stats = self.stats(sort_by)
        shown = stats if row_limit is None else stats[:row_limit]
        headers = ["total", "mean", "max", "queue", "queue max", "blocked"]
        times = [[s.total, s.mean, s.max, s.queue_mean, s.queue_max, s.blocked] for s in shown]
        if any(s.awaiting for s in stats):
            headers.append("awaiting")
            for row, s in zip(times, shown, strict=True):
                row.append(s.awaiting)
        unit, scale = _unit(max((max(t) for t in times), default=0.0))
        table = Table(title="aiopar profile", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("task", no_wrap=True)
        table.add_column("backend", no_wrap=True)
        table.add_column("count", justify="right")
        for header in headers:
            table.add_column(f"{header} ({unit})", justify="right")
        unfinished = any(s.unfinished for s in stats)
        if unfinished:
            table.add_column("unfinished", justify="right")
        for s, row_times in zip(shown, times, strict=True):
            cells = [s.name, ",".join(s.backends), str(s.count)]
            cells += [f"{t * scale:.3g}" if t else "0" for t in row_times]
            if unfinished:
                cells.append(str(s.unfinished))
            table.add_row(*cells)
        outside = sum(w.end_ns - w.start_ns for w in self._snapshot()[1] if w.task is None)
        notes = [f"{sum(s.count for s in stats)} tasks"]
        if self.start_ns is not None:
            notes.append(f"over {_fmt(((self.end_ns or clock()) - self.start_ns) / 1e9)}")
        if outside:
            notes.append(f"threads outside tasks blocked in wait for {_fmt(outside / 1e9)}")
        if len(shown) < len(stats):
            notes.append(f"{len(stats) - len(shown)} more names not shown")
        table.caption = "; ".join(notes)
        table.caption_justify = "left"
        return table

    def table(self, sort_by: str = "total", row_limit: int | None = None) -> str:
        """The table of :meth:`stats` as plain text: ``print(prof.table())``."""
        from rich.console import Console

        console = Console(file=io.StringIO(), width=120, color_system=None, force_terminal=False)
        console.print(self.rich_table(sort_by, row_limit))
        text = console.file.getvalue()  # type: ignore[attr-defined]
        return "\n".join(line.rstrip() for line in text.splitlines()) + "\n"

    # -- the timeline ----------------------------------------------------------

    def chrome_trace(self) -> dict[str, Any]:
        """The Trace Event JSON object (as a dict) that :meth:`export_chrome_trace` writes.

        One row per thread, of this process and of each worker process
        (whose main thread is named for the worker): a complete ("X") event per
        finished task, one per step of a finished coroutine (on the row of
        its event loop's thread, named for the loop; its awaits are the gaps
        between its steps), a "wait" event where a thread was blocked in
        ``wait``, a flow arrow ("s" to "f") from each fork to the task's
        (first) start, and process and thread names. Timestamps are
        microseconds since the profile opened.
        """
        records, waits = self._snapshot()
        records = [r for r in records if r.end_ns is not None and r.worker is not None]
        t0 = self.start_ns if self.start_ns is not None else clock()
        t0 = min([t0, *(r.fork_ns for r in records), *(w.start_ns for w in waits)])
        trace = _TraceBuilder(t0)
        for r in records:
            worker, start, end = cast(Worker, r.worker), cast(int, r.start_ns), cast(int, r.end_ns)
            args: dict[str, Any] = {
                "task": r.id,
                "backend": r.backend,
                "parent": None if r.parent is None else r.parent.id,
                "queue_delay_us": _us(start - r.fork_ns),
                "blocked_us": _us(r.blocked_ns),
            }
            if not r.is_coroutine:
                trace.slice(worker, r.name, r.backend, start, end, **args)
                continue
            trace.event_loop(worker, r.backend)
            args["run_us"] = _us(end - start)
            args["awaiting_us"] = _us(r.awaiting_ns)
            steps = r.steps
            for i, (step_start, step_end) in enumerate(steps, 1):
                step = f"{i} of {len(steps)}"
                trace.slice(worker, r.name, "coroutine", step_start, step_end, step=step, **args)
        for w in waits:
            awaited = (
                {} if w.awaited is None else {"waiting_for": f"#{w.awaited.id} {w.awaited.name}"}
            )
            trace.slice(w.worker, "wait", "wait", w.start_ns, w.end_ns, **awaited)
        # A flow's start binds to the slice around it on the forking thread.
        # Forks made outside any task get one "profile" slice per thread to
        # bind to, spanning everything on that row.
        outside_tasks: set[Worker] = set()
        for r in records:
            trace.flow(r.id, r.forker, r.fork_ns, r.worker, r.start_ns)  # type: ignore[arg-type]
            if r.parent is None:
                outside_tasks.add(r.forker)
        for worker in sorted(outside_tasks):
            begin, end = trace.span(worker)
            if self.start_ns is not None:
                begin = min(begin, self.start_ns)
            if self.end_ns is not None:
                end = max(end, self.end_ns)
            trace.slice(
                worker, "profile", "profile", begin, end, note="this thread, outside forked tasks"
            )
        return {
            "traceEvents": trace.events + list(_metadata(trace.row_names())),
            "displayTimeUnit": "ms",
            "otherData": {"generator": "aiopar.profiler", "clock": "time.perf_counter_ns"},
        }

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the timeline as Trace Event JSON.

        Open the file in https://ui.perfetto.dev or chrome://tracing. A path
        ending in ``.gz`` is gzip-compressed (both viewers read it so).
        Raises OSError if the file cannot be written.
        """
        data = json.dumps(self.chrome_trace(), separators=(",", ":")).encode()
        if str(path).endswith(".gz"):
            data = gzip.compress(data)
        Path(path).write_bytes(data)


class _InWorker:
    """In a worker process, while a task runs there that its parent's
    profiler records: every fork made in the process meanwhile, for
    :meth:`TaskRecord.on_remote_forks` in the parent."""

    def __init__(self) -> None:
        self._profile = Profile()
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


class _TraceBuilder:
    """Trace events for one export, with the rows they use and each row's time span."""

    def __init__(self, t0: int) -> None:
        self.t0 = t0
        self.events: list[dict[str, Any]] = []
        self.rows: dict[tuple[int, int], str] = {}
        self.spans: dict[tuple[int, int], list[int]] = {}
        # the kinds of event loop that ran coroutine steps on a row
        self.loops: dict[tuple[int, int], set[str]] = {}

    def _row(self, worker: Worker, *times: int) -> None:
        key = (worker.pid, worker.tid)
        self.rows.setdefault(key, worker.name)
        span = self.spans.setdefault(key, [min(times), max(times)])
        span[0] = min(span[0], *times)
        span[1] = max(span[1], *times)

    def event_loop(self, worker: Worker, library: str) -> None:
        """Name ``worker``'s row for the event loop that ran on it."""
        self.loops.setdefault((worker.pid, worker.tid), set()).add(library)

    def row_names(self) -> dict[tuple[int, int], str]:
        names = dict(self.rows)
        for key, libraries in self.loops.items():
            names[key] = f"{names[key]} ({', '.join(sorted(libraries))} event loop)"
        return names

    def span(self, worker: Worker) -> list[int]:
        return self.spans[(worker.pid, worker.tid)]

    def slice(self, worker: Worker, name: str, cat: str, start: int, end: int, **args: Any) -> None:
        self._row(worker, start, end)
        self.events.append(
            {
                "name": name,
                "cat": cat,
                "ph": "X",
                "ts": _us(start - self.t0),
                "dur": _us(end - start),
                "pid": worker.pid,
                "tid": worker.tid,
                "args": args,
            }
        )

    def flow(self, flow_id: int, source: Worker, at: int, target: Worker, to: int) -> None:
        """An arrow from the slice around ``at`` on ``source`` to the one starting at ``to``."""
        self._row(source, at)
        self._row(target, to)
        common = {"name": "fork", "cat": "fork", "id": flow_id}
        self.events.append(
            {**common, "ph": "s", "ts": _us(at - self.t0), "pid": source.pid, "tid": source.tid}
        )
        self.events.append(
            {
                **common,
                "ph": "f",
                "bp": "e",  # bind to the enclosing slice: the task that starts here
                "ts": _us(to - self.t0),
                "pid": target.pid,
                "tid": target.tid,
            }
        )


def _us(ns: int) -> float:
    return round(ns / 1000, 3)


def profile() -> Profile:
    """A new :class:`Profile`; use it as ``with aiopar.profiler.profile() as prof:``."""
    return Profile()


def _summarize(name: str, records: list[TaskRecord]) -> TaskStats:
    done = [r for r in records if r.end_ns is not None and r.start_ns is not None]
    runs = [(r.end_ns - r.start_ns) / 1e9 for r in done]  # type: ignore[operator]
    queues = [(r.start_ns - r.fork_ns) / 1e9 for r in done]  # type: ignore[operator]
    count = len(done)
    return TaskStats(
        name=name,
        backends=tuple(dict.fromkeys(r.backend for r in records)),
        count=count,
        total=sum(runs),
        mean=sum(runs) / count if count else 0.0,
        max=max(runs, default=0.0),
        queue_mean=sum(queues) / count if count else 0.0,
        queue_max=max(queues, default=0.0),
        blocked=sum(r.blocked_ns for r in done) / 1e9,
        unfinished=len(records) - count,
        awaiting=sum(r.awaiting_ns for r in done) / 1e9,
    )


def _metadata(rows: dict[tuple[int, int], str]) -> Iterable[dict[str, Any]]:
    main_pid = os.getpid()
    main_tid = threading.main_thread().native_id
    for pid in sorted({pid for pid, _ in rows}):
        label = f"aiopar (pid {pid})" if pid == main_pid else f"aiopar worker process (pid {pid})"
        yield {"name": "process_name", "ph": "M", "pid": pid, "tid": 0, "args": {"name": label}}
        yield {
            "name": "process_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"sort_index": 0 if pid == main_pid else pid},
        }
    ordered = sorted(rows, key=lambda key: (key[1] != main_tid, rows[key], key))
    # Thread names need not be unique (a pool may reuse a retired worker's
    # name); two rows with one label would look like one thread.
    seen: dict[tuple[int, str], int] = {}
    for pid, tid in ordered:
        seen[(pid, rows[(pid, tid)])] = seen.get((pid, rows[(pid, tid)]), 0) + 1
    for index, (pid, tid) in enumerate(ordered):
        name = rows[(pid, tid)]
        if seen[(pid, name)] > 1:
            name = f"{name} (tid {tid})"
        yield {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
        yield {
            "name": "thread_sort_index",
            "ph": "M",
            "pid": pid,
            "tid": tid,
            "args": {"sort_index": index},
        }


def _unit(seconds: float) -> tuple[str, float]:
    """A unit that shows ``seconds`` in at most four digits, and its scale from seconds."""
    if seconds < 1e-3:
        return "µs", 1e6
    if seconds < 1:
        return "ms", 1e3
    return "s", 1.0


def _fmt(seconds: float) -> str:
    if seconds == 0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"
