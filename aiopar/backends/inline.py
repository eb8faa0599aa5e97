"""The "inline" backend: each task runs at once in the thread that forks it.

Useful for debugging (tracebacks and breakpoints stay in one thread) and as
the eager-mode baseline that ``torch.jit.fork`` falls back to.
"""

from __future__ import annotations

from ._base import Backend, Task

__all__ = ["InlineBackend"]


class InlineBackend(Backend):
    """Runs every forked task in the caller before ``fork`` returns."""

    name = "inline"

    def __init__(self) -> None:
        super().__init__()

    @property
    def max_workers(self) -> int:
        return 1

    def enqueue(self, task: Task) -> None:
        task.run()

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        """Nothing to release: an inline backend owns no workers."""
