"""The thread budget: how many threads the pools and the libraries may use.

Thread counts come in two kinds, kept apart as ATen keeps them: *interop*
workers run forked tasks side by side, *intra-op* threads split one operation
(BLAS and OpenMP threads, set through threadpoolctl, plus the helpers of
``parallel_for``). Every rule that keeps interop x intra-op within the cores
is stated here, and the token counts and library settings they make are
kept here, with the calls that read and set each library's count; each
thread's standing (rule 2, its slot) and the occupancy hook the pools report
to are in ``_budget_slots``. Every rule reads the time from ``clock``, which
tests replace:

1. **The count.** Explicit (``set_num_threads``, or a thread-count
   environment variable at import) and then kept whatever runs; otherwise
   ``cores // k`` while k threads count, never below 1, and every core while
   at most one counts.
2. **Who counts.** The pools report transitions, not tasks (the occupancy
   hook of ``_budget_slots``). A pool's worker counts for a spell of work:
   from its first task after it was woken (or from its wake-up, below) until
   it finds no task and sleeps again, however many tasks it runs back to
   back, except while it is blocked in ``wait``. A thread outside the pools
   counts while it runs a task another thread forked (a waiter that runs it
   itself), and beside its own forks (rule 3). A fork that wakes no worker,
   and a fork its forker runs itself, change nothing. Each chunk of a
   running ``parallel_for`` counts.
3. **A forker counts from the fork.** A thread outside the pools that
   computes beside its forks counts from a fork that wakes a worker, and
   that worker with it, so the forker's next BLAS call already leaves the
   cores the fork will use. It stops when it blocks in ``wait``, or when the
   pool it forked on has no worker busy. It also starts to count when it
   runs one of its forks itself while a worker runs another (or a worker
   woken for another has yet to start). A thread that waits (or runs its
   fork itself) within ``WAITS_AT_ONCE`` seconds of a fork that woke a
   worker, with no other woken worker still to start, is taken to fork and
   wait, not to compute beside its forks: it counts for its forks again
   only once it has computed longer than that before a wait. So
   ``fork(f).wait()`` changes no library setting, whichever thread runs ``f``.
4. **Threads come back late.** The libraries get fewer threads as soon as
   more threads count, but more only once nothing counts, or when a thread
   blocks in ``wait``: at once if it computed for less than 0.1 s
   (``_waiter.BLOCKED_LONG``), else once the wait has lasted that long.
   Even then, no sooner than ``COME_BACK_AFTER`` after more than one thread
   last counted: a timer gives them back then. Only a share nothing used
   comes back at once: a forker's that waited within ``WAITS_AT_ONCE`` of
   counting for its forks, and a woken worker's that found no task to run
   (rule 3). OpenBLAS's threads spin for about 0.1 s after a call, so more
   threads for a short spell (a stream of short tasks, the short tail of a
   fork, the moment between two rounds of forks) would leave spinning
   threads beside the tasks that come next. ``set_num_threads`` applies at
   once.
5. **A limit set by someone else is theirs.** A process-wide library whose
   count is not the one the budget last gave it was set by someone else
   (the library's own API, or ``threadpoolctl.threadpool_limits`` in any
   thread, as scikit-learn does); so is one that threadpoolctl reports a
   ``threadpool_limits`` block open on, whatever its count. The budget
   leaves that library alone, as it would an explicit count, until the
   block has closed and its count is back to the budget's (which is what
   threadpoolctl restores); the other libraries follow the budget
   meanwhile. ``set_num_threads(n)`` overrides every such limit;
   ``set_num_threads(None)`` forgets those no block holds open.

BLAS pools (OpenBLAS with pthreads, MKL, BLIS) are process-wide, so the count
is applied to them whenever it changes, and only then. Rule 5 costs a read of
each library's count at those moments; while someone else holds a library
(no hook says when a holder lets go), also every ``HELD_RECHECK`` seconds
at most when a thread starts or stops counting.
OpenMP limits are per thread: a thread applies the count to itself when it
starts counting and gets its own setting back when it stops.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any, cast

from . import _waiter
from ._checks import check_count

__all__ = [
    "budget",
    "cores",
    "get_num_interop_threads",
    "get_num_threads",
    "num_threads",
    "set_num_interop_threads",
    "set_num_threads",
]

_logger = logging.getLogger("aiopar")


@functools.cache
def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# -- interop ------------------------------------------------------------------

#: workers of a thread backend created without max_workers (read on every fork)
interop_threads: int = cores()


def get_num_interop_threads() -> int:
    """Worker threads of the thread backend (the number of cores unless set)."""
    return interop_threads


#: called with the new count once set_num_interop_threads has set it: the
#: thread pools that follow it keep their limit in a field of their own, so
#: that a fork reads one attribute for it
interop_listeners: list[Callable[[int], object]] = []


def set_num_interop_threads(n: int) -> None:
    """Set the thread backend's worker count; pools already running follow it."""
    global interop_threads
    check_count(n, "set_num_interop_threads(n): n")
    interop_threads = n
    for listener in list(interop_listeners):
        listener(n)


