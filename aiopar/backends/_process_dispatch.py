"""Handing queued jobs to the process backend's workers: to an idle worker
first, then, for small calls, prefetched onto busy ones."""

from __future__ import annotations

import itertools
import pickle
from typing import TYPE_CHECKING

from . import _process_wire as wire
from ._process_handle import Job, Worker

if TYPE_CHECKING:
    from .process import ProcessBackend

__all__ = ["PREFETCH_BUDGET_NS", "dispatch", "prefetch_depth", "send"]

# Adaptive prefetch: about this much work queued on a worker, at most this
# many tasks, each at most this big, all of them at most this many bytes.
PREFETCH_BUDGET_NS = 1_000_000
PREFETCH_MAX_TASKS = 16
PREFETCH_MAX_CALL = 16 * 1024
PREFETCH_MAX_BYTES = 64 * 1024


def dispatch(pool: ProcessBackend) -> None:
    """Send queued jobs to idle workers, then prefetch onto busy ones.

    Called with the lock held.
    """
    pending = pool._pending
    while pending and pool._idle:
        job = pending.popleft()
        if job.future._claim():
            send(pool, pool._idle.pop(), job)
        elif job.future.running():
            send(pool, pool._idle.pop(), job)  # resent after its first worker died
        else:
            job.packed.discard()  # cancelled
    depth = prefetch_depth(pool)
    if not pending or not depth:
        return
    for worker in pool._workers:
        if not pending:
            break
        if not worker.ready or not worker.inflight:
            continue
        # What the worker has not read yet must fit in the socket's
        # buffer: a send here must never wait for a busy worker.
        queued = sum(len(j.packed.payload) for j in itertools.islice(worker.inflight, 1, None))
        while pending and not worker.stopping and len(worker.inflight) <= depth:
            job = pending[0]
            size = len(job.packed.payload)
            if job.packed.segment is not None or size > PREFETCH_MAX_CALL:
                return  # big calls only go to a worker that is reading
            if queued + size > PREFETCH_MAX_BYTES:
                break
            pending.popleft()
            if job.future._claim() or job.future.running():
                queued += size
                send(pool, worker, job)
            else:
                job.packed.discard()


def prefetch_depth(pool: ProcessBackend) -> int:
    if pool._prefetch is not None:
        return pool._prefetch
    return max(1, min(PREFETCH_MAX_TASKS, PREFETCH_BUDGET_NS // (pool._mean_run_ns + 1)))


def send(pool: ProcessBackend, worker: Worker, job: Job) -> None:
    # Called with the lock held.
    worker.inflight.append(job)
    try:
        if worker.path_version != pool._path_version:
            # Before the task, so its function unpickles on the new path.
            path = wire.Packed(pickle.dumps(pool._path, protocol=5), [], None, None)
            worker.channel.send(wire.PATH, packed=path)
            worker.path_version = pool._path_version
        traced = job.task.record is not None  # the worker records its forks then
        worker.channel.send(wire.TASK, job.id, job.packed, owner=worker, t0=traced)
    except OSError:
        # The worker is dying; the manager notices through its pidfd and
        # requeues this job, which the worker never received.
        worker.inflight.pop()
        pool._pending.appendleft(job)
        worker.stopping = True
        if worker in pool._idle:
            pool._idle.remove(worker)
