"""The table of a recording: per task name, counts, run times, queue delay and time blocked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._recorder import TaskRecord

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["TaskStats", "stats", "stats_table"]


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


def stats(records: Sequence[TaskRecord], sort_by: str) -> list[TaskStats]:
    """Per task name of `records`, sorted as :meth:`aiopar.profiler.Profile.stats` says."""
    if sort_by not in _SORT_KEYS:
        raise ValueError(f"sort_by must be one of {', '.join(_SORT_KEYS)}, got {sort_by!r}")
    groups: dict[str, list[TaskRecord]] = {}
    for record in records:
        groups.setdefault(record.name, []).append(record)
    return sorted((_summarize(n, rs) for n, rs in groups.items()), key=_SORT_KEYS[sort_by])


def stats_table(stats: list[TaskStats], row_limit: int | None, notes: list[str]) -> Table:
    """`stats` (the first `row_limit` of them) as a rich table captioned with `notes`."""
    from rich import box
    from rich.table import Table

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
    notes = [f"{sum(s.count for s in stats)} tasks", *notes]
    if len(shown) < len(stats):
        notes.append(f"{len(stats) - len(shown)} more names not shown")
    table.caption = "; ".join(notes)
    table.caption_justify = "left"
    return table


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


def duration(seconds: float) -> str:
    """``seconds`` in words for a caption: µs, ms or s."""
    if seconds == 0:
        return "0"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.1f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.3f} s"
