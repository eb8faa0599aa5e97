"""What the process backend makes of a worker's frames: a future to settle
and with what, and the settling itself, which a done-callback cannot harm."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from .._future import Future
from . import _process_wire as wire
from ._process_dispatch import dispatch
from ._process_errors import remote_exception, unpickling_failed
from ._process_handle import Worker

if TYPE_CHECKING:
    from .process import ProcessBackend

__all__ = ["Settle", "on_frame", "settle"]

_logger = logging.getLogger("aiopar")

# A future and its outcome, (result, exception), or None to cancel it.
Settle = tuple[Future[Any], "tuple[Any, BaseException | None] | None"]


def on_frame(pool: ProcessBackend, worker: Worker, frame: wire.Frame) -> Settle | None:
    """Account for the frame; return the settling of its future, which the
    caller does last (a done-callback may block, see blocked)."""
    if frame.kind == wire.READY:
        with pool._lock:
            worker.ready = True
            pool._start_failures = 0
            if not worker.stopping:
                pool._idle.append(worker)
            dispatch(pool)
        return None
    if frame.kind == wire.TRACE:  # about the running task; its result comes next
        with pool._lock:
            job = worker.inflight[0]
        assert job.id == frame.msg_id, (job.id, frame.msg_id)
        job.forks = frame.loads()
        return None
    with pool._lock:
        job = worker.inflight.popleft()
        assert job.id == frame.msg_id, (job.id, frame.msg_id)
        if not worker.inflight and not worker.stopping:
            pool._idle.append(worker)
        dispatch(pool)
    pool._mean_run_ns += (frame.t1 - frame.t0 - pool._mean_run_ns) // 8
    if pool._renew and pool._deadline is not None:
        pool._deadline = time.monotonic() + pool._grace  # type: ignore[operator]
    task = job.task
    if task.record is not None:
        # Tasks run on the worker's main thread, whose tid is its pid.
        task.record.on_remote_run(
            frame.t0, frame.t1, worker.pid, worker.pid, f"process worker {worker.index}"
        )
        if job.forks is not None:
            task.record.on_remote_forks(job.forks)
    future = job.future
    try:
        if frame.kind == wire.RESULT:
            outcome: tuple[Any, BaseException | None] = (frame.loads(), None)
        else:
            outcome = (None, remote_exception(frame.loads(), job.name))
    except BaseException as exc:
        outcome = (None, unpickling_failed(exc, job.name))
    return future, outcome


def settle(future: Future[Any], outcome: tuple[Any, BaseException | None] | None) -> None:
    """Settle ``future`` with ``outcome``, or cancel it if that is None.

    A done-callback runs here; whatever it raises (SystemExit and
    KeyboardInterrupt included) is the callback's business, not the
    pool's: it is logged, and the manager carries on.
    """
    try:
        if outcome is None:
            future.cancel()
        else:
            future._settle(*outcome)
    except BaseException as exc:
        _logger.error(
            "a done-callback of %r raised %s; the process backend logged and ignored it",
            future,
            type(exc).__name__,
            exc_info=exc,
        )
