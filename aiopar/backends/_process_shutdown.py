"""Stopping the process backend: closing it, the bounded wait (``grace``),
stopping workers, interpreter exit, and starting afresh after os.fork()."""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import TYPE_CHECKING

from .. import _interrupt
from .._errors import BrokenWorkerError
from ._process_handle import Job
from ._process_outcomes import Settle, settle

if TYPE_CHECKING:
    from .process import ProcessBackend

__all__ = ["GRACE", "join", "live", "stop"]

_logger = logging.getLogger("aiopar")

# The default grace period of a bounded shutdown (see ProcessBackend).
GRACE = 5.0
# How long shutdown waits for an idle worker to exit before killing it.
STOP_TIMEOUT = 10.0
# How long a terminated worker has to exit before it is killed.
KILL_AFTER = 1.0

#: every process backend of this process, for interpreter exit and os.fork()
live: weakref.WeakSet[ProcessBackend] = weakref.WeakSet()
# Handles on workers that a process inherited through os.fork(): they are
# the parent's children, never to be waited for here.
inherited: list[subprocess.Popen[bytes]] = []


def stop(
    pool: ProcessBackend, cancel_pending: bool, why: str | None, *, renew: bool = False
) -> None:
    """Close; with ``why``, terminate what still runs ``grace`` seconds
    from now (``renew``: from the last task that finished)."""
    with pool._lock:
        pool._closed = True
        queued: list[Job] = []
        if cancel_pending:
            queued = list(pool._pending)
            pool._pending.clear()
        if why is not None and pool._grace is not None and pool._deadline is None:
            pool._deadline = time.monotonic() + pool._grace
            pool._renew = renew
            pool._why_terminated = why
        manager = pool._manager
    started = []
    for job in queued:
        if job.future.cancel():
            job.packed.discard()
        else:
            started.append(job)  # resent after its worker died: it runs
    if started:
        with pool._lock:
            pool._pending.extendleft(reversed(started))
    if manager is None:
        pool._segments.close()
    else:
        pool._wake()


def join(pool: ProcessBackend, timeout: float | None = None) -> bool:
    """Wait for the manager to finish; False if ``timeout`` passed first."""
    end = None if timeout is None else time.monotonic() + timeout
    manager = pool._manager
    # A blocked callback may hand the manager's job to a new thread.
    while manager is not None and manager is not threading.current_thread():
        _interrupt.join(manager, None if end is None else max(0.0, end - time.monotonic()))
        if manager.is_alive():
            return False
        if manager is pool._manager:
            break
        manager = pool._manager
    return True


def enforce_deadline(pool: ProcessBackend, settles: list[Settle]) -> float | None:
    """Once shutdown's deadline has passed, terminate the workers still
    running a task (kill them a second later) and drop the queue, adding
    the futures to ``settles``; return how long the manager may sleep
    (None: until something happens)."""
    if pool._deadline is None:
        return None
    now = time.monotonic()
    due = now >= pool._deadline
    wake_at = math.inf if due else pool._deadline
    why = pool._why_terminated
    terminating = []
    with pool._lock:
        if due:
            for job in pool._pending:
                job.packed.discard()
                if job.future.running():  # resent after its worker died: too late to cancel
                    message = f"{job.name}() never ran: the pool was stopped ({why})"
                    settles.append((job.future, (None, BrokenWorkerError(message))))
                else:
                    settles.append((job.future, None))
            pool._pending.clear()
        for worker in pool._workers:
            if worker.terminated is None:
                if not due or not worker.inflight:
                    continue
                terminating.append((worker, worker.inflight[0].name))
                worker.terminated = why
                worker.kill_at = now + KILL_AFTER
                worker.process.terminate()
            elif now >= worker.kill_at:
                worker.kill_at = math.inf
                worker.process.kill()
            wake_at = min(wake_at, worker.kill_at)
    for worker, name in terminating:
        _logger.warning(
            "%r: terminating %r, which is still running %s(): %s "
            "(ProcessBackend(grace=...) sets how long a shutdown waits)",
            pool,
            worker,
            name,
            why,
        )
    return None if wake_at == math.inf else wake_at - now


def busy(pool: ProcessBackend) -> bool:
    return any(worker.inflight for worker in pool._workers)


def stop_workers(pool: ProcessBackend) -> None:
    with pool._lock:
        workers = list(pool._workers)
        pool._workers.clear()
        pool._idle.clear()
    for worker in workers:
        worker.channel.close()  # EOF tells the worker to exit
    for worker in workers:
        try:
            worker.process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            _logger.warning("%r did not exit %s s after shutdown; killing it", worker, STOP_TIMEOUT)
            worker.process.kill()
            worker.process.wait()
        if worker.pidfd is not None:
            os.close(worker.pidfd)


def fail_everything(pool: ProcessBackend) -> None:
    with pool._lock:
        pool._closed = True  # later forks raise instead of waiting for ever
        jobs = list(pool._pending)
        pool._pending.clear()
        for worker in pool._workers:
            jobs.extend(worker.inflight)
            worker.inflight.clear()
    for job in jobs:
        error = BrokenWorkerError(f"{pool!r} failed internally; see the 'aiopar' log")
        settle(job.future, (None, error))
    with contextlib.suppress(Exception):
        stop_workers(pool)


def after_fork(pool: ProcessBackend) -> None:
    """Start afresh in a child made by os.fork(): only the forking thread
    lives on, so the manager is gone, a lock may be held for ever, and
    the workers are the parent's (the child must not hold their sockets
    open, or they would not see the parent shut them down)."""
    parent = pool._pid
    jobs = [*pool._pending, *(job for worker in pool._workers for job in worker.inflight)]
    for worker in pool._workers:
        worker.channel.close()
        if worker.pidfd is not None:
            os.close(worker.pidfd)
        inherited.append(worker.process)
    if pool._wake_r >= 0:
        os.close(pool._wake_r)
        os.close(pool._wake_w)
    pool._segments.close_after_fork()
    pool._fresh_state()
    for job in jobs:
        job.future._lock = threading.Lock()  # its holder may be a thread that is gone
        error = BrokenWorkerError(
            f"{job.name}() was forked on {pool!r} in process {parent}, which then "
            f"forked this process (os.fork); the task runs for the parent, so its "
            f"result never reaches this copy of the future"
        )
        settle(job.future, (None, error))


@atexit.register
def _shutdown_at_exit() -> None:
    # Registered after the Backend base class's own exit hook, so it runs
    # first (atexit runs in reverse) and that one finds these shut down.
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    backends = list(live)
    for backend in backends:
        grace = backend._grace
        if interrupted:
            why = f"still running {grace} s after an uncaught KeyboardInterrupt"
            stop(backend, True, why)
        else:
            why = f"the interpreter is exiting and no task finished for {grace} s"
            stop(backend, False, why, renew=True)
    for backend in backends:
        if not join(backend, timeout=1.0):
            _logger.warning(
                "%r: waiting for its running tasks before the interpreter exits "
                "(a worker is terminated once no task has finished for %s s)",
                backend,
                backend._grace,
            )
            join(backend)


def _after_fork_in_child() -> None:
    for backend in list(live):
        try:
            after_fork(backend)
        except Exception:
            _logger.exception("could not reset %r after os.fork()", backend)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
