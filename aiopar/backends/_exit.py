"""Interpreter exit: every live backend runs what was queued, then stops.

Exit has two stages. The first runs where threading's own exit hooks do,
while every thread and backend is still up: it drains every backend (and
aiopar's own event loop) round after round until none had anything left,
then runs the plugins' exit hooks (:func:`at_exit`). The second, an
:mod:`atexit` handler, shuts every backend down. After an uncaught
KeyboardInterrupt, tasks that have not started never do.

From the start of the first stage to the end of the second, whatever waits
(a stage, or a backend's own exit handler between them): once exit has
waited a second, it says on stderr which tasks it waits for, as soon as
one runs; and Ctrl-C exits at once, saying so in one line.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook registered before ours, below
import os
import signal
import sys
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from .. import _interrupt, _loop
from .._log import logger as _logger

__all__ = ["Stoppable", "at_exit", "drain_every_backend", "track"]


class Stoppable(Protocol):
    """What exit needs of a backend (:class:`aiopar.Backend` has it all)."""

    @property
    def name(self) -> str: ...

    def drain(self) -> bool: ...

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None: ...

    def running_tasks(self) -> list[str]: ...


_live_backends: weakref.WeakSet[Stoppable] = weakref.WeakSet()


def track(backend: Stoppable) -> None:
    """Run what ``backend`` has queued, and stop it, at interpreter exit."""
    _live_backends.add(backend)


_exit_hooks: list[Callable[[], object]] = []


def at_exit(fn: Callable[[], object]) -> None:
    """Call ``fn()`` at interpreter exit once every backend has run what was
    queued, and before any backend shuts down.

    For a plugin's own exit work that queued tasks may still need until then
    (an rpc agent leaving its peers, say). Hooks run in the reverse order of
    registration, as :mod:`atexit` runs its own; what one raises is logged and
    the others still run. After an uncaught KeyboardInterrupt they run at once:
    tasks that have not started never do then.
    """
    if not callable(fn):
        raise TypeError(f"at_exit() takes a callable, got {type(fn).__name__} {fn!r:.60}")
    _exit_hooks.append(fn)


def _interrupted() -> bool:
    return isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)


#: how often, once exit has waited a second, it looks for running tasks to name
REPORT_EVERY = 0.2


class _Exiting:
    """What holds from the first stage of exit to the end of the last: the
    thread that says what exit waits for, and Ctrl-C exiting at once."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reporter = threading.Thread(
            target=_report_waiting, args=(self.done,), name="aiopar-exit-report", daemon=True
        )
        self.reporter.start()
        self.previous_handler: Any = None
        # A handler of the program's own stays: only Python's default one,
        # which would raise KeyboardInterrupt in whatever exit runs then, goes.
        if _interrupt.on_main_thread() and signal.getsignal(signal.SIGINT) is (
            signal.default_int_handler
        ):
            self.previous_handler = signal.signal(signal.SIGINT, _exit_now)

    def end(self) -> None:
        self.done.set()
        if self.previous_handler is not None and signal.getsignal(signal.SIGINT) is _exit_now:
            signal.signal(signal.SIGINT, self.previous_handler)


_exiting: _Exiting | None = None


def _exit_now(signum: int = signal.SIGINT, frame: FrameType | None = None) -> None:
    """Ctrl-C while exit waits: exit now, in one line, not a traceback."""
    sys.stderr.write("aiopar: interrupted again, exiting without waiting\n")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(130)


def _at_exit_stage(stage: Callable[[list[Stoppable]], None]) -> None:
    """Run one stage of interpreter exit on the live backends; the first
    stage begins what holds until the last has run (see :class:`_Exiting`)."""
    global _exiting
    if _exiting is None:
        _exiting = _Exiting()
    try:
        stage(list(_live_backends))
    except KeyboardInterrupt:  # the program's own SIGINT handler raised it
        _exit_now()
    finally:
        if stage is _shutdown_all:
            _exiting.end()


def _drain_all(backends: list[Stoppable]) -> None:
    """First stage of exit, while every thread and backend is still up: run
    what is queued (coroutine forks on aiopar's own loop too) until nothing
    is left anywhere, then the plugins' exit hooks."""
    if not _interrupted():
        drain_every_backend()
    while _exit_hooks:
        hook = _exit_hooks.pop()
        try:
            hook()
        except Exception:
            _logger.exception("exception in the aiopar exit hook %r", hook)


def drain_every_backend() -> None:
    """Return once every live backend, and aiopar's own event loop, has
    nothing left to run: each backend drains as its ``drain()`` does, round
    after round until none had anything left, so a backend made meanwhile
    is drained too. The backends stay open."""
    # Tasks may fork on other backends and on the loop, and coroutine forks
    # wait for tasks: round after round until all are quiet.
    busy = True
    while busy:
        _loop.finish_owned_loop()
        busy = False
        for backend in list(_live_backends):
            busy = backend.drain() or busy


def _shutdown_all(backends: list[Stoppable]) -> None:
    """Last stage of exit: run what is left (forks made after the first
    stage, by threads that ran on) and stop every worker. After an uncaught
    KeyboardInterrupt, tasks that have not started never do."""
    interrupted = _interrupted()
    if interrupted:
        for backend in backends:
            backend.shutdown(wait=False, cancel_pending=True)
    # Coroutine forks may wait for tasks, and tasks for coroutine forks:
    # the loop runs until the pools have stopped.
    _loop.finish_owned_loop(cancel_pending=interrupted)
    for backend in backends:
        backend.shutdown(wait=True, cancel_pending=interrupted)
    _loop.finish_owned_loop(cancel_pending=interrupted)
    _loop.close_owned_loop()


# Draining runs where threading's own exit hooks do, before non-daemon
# threads are joined and before any atexit handler (libraries such as
# distributed close their clients in one); shutting down runs as an atexit
# handler, after them. Those hooks run last registered first: registered
# after concurrent.futures' own (which makes its executors refuse work, and
# is registered when its thread module is first imported), the drain and the
# plugins' hooks still find them taking work.
threading._register_atexit(_at_exit_stage, _drain_all)  # type: ignore[attr-defined]
atexit.register(_at_exit_stage, _shutdown_all)


def _report_waiting(done: threading.Event) -> None:
    """Once exit has waited a second, and then as soon as a task runs, say
    on stderr which tasks it waits for; once."""
    if done.wait(1.0):
        return
    while True:
        backends = list(_live_backends)
        running = [
            f"{name} ({backend.name})" for backend in backends for name in backend.running_tasks()
        ]
        running += [f"{name} (coroutine)" for name in _loop.owned_loop_running()]
        if running:
            break
        if done.wait(REPORT_EVERY):
            return
    sys.stderr.write(
        f"aiopar: waiting for {len(running)} running task"
        f"{'s' if len(running) != 1 else ''} to finish before exit: "
        f"{', '.join(running)}; press Ctrl-C again to exit now\n"
    )
    sys.stderr.flush()
