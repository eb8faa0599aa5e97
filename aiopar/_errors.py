"""The exceptions aiopar raises.

Each subclasses its :mod:`concurrent.futures` counterpart, so code written
against the standard library catches aiopar's errors unchanged.
"""

from __future__ import annotations

import concurrent.futures
import concurrent.futures.process

__all__ = ["BrokenWorkerError", "CancelledError", "InvalidStateError"]


class CancelledError(concurrent.futures.CancelledError):
    """The future was cancelled before its task started, so it has no value."""


class InvalidStateError(concurrent.futures.InvalidStateError, RuntimeError):
    """The future is not in a state that allows the call.

    Raised by a second ``set_result``/``set_exception`` and by ``value()`` on a
    future that is not done yet. It is also a :class:`RuntimeError`, as in
    ``torch.futures.Future``.
    """


class BrokenWorkerError(concurrent.futures.process.BrokenProcessPool):
    """A worker process died while it ran the task.

    Only the tasks that process was running fail; the pool replaces the worker
    and later forks run normally. It is a
    :class:`concurrent.futures.process.BrokenProcessPool`, and so a
    :class:`~concurrent.futures.BrokenExecutor` and a :class:`RuntimeError`:
    ``except BrokenProcessPool`` written for ``ProcessPoolExecutor`` catches it.
    """
