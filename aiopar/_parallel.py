"""Intra-op parallelism for Python code: ``parallel_for`` and its helper threads.

``parallel_for(begin, end, grain_size, fn)`` splits ``[begin, end)`` into
chunks of at least ``grain_size``, a few per thread, and calls ``fn(b, e)``
once per chunk. The caller runs chunks too, alongside a small process-wide
pool of helper threads, each taking the next chunk when it finishes one, so
it scales wherever ``fn`` releases the GIL (numpy ufunc loops, BLAS calls,
most of ``np.sort``) and a thread that runs slow delays only its own share.
The pool starts lazily, one helper short of the largest thread count used.
"""

from __future__ import annotations

import operator
import os
import queue
import threading
from collections.abc import Callable

from . import _interrupt
from ._budget import budget
from ._budget_slots import probe

__all__ = ["in_parallel_region", "parallel_for"]

# .active is true while this thread runs parallel_for chunks.
_local = threading.local()

# Chunks per thread: with one chunk each, a thread that runs slow (its core
# shared with another process, its virtual CPU taken away for a while) makes
# the whole call wait for its chunk; with several, the other threads take
# over the chunks it has not reached, and the call ends at most one chunk
# after the ideal. More would only add per-chunk cost.
CHUNKS_PER_THREAD = 4


def in_parallel_region() -> bool:
    """True inside a chunk of :func:`parallel_for` (where a nested call runs serially)."""
    return getattr(_local, "active", False)


