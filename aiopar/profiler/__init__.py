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

from ._profile import Profile, profile
from ._recorder import TaskRecord, Worker
from ._table import TaskStats

__all__ = ["Profile", "TaskRecord", "TaskStats", "Worker", "profile"]
