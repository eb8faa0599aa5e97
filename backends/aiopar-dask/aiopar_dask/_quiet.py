"""dask workers that close without an error in the log.

A dask worker that closes while its heartbeat is on the wire aborts that
heartbeat's connection itself, and then logs "Failed to communicate with
scheduler during heartbeat" with two tracebacks (dask/distributed#9032). A
script that ran without fault ends with that error on its stderr, one worker
in a few. A :class:`QuietWorker` drops that error when it is closing, and
only then: a heartbeat that fails while the worker runs is still logged.
"""

from __future__ import annotations

import contextvars
import logging

import distributed
from distributed.core import Status

__all__ = ["QuietWorker"]

HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat."
_CLOSING = frozenset({Status.closing, Status.closing_gracefully, Status.closed})

# The worker whose heartbeat the current task runs, if any.
_beating: contextvars.ContextVar[QuietWorker | None] = contextvars.ContextVar(
    "aiopar_dask_beating", default=None
)


class _HeartbeatCutByClose(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        worker = _beating.get()
        return not (
            worker is not None and record.msg == HEARTBEAT_FAILED and worker.status in _CLOSING
        )


_FILTER = _HeartbeatCutByClose()


class QuietWorker(distributed.Worker):
    """A ``distributed.Worker`` that does not log, as an error, the heartbeat
    its own close cut short. Every worker of a cluster aiopar starts is one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        logging.getLogger("distributed.worker").addFilter(_FILTER)  # once: filters are a set

    async def heartbeat(self) -> None:
        beating = _beating.set(self)
        try:
            await super().heartbeat()
        finally:
            _beating.reset(beating)
