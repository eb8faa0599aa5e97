"""Workers blocked outside aiopar: found by their threads' CPU clocks.

A pool's worker that blocks in aiopar's own ``wait`` tells its pool, which
counts it out and lets another worker run (see :mod:`aiopar.backends.thread`).
A worker that blocks anywhere else (a sleep, a socket, a file, a lock, a
driver's own I/O) tells nobody; left alone, blocking calls would queue
behind as many workers as there are cores. The runtimes that solved this
watch rather than ask: Go's scheduler hands off a processor whose thread sits
in a system call, .NET's thread pool adds threads when queued work starves.

Here one watcher thread per pool reads the CPU clock of each worker that
runs a task (``time.pthread_getcpuclockid``). A worker whose clock advanced
by less than ``IDLE_SHARE`` of the wall time since the watcher last looked
may be blocked, or may only be waiting for the GIL, which a thread that
computes does too: it gets the GIL back within a few switch intervals
(``sys.getswitchinterval()``, 5 ms), but on a busy machine not always
within tens of them. Linux tells the two apart
(``/proc/self/task/<id>/syscall``): a thread waiting for the GIL waits on
a futex; one that sleeps, or waits on a socket, a pipe or a file, waits in
another system call, and is judged blocked after ``QUICK_WINDOW``. A futex
wait is also how a lock is waited for: a worker that stays in one for
``LOCK_WINDOW`` without computing is judged blocked too; GIL hand-offs are
far more frequent than that. A thread that runs, or is ready to, is never
judged blocked. Where the system call cannot be read, every wait is judged
as a futex wait is.

The pool counts a blocked worker out as it counts out one blocked in
``wait``, and a compensating worker takes the queued work. One that
computes is never counted out, so CPU-bound forks never run on more
workers than the pool's size.

The watcher then remembers the function that blocked (:data:`blocking_keys`):
the next task of that function is counted out as it starts, so a stream of
blocking calls does not wait a window per call. A task counted out that way,
or once it blocked, and that then computes (its clock advances by more than
``BUSY_SHARE``) is counted in again and its function forgotten.

The watcher looks every ``TICK`` while a worker runs a task (a look reads a
clock per such worker: about a microsecond each), and sleeps once the pool
has run no task for ``PARK_AFTER``; the pool wakes it when a worker starts
again. On a system without per-thread CPU clocks there is no
watcher: the pool compensates for ``wait`` only.
"""

from __future__ import annotations

import platform
import threading
import time
from collections.abc import Callable
from types import BuiltinFunctionType, FunctionType, MethodType, ModuleType
from typing import Any

__all__ = ["OUTSIDE", "SUPPORTED", "WAITING", "StallWatcher", "blocking_keys", "learn", "presumed"]

# Why a pool counts a worker out (its ``held``): it waits in aiopar's own
# ``wait``, or the watcher found it blocked outside aiopar.
WAITING = "wait"
OUTSIDE = "outside"

#: seconds after which a worker waiting in a system call other than a futex wait is blocked
QUICK_WINDOW = 0.004
#: the same for a futex wait (a lock, or the GIL), or where the call cannot be told
LOCK_WINDOW = 0.2
#: a worker whose thread used less than this share of a core over a window is blocked
IDLE_SHARE = 0.05
#: a worker counted out whose thread used more than this share since the last look computes
BUSY_SHARE = 0.2
#: seconds between looks while a worker runs a task
TICK = 0.005
#: seconds without a task run after which the watcher sleeps until woken
PARK_AFTER = 1.0

SUPPORTED = hasattr(time, "pthread_getcpuclockid")


def _key(fn: Callable[..., Any] | None) -> object | None:
    """What identifies ``fn``'s code across calls: a function's code object
    (closures and lambdas made per call share it), a method's function's,
    a module-level builtin itself (``time.sleep``); None for anything else,
    which is not remembered (a bound builtin would keep its object alive)."""
    if type(fn) is MethodType:
        fn = fn.__func__
    if type(fn) is FunctionType:
        return fn.__code__
    if type(fn) is BuiltinFunctionType and isinstance(fn.__self__, ModuleType | None):
        return fn
    return None


# The futex calls, by machine: a thread waits for the GIL (or a lock) in one.
_FUTEX_CALLS = {"x86_64": (b"202", b"449"), "aarch64": (b"98", b"449")}.get(platform.machine(), ())
# What a thread is doing, as far as its system call tells
RUNS, IN_FUTEX, IN_OTHER_CALL, UNKNOWN = "runs", "futex", "other call", "unknown"


def _doing(native_id: int | None) -> str:
    """What the thread ``native_id`` is doing: it RUNS (or is ready to),
    waits IN_FUTEX (for the GIL, or a lock), IN_OTHER_CALL (a sleep, a
    socket, a file), or UNKNOWN where the system does not say."""
    if not _FUTEX_CALLS or native_id is None:
        return UNKNOWN
    try:
        with open(f"/proc/self/task/{native_id}/syscall", "rb") as status:
            call = status.read(16).split(b" ", 1)[0]
    except OSError:
        return UNKNOWN
    # "running" while on a core; "-1" while off it outside a system call
    if not call[:1].isdigit():
        return RUNS
    return IN_FUTEX if call in _FUTEX_CALLS else IN_OTHER_CALL