# -- intra-op -----------------------------------------------------------------

#: environment variables that decide thread counts; the first four, in this
#: order, set the starting intra-op count (the first one set to a count wins)
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def threads_from_env() -> tuple[int | None, str | None, list[str]]:
    """The intra-op count the environment sets, the variable that set it, and
    a sentence for each variable that was set but is not a count."""
    ignored: list[str] = []
    for name in THREAD_ENV_VARS[:4]:
        value = os.environ.get(name, "").strip()
        if not value:
            continue
        try:
            n = int(value.split(",")[0])  # OMP_NUM_THREADS may be a list per level
        except ValueError:
            n = 0
        if n >= 1:
            return n, name, ignored
        ignored.append(f"{name}={value!r} is ignored: it is not a whole number >= 1")
    return None, None, ignored


# -- the libraries: threadpoolctl's handles, and the cheapest calls that read
# and set each library's thread count ----------------------------------------


def process_wide_setter(lib: Any) -> Callable[[int], Any]:
    """The cheapest call that sets a process-wide library's thread count.

    For OpenBLAS that is its own C function, reached through threadpoolctl's
    handle on the library (``dynlib``, and the symbol names of its
    ``check_symbols``: the threadpoolctl versions this relies on are pinned
    in pyproject.toml and a test fails if they change). threadpoolctl's
    method lets only one thread (the first that calls it) change OpenBLAS and
    ignores the others, while the budget changes it from whichever thread
    starts or ends a task; the C function also costs a third of the method.
    """
    if lib.internal_api == "openblas":
        for get_symbol in type(lib).check_symbols:
            name = get_symbol.replace("_get_", "_set_")
            setter: Callable[[int], Any] | None = getattr(lib.dynlib, name, None)
            if setter is not None:
                return setter
    return cast("Callable[[int], Any]", lib.set_num_threads)


def process_wide_getter(lib: Any) -> Callable[[], Any]:
    """The cheapest call that reads a process-wide library's thread count:
    OpenBLAS's own C function (the one threadpoolctl checks for), else
    threadpoolctl's property."""
    if lib.internal_api == "openblas":
        for get_symbol in type(lib).check_symbols:
            getter: Callable[[], Any] | None = getattr(lib.dynlib, get_symbol, None)
            if getter is not None:
                return getter
    return lambda: lib.num_threads


def limiting_thread(lib: Any) -> threading.Thread | None:
    """The thread inside a ``threadpool_limits`` block on ``lib``, if
    threadpoolctl says: it does for OpenBLAS with pthreads, the one library
    whose limits it lets only one thread set (``_SHARED_STATE``, private;
    a test fails if a threadpoolctl release moves it)."""
    shared = getattr(type(lib), "_SHARED_STATE", None)
    thread = getattr(shared, "controlling_thread", None)
    if isinstance(thread, threading.Thread) and thread.is_alive():
        return thread
    return None


#: the time every rule reads, in seconds; tests replace it to step time by hand
clock: Callable[[], float] = time.monotonic

#: while someone else holds a library (rule 5), how often the budget looks again
HELD_RECHECK = 0.01

#: rule 4: how long after more than one thread last counted the libraries get
#: more threads again (as long as OpenBLAS's threads spin after a call)
COME_BACK_AFTER = _waiter.BLOCKED_LONG