def _index(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"parallel_for(): {what} must be an integer, got bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # int, numpy integers
    except TypeError:
        raise TypeError(
            f"parallel_for(): {what} must be an integer, got {type(value).__name__} {value!r:.40}"
        ) from None


def parallel_for(begin: int, end: int, grain_size: int, fn: Callable[[int, int], object]) -> None:
    """Call ``fn(b, e)`` over chunks that cover ``[begin, end)``, in parallel.

    Guarantees:

    * the chunks are disjoint, cover the range exactly, and each has at least
      ``grain_size`` elements (one chunk, the whole range, if the range is
      smaller); an empty range (``begin == end``) calls nothing;
    * at most :func:`aiopar.get_num_threads` threads run chunks: the caller
      and helper threads. With one thread, ``fn(begin, end)`` is called once;
      with more, the range is cut into up to ``CHUNKS_PER_THREAD`` (4) equal
      chunks per thread, which the threads take in order as they finish the
      one before, so a thread that runs slow delays only its own share. The
      chunk bounds depend only on the arguments and the thread count, never
      on timing;
    * inside a chunk, :func:`in_parallel_region` is true and a nested
      ``parallel_for`` runs serially in that thread;
    * while the chunks run they count against the thread budget, so BLAS
      called from ``fn`` does not oversubscribe the cores (unless
      :func:`aiopar.set_num_threads` fixed the count);
    * the call returns once every chunk has finished. If chunks raise, the
      chunks not yet started are skipped, the others run to their end, and
      the first exception raised is re-raised here, with a note naming its
      chunk. Ctrl-C is the exception: the call raises KeyboardInterrupt at
      once, and the chunks other threads are running finish on their own.

    Raises TypeError for a non-integer bound or grain, or a non-callable
    ``fn``; ValueError for ``begin > end`` or ``grain_size < 1``.
    """
    begin = _index(begin, "begin")
    end = _index(end, "end")
    grain_size = _index(grain_size, "grain_size")
    if not callable(fn):
        raise TypeError(
            f"parallel_for(): fn must be a callable taking (begin, end) of a chunk, "
            f"got {type(fn).__name__} {fn!r:.40}"
        )
    if begin > end:
        raise ValueError(
            f"parallel_for(): begin ({begin}) is greater than end ({end}); "
            f"the range is [begin, end), so pass begin <= end (begin == end does nothing)"
        )
    if grain_size < 1:
        raise ValueError(
            f"parallel_for(): grain_size must be >= 1 (the smallest chunk worth "
            f"handing to a thread), got {grain_size}"
        )
    size = end - begin
    if size == 0:
        return
    if getattr(_local, "active", False):
        fn(begin, end)  # nested: this thread is one of the outer call's threads already
        return
    most_chunks = size // grain_size
    probe()  # forked tasks count against the budget from now on, if BLAS is loaded
    n_threads = min(budget.target(), most_chunks) or 1
    _local.active = True
    try:
        if n_threads == 1:
            fn(begin, end)
            return
        job = _Job(fn, _split(begin, size, min(CHUNKS_PER_THREAD * n_threads, most_chunks)))
        budget.add_running(n_threads)
        try:
            _pool.submit(job, n_threads - 1)
            job.work(caller=True)
            _interrupt.acquire(job.finished)
        except BaseException as exc:  # e.g. KeyboardInterrupt while waiting
            job.fail(exc)
            raise
        finally:
            budget.add_running(-n_threads)
            budget.apply_here()
    finally:
        _local.active = False
    if job.error is not None:
        raise job.error


def _split(begin: int, size: int, n: int) -> list[tuple[int, int]]:
    """``n`` contiguous chunks of ``size`` elements whose lengths differ by at most one."""
    step, extra = divmod(size, n)
    bounds = []
    b = begin
    for i in range(n):
        e = b + step + (i < extra)
        bounds.append((b, e))
        b = e
    return bounds


class _Job:
    """One parallel_for call: chunks claimed one at a time by whichever thread is free."""

    __slots__ = ("bounds", "error", "finished", "fn", "lock", "next", "unfinished")

    def __init__(self, fn: Callable[[int, int], object], bounds: list[tuple[int, int]]) -> None:
        self.fn = fn
        self.bounds = bounds
        self.lock = threading.Lock()
        self.next = 0
        self.unfinished = len(bounds)
        self.error: BaseException | None = None
        self.finished = threading.Lock()  # released when the last chunk ends
        self.finished.acquire()

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc

    def work(self, *, caller: bool = False) -> None:
        """Run unclaimed chunks until none is left. In the caller's thread,
        Ctrl-C in a chunk ends the call at once, as it does while the caller
        waits for the helpers' chunks."""
        budget.apply_here()  # OpenMP limits are per thread
        bounds = self.bounds
        while True:
            with self.lock:
                i = self.next
                if i >= len(bounds):
                    return
                self.next = i + 1
            if self.error is None:  # after a failure, claimed chunks are skipped
                b, e = bounds[i]
                try:
                    self.fn(b, e)
                except BaseException as exc:
                    exc.add_note(f"(raised by fn({b}, {e}), a chunk of parallel_for)")
                    self.fail(exc)
                    if caller and isinstance(exc, KeyboardInterrupt):
                        raise
            with self.lock:
                self.unfinished -= 1
                last = self.unfinished == 0
            if last:
                self.finished.release()


class _HelperPool:
    """Daemon threads that run chunks of parallel_for jobs handed to them."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.threads: list[threading.Thread] = []

    def submit(self, job: _Job, helpers: int) -> None:
        if len(self.threads) < helpers:
            with self.lock:
                while len(self.threads) < helpers:
                    thread = threading.Thread(
                        target=self._help,
                        name=f"aiopar-intraop-{len(self.threads)}",
                        daemon=True,
                    )
                    thread.start()
                    self.threads.append(thread)
        for _ in range(helpers):
            self.queue.put(job)  # a helper that comes late finds nothing left and moves on

    def _help(self) -> None:
        _local.active = True
        jobs = self.queue
        while True:
            job = jobs.get()
            job.work()
            del job


_pool = _HelperPool()


def helper_count() -> int:
    """Helper threads started so far (the caller of parallel_for is not one)."""
    return len(_pool.threads)


def _after_fork_in_child() -> None:
    # A forked child has only the thread that forked: start a fresh pool.
    global _pool
    _pool = _HelperPool()


os.register_at_fork(after_in_child=_after_fork_in_child)
