"""The "openmp" backend: one task at a time, each with every intra-op thread.

The intra-op counterpart of "thread": instead of running forked tasks side by
side with a share of the cores each, it runs them one after another on a
single lane thread, in fork order, and lets each split its own work across
all the intra-op threads (BLAS and OpenMP threads, and ``parallel_for``).
That is the faster choice when tasks are few and their operations parallelise
well (large matrix products, big elementwise ufuncs); results agree with
"thread" up to the rounding a BLAS may change with its thread count.
"""

from __future__ import annotations

from .._waiter import get_waiter
from .thread import PoolTask, ThreadBackend

__all__ = ["OpenMPBackend"]


class _LaneTask(PoolTask):
    """A task only the lane (or its stand-in) runs: a thread outside the
    pool that waits for it blocks instead of running it in place beside the
    lane, out of order."""

    __slots__ = ()

    @property
    def stealable(self) -> bool:  # type: ignore[override] # a property: whose thread asks
        """Whether a thread that waits for the task may run it: the lane (or
        its stand-in), a worker of this pool, only."""
        return getattr(get_waiter(), "pool", None) is self.backend


class OpenMPBackend(ThreadBackend):
    """Runs forked tasks one at a time, in fork order, on a single lane thread.

    Guarantees:

    * a task forked from outside the lane starts only after every task forked
      before it has finished (or blocked, below), and never in the thread
      that waits for it;
    * while a task runs alone it has every intra-op thread: the budget gives
      it all the cores, or the count fixed by ``set_num_threads``, whatever
      the thread that forked it does meanwhile;
    * a task that forks on this backend and waits for the result from inside
      the lane runs the awaited task itself if it has not started, as a call
      would; if the awaited task is already running elsewhere, or the wait has
      a timeout, the lane hands its queue to a stand-in thread while it is
      blocked, so nested fork/wait never deadlocks.
    """

    name = "openmp"
    task_class = _LaneTask
    # The lane's task has every intra-op thread, whatever its forker does meanwhile.
    forker_counts = False

    def __init__(self) -> None:
        super().__init__(max_workers=1)
