"""A profile: a recording of forked tasks, and its reports (the table, the Chrome trace)."""

from __future__ import annotations

import gzip
import io
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._chrome_trace import chrome_trace
from ._recorder import Recording, clock
from ._table import TaskStats, duration, stats, stats_table

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["Profile", "profile"]


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
        return stats(self.records, sort_by)

    def rich_table(self, sort_by: str = "total", row_limit: int | None = None) -> Table:
        """The table of :meth:`stats` as a :class:`rich.table.Table`, for ``console.print``.

        "queue" is the mean time from fork to start, "blocked" the time the
        tasks spent blocked in ``wait``, "awaiting" (shown when coroutines
        were recorded) the time coroutines spent suspended at an ``await``.
        """
        records, waits = self._snapshot()
        notes = []
        if self.start_ns is not None:
            notes.append(f"over {duration(((self.end_ns or clock()) - self.start_ns) / 1e9)}")
        outside = sum(w.end_ns - w.start_ns for w in waits if w.task is None)
        if outside:
            notes.append(f"threads outside tasks blocked in wait for {duration(outside / 1e9)}")
        return stats_table(stats(records, sort_by), row_limit, notes)

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
