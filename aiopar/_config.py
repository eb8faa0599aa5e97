"""Which backend forks go to, and how many threads the pools may use.

The current backend is a :mod:`contextvars` scope set by ``use_backend``
over a process-wide default set by ``set_backend``, so a scope holds across
``await`` and inside every task forked under it.

Thread counts come in two kinds, kept apart as ATen keeps them: *interop*
workers run forked tasks side by side, *intra-op* threads split one operation
(BLAS and OpenMP threads, set through threadpoolctl, plus the helpers of
``parallel_for``). Unless the user sets the intra-op count, a budget keeps
interop x intra-op within the cores while tasks run.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import platform
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .backends import Backend, create_backend

__all__ = [
    "current_backend",
    "get_backend",
    "get_num_interop_threads",
    "get_num_threads",
    "parallel_info",
    "set_backend",
    "set_num_interop_threads",
    "set_num_threads",
    "use_backend",
]

_scoped_backend: contextvars.ContextVar[Backend | None] = contextvars.ContextVar(
    "aiopar_backend", default=None
)
_default_backend: Backend | None = None
_default_lock = threading.Lock()


def _resolve(name_or_backend: str | Backend, options: dict[str, Any], where: str) -> Backend:
    if isinstance(name_or_backend, Backend):
        if options:
            raise TypeError(f"{where}: options go with a backend name, not a Backend instance")
        return name_or_backend
    if isinstance(name_or_backend, str):
        return create_backend(name_or_backend, **options)
    raise TypeError(
        f"{where} takes a backend name or a Backend instance, got {type(name_or_backend).__name__}"
    )


def current_backend() -> Backend:
    """The backend ``fork`` uses here: the innermost ``use_backend``, else the default."""
    backend = _scoped_backend.get()
    if backend is not None:
        return backend
    backend = _default_backend
    if backend is None or backend._closed:
        with _default_lock:
            backend = _set_default(create_backend("thread"))
    return backend


def _set_default(backend: Backend) -> Backend:
    global _default_backend
    _default_backend = backend
    return backend


def get_backend(name: str | None = None, **options: Any) -> Backend:
    """The current backend, or the one called ``name`` (created once per name and options).

    ``get_backend("process").fork(fn, x)`` forks on that backend only.
    """
    if name is None:
        if options:
            raise TypeError("get_backend(): options go with a backend name")
        return current_backend()
    return _resolve(name, options, "get_backend()")


def set_backend(name_or_backend: str | Backend, **options: Any) -> Backend:
    """Make a backend the process-wide default and return it."""
    with _default_lock:
        return _set_default(_resolve(name_or_backend, options, "set_backend()"))


@contextmanager
def use_backend(name_or_backend: str | Backend, **options: Any) -> Iterator[Backend]:
    """Fork to this backend inside the ``with`` block, in this context only.

    The scope is a context variable: it holds across ``await`` in the same
    task and inside tasks forked in the block, and other threads and tasks
    do not see it.
    """
    backend = _resolve(name_or_backend, options, "use_backend()")
    token = _scoped_backend.set(backend)
    try:
        yield backend
    finally:
        _scoped_backend.reset(token)


# -- thread counts ------------------------------------------------------------

_logger = logging.getLogger("aiopar")


@functools.cache
def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _check_thread_count(n: object, what: str) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{what} must be a whole number >= 1, got {n!r}")
    return n


#: workers of a thread backend created without max_workers (read on every fork)
interop_threads: int = cores()


def get_num_interop_threads() -> int:
    """Worker threads of the thread backend (the number of cores unless set)."""
    return interop_threads


def set_num_interop_threads(n: int) -> None:
    """Set the thread backend's worker count; pools already running follow it."""
    global interop_threads
    interop_threads = _check_thread_count(n, "set_num_interop_threads(n): n")


#: environment variables that decide thread counts, in the order they are read
#: for the starting intra-op count (the first one set wins)
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def _threads_from_env() -> tuple[int | None, str | None]:
    for name in THREAD_ENV_VARS[:4]:
        value = os.environ.get(name, "").strip()
        if value:
            try:
                n = int(value.split(",")[0])  # OMP_NUM_THREADS may be a list per level
            except ValueError:
                continue
            if n >= 1:
                return n, name
    return None, None


