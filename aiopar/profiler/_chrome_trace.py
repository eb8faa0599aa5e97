"""The Chrome trace (Trace Event JSON) of a recording: the timeline report of
:meth:`aiopar.profiler.Profile.chrome_trace`."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import Any, cast

from ._recorder import TaskRecord, Wait, Worker, clock

__all__ = ["chrome_trace"]


def chrome_trace(
    records: list[TaskRecord], waits: list[Wait], start_ns: int | None, end_ns: int | None
) -> dict[str, Any]:
    """The Trace Event JSON object of ``records`` and ``waits``, recorded from
    ``start_ns`` to ``end_ns`` (None: not known, or still recording); see
    :meth:`aiopar.profiler.Profile.chrome_trace` for what it holds."""
    records = [r for r in records if r.end_ns is not None and r.worker is not None]
    t0 = start_ns if start_ns is not None else clock()
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
        awaited = {} if w.awaited is None else {"waiting_for": f"#{w.awaited.id} {w.awaited.name}"}
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
        if start_ns is not None:
            begin = min(begin, start_ns)
        if end_ns is not None:
            end = max(end, end_ns)
        trace.slice(
            worker, "profile", "profile", begin, end, note="this thread, outside forked tasks"
        )
    return {
        "traceEvents": trace.events + list(_metadata(trace.row_names())),
        "displayTimeUnit": "ms",
        "otherData": {"generator": "aiopar.profiler", "clock": "time.perf_counter_ns"},
    }


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
