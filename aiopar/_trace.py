"""The seam between the task machinery and the recorder of :mod:`aiopar.profiler`.

``active`` is ``None`` unless a profiler is recording; every hook site checks
that one attribute and does nothing else when it is ``None``, so tracing off
costs one check per task (or coroutine fork). A recorder implements:

``on_fork(task) -> record | None``
    called in the forking thread; the returned record is stored on the task.
``record.on_start()`` / ``record.on_end()``
    called by the thread that runs the task, around the call.
``record.on_remote_run(start_ns, end_ns, pid, tid=None, thread_name=None)``
    called instead of ``on_start``/``on_end`` (in any thread of the forking
    process) by a backend whose task ran in another process, once that
    worker reported when it ran the task; the times are read with
    :func:`clock` in the worker.
``record.on_remote_forks(report)``
    called right after ``on_remote_run`` when the task forked work in its
    worker process. A backend asks its worker for that only for a task
    with a record; there, :func:`capture_forks` starts recording before the
    task runs and its ``report()`` (plain data, or None when nothing was
    forked) stops after it. The recorder registers what
    :func:`capture_forks` makes (``worker_capture``) when it loads, which
    ``import aiopar`` does in every process: this module imports nothing.
``on_fork_coroutine(fn) -> record``
    called in the forking thread when a coroutine function is forked onto an
    event loop; the runner then awaits ``record.run_in_steps(fn, args,
    kwargs)`` instead of ``fn(*args, **kwargs)``, which tells the record
    when each step of the coroutine begins and ends.
``on_blocked(seconds, task)``
    called by a thread after it was blocked for that long in ``wait`` on the
    future of ``task`` (``None`` for a future no task settles).

Every timestamp is :func:`clock`: ``time.perf_counter_ns``, which is
system-wide (CLOCK_MONOTONIC on Linux, QueryPerformanceCounter on Windows,
mach_absolute_time on macOS), so times read in worker processes on the same
machine line up with the parent's.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

active: Any = None

#: nanoseconds on the clock every trace timestamp uses, in every process
clock = time.perf_counter_ns

#: set by the recorder when it loads: starts a capture for :func:`capture_forks`
worker_capture: Callable[[], Any] | None = None


def capture_forks() -> Any:
    """In a worker process, for a task its parent's profiler records: start
    recording every fork made in this process; ``.report()`` stops and
    returns what was recorded, as plain data (None if nothing was).
    None if no recorder has registered."""
    return None if worker_capture is None else worker_capture()