class _ThreadBudget:
    """The intra-op thread count and the libraries it is applied to.

    The count is explicit (``set_num_threads``, or a thread-count environment
    variable at import) or budgeted: ``cores // k`` while k tasks run at once,
    never below 1, and all the cores when at most one runs. A thread-pool
    task counts wherever it runs (a worker, or a waiter that runs it itself),
    once per thread however its tasks nest, and not while its thread is
    blocked in ``wait``; a running ``parallel_for`` counts its chunks.

    BLAS pools (OpenBLAS with pthreads, MKL, BLIS) are process-wide, so the
    count is applied to them whenever it changes, and only then (OpenBLAS
    through its own C function: under a microsecond). OpenMP
    limits are per thread, so a thread applies them to itself when it starts
    running a task.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()  # serialises changes to the libraries
        # One token per running task. deque.append/pop are atomic, so the
        # hot path takes no lock; whoever sees the budget change re-checks
        # under the lock until the libraries match the count.
        self.tokens: deque[None] = deque()
        n_cores = cores()
        # the budgeted count for k running tasks: all cores for 0 or 1, then cores // k
        self.shares = (n_cores, *(max(1, n_cores // k) for k in range(1, n_cores + 1)))
        self.explicit, self.explicit_from = _threads_from_env()
        self.applied: int | None = None  # last count given to the process-wide libraries
        self.controller: Any = None  # threadpoolctl.ThreadpoolController, made lazily
        self.process_wide: list[Any] = []
        self.setters: list[Callable[[int], Any]] = []  # one per process-wide library
        self.per_thread: list[Any] = []
        self.modules_seen = -1  # len(sys.modules) at the last scan for libraries
        self.local = threading.local()  # .applied: per-thread libraries' count in this thread

    @property
    def running(self) -> int:
        """Tasks running now on in-process pools, plus busy parallel_for helpers."""
        return len(self.tokens)

    def target(self) -> int:
        """The intra-op thread count right now."""
        if self.explicit is not None:
            return self.explicit
        return self._share(len(self.tokens))

    def _share(self, running: int) -> int:
        shares = self.shares
        return shares[running] if running < len(shares) else 1

    def _follow_if_changed(self) -> None:
        # The lock is taken only when the libraries must change.
        if self.explicit is None and self._share(len(self.tokens)) != self.applied:
            with self.lock:
                self._follow_budget()

    def enter(self) -> None:
        """A task starts running (the hot path of every pool: kept lean)."""
        self.tokens.append(None)
        self._follow_if_changed()
        if self.per_thread:
            self._apply_this_thread(self.target())

    def leave(self) -> None:
        """A task ended. The threads it leaves come back only once nothing
        runs: the next task usually starts at once, and changing BLAS costs
        microseconds, so short tasks would otherwise flip it all the time."""
        tokens = self.tokens
        tokens.pop()
        if not tokens:
            self._follow_if_changed()

    def drop(self) -> None:
        """A task counted ahead of its start will not start after all (its
        forker runs it, or it was cancelled): its share goes to the tasks
        still running at once."""
        self.tokens.pop()
        self._follow_if_changed()

    def follow(self) -> None:
        """Apply the count for the tasks running now, more threads included:
        a thread blocked in ``wait`` long enough leaves them its cores."""
        self._follow_if_changed()

    def add_running(self, delta: int) -> None:
        """``delta`` more (or fewer) tasks run now, as for ``delta`` calls of
        :meth:`enter` (or :meth:`leave`); ``parallel_for`` counts its chunks so."""
        tokens = self.tokens
        if delta > 0:
            tokens.extend([None] * delta)
            self._follow_if_changed()
        else:
            for _ in range(-delta):
                tokens.pop()
            if not tokens:
                self._follow_if_changed()

    def set_explicit(self, n: int | None, source: str | None) -> None:
        with self.lock:
            self.explicit, self.explicit_from = n, source
            self._scan()
            if n is None:
                n = self._follow_budget()
            else:
                self._apply(n)
        if self.per_thread:
            self._apply_this_thread(n)

    # Called with self.lock held.
    def _follow_budget(self) -> int:
        # The count may change again while the libraries are being set:
        # repeat until they match it, so the last change always wins.
        while True:
            n = self.target()
            if n == self.applied or self.explicit is not None:
                return n
            self._apply(n)

    # Called with self.lock held.
    def _apply(self, n: int) -> None:
        if len(sys.modules) != self.modules_seen:
            self._scan()  # a new import may have loaded another BLAS
        for lib, set_num_threads in zip(self.process_wide, self.setters, strict=True):
            try:
                set_num_threads(n)
            except Exception:
                _logger.exception("could not set the thread count of %s", lib.filepath)
        self.applied = n

    def apply_here(self) -> None:
        """Give this thread's OpenMP libraries the current count (a no-op without them)."""
        if self.per_thread:
            self._apply_this_thread(self.target())

    def _apply_this_thread(self, n: int) -> None:
        if getattr(self.local, "applied", None) == n:
            return
        for lib in self.per_thread:
            try:
                lib.set_num_threads(n)
            except Exception:
                _logger.exception("could not set the thread count of %s", lib.filepath)
        self.local.applied = n

    def _scan(self) -> None:
        from threadpoolctl import ThreadpoolController

        self.modules_seen = len(sys.modules)
        self.controller = ThreadpoolController()
        self.process_wide, self.per_thread, self.setters = [], [], []
        for lib in self.controller.lib_controllers:
            if lib.user_api == "openmp" or getattr(lib, "threading_layer", None) == "openmp":
                self.per_thread.append(lib)
            else:
                self.process_wide.append(lib)
                self.setters.append(_process_wide_setter(lib))
        self.applied = None
        self.local = threading.local()

    def libraries(self) -> list[dict[str, Any]]:
        """threadpoolctl's view of the loaded BLAS/OpenMP libraries, freshly scanned."""
        with self.lock:
            self._scan()
            return self.controller.info()