#: the functions seen blocking on a worker (by :func:`_key`), so their next
#: calls are counted out of the pool as they start; shared by every pool of
#: the process (a function that blocks does so whichever pool runs it)
blocking_keys: set[object] = set()
#: past this many, blocking_keys starts afresh
BLOCKING_KEYS_LIMIT = 1024


def presumed(fn: Callable[..., Any] | None) -> bool:
    """Whether ``fn`` blocked the last time the watcher judged it."""
    return _key(fn) in blocking_keys


def learn(key: object | None, blocks: bool) -> None:
    """Remember whether the function ``key`` stands for blocks."""
    if key is None:
        return
    if not blocks:
        blocking_keys.discard(key)
        return
    if len(blocking_keys) >= BLOCKING_KEYS_LIMIT:
        blocking_keys.clear()
    blocking_keys.add(key)


class _Mark:
    """Where a worker's clocks stood when the watcher last judged it."""

    __slots__ = ("cpu", "key", "task", "wall")

    def __init__(self, task: object, key: object | None, wall: float, cpu: float) -> None:
        self.task, self.key, self.wall, self.cpu = task, key, wall, cpu


class StallWatcher:
    """One pool's watcher thread. The pool calls :meth:`start` with its
    first worker, :meth:`wake` (under its lock) when a worker starts while
    the watcher sleeps, and :meth:`stop` at shutdown.

    What the watcher needs of the pool it is given, not read from it: the
    prefix of its threads' names, its lock, its set of workers (changed
    under that lock), and ``stall(worker, task)`` and ``unstall(worker)``,
    which count a worker out (True if it was) and in again.
    """

    def __init__(
        self,
        thread_names: str,
        lock: threading.Lock,
        workers: set[Any],
        stall: Callable[[Any, Any], bool],
        unstall: Callable[[Any], None],
    ) -> None:
        self._lock, self._workers, self._stall, self._unstall = lock, workers, stall, unstall
        self._alarm = threading.Event()
        self.parked = False
        self._stopped = False
        self._marks: dict[Any, _Mark] = {}  # by worker
        self._clocks: dict[Any, int] = {}  # by worker: its thread's CPU clock
        self.thread = threading.Thread(
            target=self._watch,
            # Not the workers' prefix, which tests and users count workers by.
            name=thread_names.replace("aiopar-", "aiopar-watcher-", 1),
            daemon=True,
        )

    def start(self) -> None:
        self.thread.start()

    def wake(self) -> None:
        """A worker starts while the watcher sleeps. Called with the pool's lock held."""
        self.parked = False
        self._alarm.set()

    def stop(self) -> None:
        self._stopped = True
        self._alarm.set()

    def _watch(self) -> None:
        idle_since = time.monotonic()
        while not self._stopped:
            now = time.monotonic()
            if self._look():
                idle_since = now
            elif now - idle_since >= PARK_AFTER:
                with self._lock:
                    # Under the lock: a worker that starts after this sees it parked.
                    if not any(w.task is not None for w in self._workers):
                        self.parked = True
                        self._alarm.clear()
                if self.parked:
                    self._marks.clear()
                    self._alarm.wait()
                    idle_since = time.monotonic()
                    continue
            self._alarm.wait(TICK)
            if self._alarm.is_set() and not self._stopped:
                self._alarm.clear()

    def _look(self) -> bool:
        """Judge every worker that runs a task; return whether any does."""
        marks = self._marks
        now = time.perf_counter()
        busy = False
        # list() copies the set in one step under the GIL, while workers come and go.
        workers = list(self._workers)
        for worker in workers:
            task = worker.task
            if task is None or worker.held is WAITING:
                marks.pop(worker, None)
                continue
            busy = True
            cpu = self._cpu_time(worker)
            if cpu is None:
                continue
            mark = marks.get(worker)
            if mark is None or mark.task is not task:
                marks[worker] = _Mark(task, _key(task.fn), now, cpu)
                continue
            elapsed = now - mark.wall
            if elapsed < QUICK_WINDOW:
                continue
            share = (cpu - mark.cpu) / elapsed
            if worker.held is not None:
                if share > BUSY_SHARE:  # it computes after all
                    self._unstall(worker)
                    learn(mark.key, False)
            elif share < IDLE_SHARE:
                doing = _doing(worker.thread.native_id)
                if doing is IN_OTHER_CALL or (doing is not RUNS and elapsed >= LOCK_WINDOW):
                    if self._stall(worker, task):
                        learn(mark.key, True)
                elif doing is not RUNS:
                    continue  # a futex wait: judged once it lasts, from the same mark
            mark.wall, mark.cpu = now, cpu
        if len(marks) > len(workers) or len(self._clocks) > len(workers):
            alive = set(workers)
            for table in (marks, self._clocks):
                for gone in [w for w in table if w not in alive]:
                    del table[gone]
        return busy

    def _cpu_time(self, worker: Any) -> float | None:
        """The CPU time of ``worker``'s thread, or None if it cannot be read
        (the thread has not started, or has just ended)."""
        clock = self._clocks.get(worker)
        try:
            if clock is None:
                ident = worker.thread.ident
                if ident is None:
                    return None
                clock = self._clocks[worker] = time.pthread_getcpuclockid(ident)
            return time.clock_gettime(clock)
        except OSError:
            return None