class Shares(dict[int, int]):
    """The budgeted intra-op count for each number of things that count:
    every core for 0 or 1, then ``cores // k``, and 1 from ``cores`` on.
    A table, so that the hot path reads a share with no Python call."""

    def __init__(self, n_cores: int) -> None:
        super().__init__((k, n_cores // max(k, 1)) for k in range(n_cores + 1))

    def __missing__(self, running: int) -> int:
        return 1  # more count than there are cores: one thread each


class Budget:
    """The intra-op thread count and the libraries it is applied to."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # serialises changes to the libraries
        # One token per thread (or parallel_for chunk, or fork) that counts.
        # deque.append/pop are atomic, so the hot path takes no lock; whoever
        # sees the count change re-checks under the lock until the libraries
        # match it.
        self.tokens: deque[None] = deque()
        n_cores = cores()
        self.shares = Shares(n_cores)
        self.explicit, self.explicit_from, self.env_ignored = threads_from_env()
        # The count last given to the process-wide libraries; None while one
        # of them is held by someone else (rule 5), so that follow() looks
        # again, at most every HELD_RECHECK seconds unless the count changes.
        self.applied: int | None = None
        self.attempted: int | None = None
        self.recheck_at = 0.0
        # Rule 4: when more than one thread last counted, and the timer that
        # gives the libraries more threads COME_BACK_AFTER seconds later.
        self.crowded_at = -math.inf
        self.come_back_timer: threading.Timer | None = None
        self.controller: Any = None  # threadpoolctl.ThreadpoolController, made lazily
        self.process_wide: list[Any] = []
        self.setters: list[Callable[[int], Any]] = []  # one per process-wide library
        self.getters: list[Callable[[], Any]] = []
        # By library path, kept across rescans: the count the budget left in
        # each library (read back after setting it), and the libraries that
        # someone else holds (rule 5) with the count they found there.
        self.counts: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.per_thread: list[Any] = []
        self.modules_seen = -1  # len(sys.modules) at the last scan for libraries
        self.local = threading.local()  # per-thread libraries: .applied, .own
        # Called once a scan finds a library: the occupancy hook starts listening.
        self.on_found: Callable[[], None] | None = None

    @property
    def running(self) -> int:
        """Threads, forks and parallel_for chunks that count now."""
        return len(self.tokens)

    def target(self) -> int:
        """The intra-op thread count right now."""
        if self.explicit is not None:
            return self.explicit
        return self.shares[len(self.tokens)]

    def follow(self, *, now: bool = False) -> None:
        """Give the libraries the count for what counts now: fewer threads at
        once, more no sooner than rule 4 allows, or at once with ``now``."""
        # The lock is taken only when the libraries must change, or when a
        # library someone else holds is due for another look (rule 5); not
        # while a timer is due to give them more (rule 4) and more is what
        # they would get.
        if self.explicit is None:
            n = self.shares[len(self.tokens)]
            applied = self.applied
            if n == applied or (
                not now
                and self.come_back_timer is not None
                and applied is not None
                and n > applied
                and clock() < self.crowded_at + COME_BACK_AFTER  # the timer is not late
            ):
                return
            if self._not_due(n):
                return
            with self.lock:
                self._follow_budget(now=now)

    def _not_due(self, n: int) -> bool:
        """Rule 5: whether a library someone else holds was looked at for
        count ``n`` less than HELD_RECHECK seconds ago."""
        return bool(self.held) and n == self.attempted and clock() < self.recheck_at

    # take and give_back call follow only when the libraries' count would
    # change. Slot.first_task and Slot.end_spell spell them out, once per
    # spell of a worker's work (tests/test_budget_copies.py).

    def take(self, now: float | None = None) -> None:
        """One more counts: the libraries get fewer threads at once if the
        share drops. ``now``: the clock's time, if the caller has read it."""
        tokens = self.tokens
        tokens.append(None)
        running = len(tokens)
        if running > 1:
            self.crowded_at = clock() if now is None else now
        if self.explicit is None and self.shares[running] != self.applied:
            self.follow()

    def give_back(self, *, now: bool = False) -> None:
        """One fewer counts. The threads come back at once with ``now`` (the
        token was not needed after all), else only once nothing counts and
        no sooner than rule 4 allows."""
        tokens = self.tokens
        tokens.pop()
        if (
            (now or not tokens)
            and self.explicit is None
            and self.shares[len(tokens)] != self.applied
        ):
            self.follow(now=now)

    def add_running(self, delta: int) -> None:
        """``delta`` more (or fewer) count now; ``parallel_for`` counts its chunks so."""
        if delta > 0:
            self.tokens.extend([None] * delta)
            if len(self.tokens) > 1:
                self.crowded_at = clock()
            self.follow()
        else:
            for _ in range(-delta):
                self.tokens.pop()
            if not self.tokens:
                self.follow()

    def set_explicit(self, n: int | None, source: str | None) -> None:
        with self.lock:
            self.explicit, self.explicit_from = n, source
            self.scan()
            if n is None:
                # Rule 5: only open threadpoolctl blocks still hold. Rule 4
                # waits for no earlier crowd: the budget's count applies now.
                self.counts.clear()
                self.held.clear()
                self.crowded_at = -math.inf
                n = self._follow_budget()
            else:
                self._apply(n, override=True)
        self.apply_here()

    # Called with self.lock held.
    def _follow_budget(self, *, now: bool = False) -> int:
        # The count may change again while the libraries are being set:
        # repeat until they match it, so the last change always wins.
        while True:
            n = self.target()
            if n == self.applied or self.explicit is not None or self._not_due(n):
                return n
            last = self.attempted
            # Rule 4, unless someone else holds a library: rule 5 tells a
            # holder by the count the budget gave it last.
            if not now and last is not None and n > last and not self.held:
                wait = self.crowded_at + COME_BACK_AFTER - clock()
                if wait > 0:
                    self._come_back_later(wait)
                    return last
            self._apply(n)
            if self.target() == n:
                return n

    # Called with self.lock held.
    def _come_back_later(self, delay: float) -> None:
        if self.come_back_timer is not None:
            return  # it looks again when it fires, and waits longer if it must
        timer = threading.Timer(delay, self._come_back)
        timer.name, timer.daemon = "aiopar-budget", True
        try:
            timer.start()
        except RuntimeError:  # no thread can start (interpreter exit): at once, then
            self._apply(self.target())
            return
        self.come_back_timer = timer

    def _come_back(self) -> None:
        with self.lock:
            self.come_back_timer = None
        self.follow()  # which waits on, if something counted meanwhile

    # Called with self.lock held.
    def _apply(self, n: int, *, override: bool = False) -> None:
        if len(sys.modules) != self.modules_seen:
            self.scan()  # a new import may have loaded another BLAS
        counts, held = self.counts, self.held
        for lib, set_num_threads, get_num_threads in zip(
            self.process_wide, self.setters, self.getters, strict=True
        ):
            path = lib.filepath
            try:
                now = get_num_threads()
                ours = counts.get(path, now)
                if not override and (now != ours or limiting_thread(lib) is not None):
                    held[path] = now  # rule 5
                    continue
                held.pop(path, None)
                if now != n:
                    set_num_threads(n)
                    # What it really has: a library may cap the count.
                    now = get_num_threads()
                counts[path] = n if now is None else now
            except Exception:
                _logger.exception("could not set the thread count of %s", lib.filepath)
        # No hook says when a holder lets go: while a library is held, follow()
        # looks again (rule 5).
        self.attempted = n
        self.applied = None if held else n
        if held:
            self.recheck_at = clock() + HELD_RECHECK

    def apply_here(self) -> None:
        """Give this thread's OpenMP libraries the current count (a no-op without them)."""
        if self.per_thread:
            self._apply_this_thread(self.target())

    def restore_here(self) -> None:
        """Give this thread's OpenMP libraries back the count they had before
        the budget first changed them in this thread."""
        own = getattr(self.local, "own", None)
        if own is not None and self.per_thread:
            self._apply_this_thread(own)

    def _apply_this_thread(self, n: int) -> None:
        local = self.local
        if getattr(local, "applied", None) == n:
            return
        if getattr(local, "own", None) is None:
            local.own = self.per_thread[0].num_threads
        for lib in self.per_thread:
            try:
                lib.set_num_threads(n)
            except Exception:
                _logger.exception("could not set the thread count of %s", lib.filepath)
        local.applied = n

    def scan(self) -> None:
        """Look again at the BLAS and OpenMP libraries loaded in the process
        (threadpoolctl's view). Called with :attr:`lock` held."""
        from threadpoolctl import ThreadpoolController

        self.modules_seen = len(sys.modules)
        self.controller = ThreadpoolController()
        self.process_wide, self.per_thread, self.setters, self.getters = [], [], [], []
        for lib in self.controller.lib_controllers:
            if lib.user_api == "openmp" or getattr(lib, "threading_layer", None) == "openmp":
                self.per_thread.append(lib)
            else:
                self.process_wide.append(lib)
                self.setters.append(process_wide_setter(lib))
                self.getters.append(process_wide_getter(lib))
        self.applied = None
        self.local = threading.local()
        if (self.process_wide or self.per_thread) and self.on_found is not None:
            self.on_found()

    def libraries(self) -> list[dict[str, Any]]:
        """threadpoolctl's view of the loaded BLAS/OpenMP libraries, freshly scanned.

        A process-wide library held by someone other than aiopar (rule 5)
        also has ``"held_in"`` (the name of the thread inside a
        ``threadpool_limits`` block on it, or None if threadpoolctl knows of
        none) and ``"aiopar_count"`` (the count the budget gave it).
        """
        with self.lock:
            self.scan()
            infos: list[dict[str, Any]] = self.controller.info()
            by_path = {lib.filepath: lib for lib in self.process_wide}
            for info in infos:
                lib = by_path.get(info["filepath"])
                if lib is None:
                    continue
                ours = self.counts.get(info["filepath"], info["num_threads"])
                thread = limiting_thread(lib)
                if thread is not None or info["num_threads"] != ours:
                    info["held_in"] = None if thread is None else thread.name
                    info["aiopar_count"] = ours
            return infos


budget = Budget()


def get_num_threads() -> int:
    """Intra-op threads: what BLAS, OpenMP and ``parallel_for`` may use right now.

    This is the count given to :func:`set_num_threads` if it was called (or
    read from ``OMP_NUM_THREADS`` and the like at import). Otherwise it is
    the budget: all the cores while no forked task runs, ``cores // k``
    (at least 1) while k tasks run at once.
    """
    return budget.target()


def set_num_threads(n: int | None) -> None:
    """Use exactly ``n`` intra-op threads from now on, or ``None`` for the budget.

    Applies at once to every BLAS and OpenMP library that threadpoolctl
    finds (OpenMP in the calling thread, and in each worker when it next
    starts a task) and to ``parallel_for``. An explicit count is kept as
    given, whatever runs: ``n`` above ``cores() // get_num_interop_threads()``
    oversubscribes the cores once several forked tasks use BLAS at the same
    time, and :func:`parallel_info` says so. ``set_num_threads(None)`` hands
    the count back to the budget.
    """
    check_count(n, "set_num_threads(n): n", none="the automatic budget")
    budget.set_explicit(n, None if n is None else "set_num_threads")


def num_threads(n: int | None) -> contextlib.AbstractContextManager[None]:
    """Use ``n`` intra-op threads inside the ``with`` block (``None``: the
    automatic budget), then restore the setting that was in force before it:
    an explicit count (from :func:`set_num_threads`, an enclosing block, or
    an environment variable such as ``OMP_NUM_THREADS``) or the budget.

    Like :func:`set_num_threads`, which it calls, the count is process-wide:
    it holds for every thread while the block runs. A count that is not a
    whole number >= 1 (or None) raises ValueError here, at the call.
    """
    check_count(n, "num_threads(n): n", none="the automatic budget")
    return _num_threads(n)


@contextlib.contextmanager
def _num_threads(n: int | None) -> Iterator[None]:
    with budget.lock:
        previous = budget.explicit, budget.explicit_from
    budget.set_explicit(n, None if n is None else "num_threads")
    try:
        yield
    finally:
        budget.set_explicit(*previous)


def _after_fork_in_child() -> None:
    # Only the forking thread survives in a child: nothing runs there yet,
    # and the lock may have been held by a thread that is gone.
    budget.lock = threading.Lock()
    budget.tokens = deque()
    budget.crowded_at = -math.inf
    budget.come_back_timer = None  # its thread is not in the child
    if budget.attempted is not None:
        # The libraries may have the count of tasks that run on in the
        # parent only: the child has every thread at once.
        budget.follow()


os.register_at_fork(after_in_child=_after_fork_in_child)