budget = _ThreadBudget()


def _process_wide_setter(lib: Any) -> Callable[[int], Any]:
    """The cheapest call that sets a process-wide library's thread count.

    For OpenBLAS that is its own C function, reached through threadpoolctl's
    handle on the library. threadpoolctl's method lets only one thread (the
    first that calls it) change OpenBLAS and ignores the others, while the
    budget changes it from whichever thread starts or ends a task; the C
    function also costs a third of the method.
    """
    if lib.internal_api == "openblas":
        for get_symbol in type(lib).check_symbols:
            setter = getattr(lib.dynlib, get_symbol.replace("_get_", "_set_"), None)
            if setter is not None:
                return setter
    return lib.set_num_threads


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
    if n is not None:
        _check_thread_count(n, "set_num_threads(n): n (or None for the automatic budget)")
    budget.set_explicit(n, None if n is None else "set_num_threads")


def parallel_info() -> str:
    """A report of the parallel settings, for people and bug reports.

    Lists the backends (available and current), the interop workers, the
    intra-op threads and how they were decided, the BLAS/OpenMP libraries
    threadpoolctl sees with their thread counts, the environment variables
    that set thread counts, and a warning line for each setting that
    oversubscribes the cores.
    """
    from . import _parallel  # it imports this module
    from .backends import available_backends

    n_cores = cores()
    lines = [f"aiopar on {n_cores} cores (Python {platform.python_version()}, {sys.platform})"]
    backend = _scoped_backend.get() or _default_backend
    current = backend.name if backend is not None and not backend.closed else "thread"
    lines.append(f"backends: {', '.join(available_backends())} (current: {current})")
    if backend is not None and not backend.closed:
        workers = f"{backend.max_workers} on the current {backend.name!r} backend"
    else:
        workers = f"{interop_threads} (the thread backend's default)"
    lines.append(f"interop workers: {workers}; get_num_interop_threads() = {interop_threads}")

    intra = budget.target()
    if budget.explicit is not None:
        how = f"set by {budget.explicit_from}, kept whatever runs"
    else:
        how = f"budget: cores // running tasks, {budget.running} running now"
    lines.append(f"intra-op threads: {intra} ({how})")
    helpers = max(intra - 1, 0)
    started = _parallel.helper_count()
    lines.append(
        f"parallel_for: up to {intra} threads (the caller + {helpers} "
        f"helper{'s' if helpers != 1 else ''}; {started} started)"
    )

    libraries = budget.libraries()
    lines.append("libraries (threadpoolctl):" if libraries else "libraries: none loaded")
    for lib in libraries:
        layer = lib.get("threading_layer")
        lines.append(
            f"  {lib['internal_api']} {lib.get('version') or '?'} ({lib['user_api']}"
            f"{', ' + layer if layer else ''}): {lib['num_threads']} threads, "
            f"{os.path.basename(lib['filepath'])}"
        )
    lines.append(
        "environment: "
        + ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in THREAD_ENV_VARS)
    )
    lines.extend(f"WARNING: {w}" for w in _oversubscription(libraries, backend))
    return "\n".join(lines)


def _oversubscription(libraries: list[dict[str, Any]], backend: Backend | None) -> list[str]:
    n_cores = cores()
    warnings = []
    workers = interop_threads
    if backend is not None and not backend.closed and backend.name == "thread":
        workers = backend.max_workers
    if budget.explicit is not None and workers * budget.explicit > n_cores:
        warnings.append(
            f"{workers} interop workers x {budget.explicit} intra-op threads "
            f"({budget.explicit_from}) = {workers * budget.explicit} threads on {n_cores} cores: "
            f"forked tasks that use BLAS or parallel_for at the same time will oversubscribe; "
            f"set_num_threads(None) restores the automatic budget"
        )
    for lib in libraries:
        if lib["num_threads"] > n_cores:
            warnings.append(
                f"{lib['internal_api']} uses {lib['num_threads']} threads on {n_cores} cores"
            )
    return warnings


def _after_fork_in_child() -> None:
    # Only the forking thread survives in a child: no task runs there yet,
    # and the lock may have been held by a thread that is gone.
    budget.lock = threading.Lock()
    budget.tokens = deque()


os.register_at_fork(after_in_child=_after_fork_in_child)
