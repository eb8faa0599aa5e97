"""The process backend's manager thread: one select loop that starts
workers, reads their frames, settles futures, and hands over to a new
thread when a done-callback blocks."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
from typing import TYPE_CHECKING

from .. import _future
from .._errors import BrokenWorkerError
from . import _process_wire as wire
from ._process_deaths import worker_died
from ._process_handle import Job, Worker
from ._process_outcomes import Settle, on_frame, settle
from ._process_shutdown import busy, enforce_deadline, fail_everything, stop_workers

if TYPE_CHECKING:
    from .process import ProcessBackend

__all__ = ["manage"]

_logger = logging.getLogger("aiopar")


def manage(pool: ProcessBackend, generation: int) -> None:
    _future.set_waiter(pool)
    selector = selectors.DefaultSelector()
    selector.register(pool._wake_r, selectors.EVENT_READ, None)
    watched: set[Worker] = set()
    settles: list[Settle] = []
    handed_off = False
    try:
        while True:
            timeout = enforce_deadline(pool, settles)
            with pool._lock:
                for job, error in start_workers(pool):
                    job.packed.discard()
                    settles.append((job.future, (None, error)))
                for worker in pool._workers:
                    if worker not in watched:
                        watched.add(worker)
                        if not worker.eof:
                            selector.register(worker.channel, selectors.EVENT_READ, worker)
                        if worker.pidfd is not None:
                            selector.register(worker.pidfd, selectors.EVENT_READ, worker)
                stop = pool._closed and not pool._pending and not busy(pool)
            # Settled last, right before select() lets go of the GIL, so
            # a waiter that wakes up finds it free.
            if settle_all(pool, settles, generation):
                handed_off = True
                return
            if stop:
                break
            # Frames a previous manager read but left unhandled.
            ready = [
                (selector.get_key(w.channel), None)
                for w in watched
                if not w.eof and w.channel.has_frame()
            ]
            for key, _ in ready or selector.select(timeout):
                worker = key.data
                if worker is None:
                    with contextlib.suppress(BlockingIOError):
                        os.read(pool._wake_r, 4096)
                    send_releases(pool)
                elif worker in watched:
                    if key.fileobj is worker.channel:
                        read(pool, worker, selector, settles)
                        if worker.eof and worker in pool._workers:
                            with contextlib.suppress(KeyError, ValueError):
                                selector.unregister(worker.channel)
                    else:
                        worker_died(pool, worker, selector, settles)
                    if worker not in pool._workers:
                        watched.discard(worker)
        stop_workers(pool)
    except BaseException:
        _logger.exception("the manager thread of %r failed; failing its tasks", pool)
        for future, outcome in settles:
            settle(future, outcome)
        fail_everything(pool)
        raise
    finally:
        selector.close()
        if not handed_off:
            with pool._wake_lock:
                os.close(pool._wake_r)
                os.close(pool._wake_w)
                pool._wake_r = pool._wake_w = -1
            pool._segments.close()


def settle_all(pool: ProcessBackend, settles: list[Settle], generation: int) -> bool:
    """Settle the futures; True if a callback blocked and a new manager
    took over (this thread then only finishes its own list)."""
    for i, (future, outcome) in enumerate(settles):
        settle(future, outcome)
        if generation != pool._generation:
            # The new manager never saw these, so they are settled here.
            for future, outcome in settles[i + 1 :]:
                settle(future, outcome)
            return True
    settles.clear()
    return False


def start_workers(pool: ProcessBackend) -> list[tuple[Job, BaseException]]:
    """Start one worker per queued job, up to max_workers.

    Called with the lock held; returns the jobs to fail (after the lock
    is released) if no worker could be started at all.
    """
    starting = sum(1 for worker in pool._workers if not worker.ready)
    wanted = min(len(pool._pending) - starting, pool._max_workers - len(pool._workers))
    for _ in range(max(wanted, 0)):
        try:
            pool._workers.append(Worker(pool, next(pool._worker_index)))
        except OSError as exc:
            if pool._workers:
                break  # the running workers carry on
            doomed = list(pool._pending)
            pool._pending.clear()
            return [
                (
                    job,
                    BrokenWorkerError(
                        f"could not start a worker process for {job.name}() "
                        f"({type(exc).__name__}: {exc})"
                    ),
                )
                for job in doomed
            ]
    return []


def read(
    pool: ProcessBackend, worker: Worker, selector: selectors.BaseSelector, settles: list[Settle]
) -> None:
    """Handle the frames waiting on the worker's socket, adding the futures
    to settle to ``settles``."""
    channel = worker.channel
    while True:
        try:
            frame = channel.recv()
        except (EOFError, OSError):
            with pool._lock:
                worker.eof = True
                worker.stopping = True
                if worker in pool._idle:
                    pool._idle.remove(worker)
            if worker.pidfd is None:  # no pidfd to tell when it has exited
                worker_died(pool, worker, selector, settles)
            return
        if frame is not None and (settle := on_frame(pool, worker, frame)):
            settles.append(settle)
        del frame
        if not channel.has_frame():
            return


def send_releases(pool: ProcessBackend) -> None:
    by_worker: dict[Worker, list[int]] = {}
    while pool._unmapped:
        worker, seg_id = pool._unmapped.popleft()
        by_worker.setdefault(worker, []).append(seg_id)
    if not by_worker:
        return
    with pool._lock:
        for worker, ids in by_worker.items():
            if worker in pool._workers and not worker.stopping:
                with contextlib.suppress(OSError):
                    worker.channel.send(wire.RELEASE, released=ids)
