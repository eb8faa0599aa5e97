"""Accounting for a process worker's exit: what it finished still counts,
what it was running fails, what was queued on it runs elsewhere."""

from __future__ import annotations

import contextlib
import os
import selectors
from typing import TYPE_CHECKING

from .._errors import BrokenWorkerError
from ._process_dispatch import dispatch
from ._process_errors import describe_exit
from ._process_handle import Job, Worker, unregister
from ._process_outcomes import Settle, on_frame

if TYPE_CHECKING:
    from .process import ProcessBackend

__all__ = ["MAX_START_FAILURES", "worker_died"]

# How many workers in a row may die before they are ready until the queued
# tasks are failed instead of starting yet another one.
MAX_START_FAILURES = 3


def worker_died(
    pool: ProcessBackend, worker: Worker, selector: selectors.BaseSelector, settles: list[Settle]
) -> None:
    """Account for a worker's exit, adding the futures to settle to ``settles``."""
    # Results it sent before it died still count.
    with contextlib.suppress(OSError, EOFError):
        worker.channel.sock.setblocking(False)
        while True:
            try:
                frame = worker.channel.recv()
            except BlockingIOError:
                break
            if frame is not None and (settle := on_frame(pool, worker, frame)):
                settles.append(settle)
    returncode = worker.process.wait()
    with pool._lock:
        pool._workers.remove(worker)
        if worker in pool._idle:
            pool._idle.remove(worker)
        inflight = list(worker.inflight)
        worker.inflight.clear()
        running = inflight[0] if inflight else None
        stranded = inflight[1:]  # sent but not started
        if worker.terminated is None:  # run them elsewhere
            for job in reversed(stranded):
                pool._pending.appendleft(job)
                if job.packed.segment is not None:
                    job.packed.segment.owner = None
            stranded = []
        pool._segments.release_owner(worker)
        failed_to_start = not worker.ready and not pool._closed
        doomed: list[Job] = []
        if failed_to_start:
            pool._start_failures += 1
            if pool._start_failures >= MAX_START_FAILURES:
                doomed = list(pool._pending)
                pool._pending.clear()
        dispatch(pool)
    unregister(selector, worker)  # before closing: the numbers may be reused
    worker.channel.close()
    if worker.pidfd is not None:
        os.close(worker.pidfd)
    cause = describe_exit(returncode)

    def lost(job: Job, message: str) -> None:
        job.packed.discard()
        settles.append((job.future, (None, BrokenWorkerError(message))))

    if worker.terminated is not None:
        if running is not None:
            lost(
                running,
                f"the worker process (pid {worker.pid}) running {running.name}() was "
                f"terminated at shutdown: {worker.terminated}. The task's work is lost",
            )
        for job in stranded:
            lost(
                job,
                f"{job.name}() never ran: it was queued on the worker process "
                f"(pid {worker.pid}) that shutdown terminated ({worker.terminated})",
            )
    elif running is not None:
        lost(
            running,
            f"the worker process (pid {worker.pid}) running {running.name}() died: "
            f"{cause}. The task's work is lost; other tasks are unaffected and a new "
            f"worker replaces it",
        )
    for job in doomed:
        lost(
            job,
            f"{MAX_START_FAILURES} worker processes in a row died before they were "
            f"ready (the last one {cause}); their error output is above. "
            f"{job.name}() was never run",
        )
