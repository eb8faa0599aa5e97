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

import gzip
import io
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._chrome_trace import chrome_trace
from ._recorder import Recording, TaskRecord, Worker, clock

__all__ = ["Profile", "TaskRecord", "TaskStats", "Worker", "profile"]


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


class Profile(Recording):
    """A recording of forked tasks; open it with :func:`profile`.

    Reading it (``records``, ``stats()``, ``table()``, the Chrome trace) is
    safe at any time, also while it records; each read is a snapshot.
    """

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
        return chrome_trace(records, waits, self.start_ns, self.end_ns)

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
