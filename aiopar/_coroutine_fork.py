"""A coroutine fork's run on an event loop, which settles its future
whatever happens to the loop.

The future is claimed when the coroutine starts, so cancelling it before
then means the coroutine never runs. If the loop cancels the coroutine,
closes it, or drops it unfinished, the future is cancelled (the coroutine
never started) or fails with CancelledError saying what happened.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from ._bridge import running_async_library
from ._errors import CancelledError
from ._future import claim, settle

__all__ = ["CoroutineFork", "forks_of", "settling_run", "start_on_asyncio"]

_get_running_loop = asyncio._get_running_loop

# Event loops keep only weak references to tasks, so each loop keeps its
# coroutine forks alive until they finish: in a set stored on the loop, not
# in one of ours, so a loop dropped unfinished takes them along, and each
# then settles its future (see CoroutineFork).
_FORKS_ATTRIBUTE = "_aiopar_coroutine_forks"


def forks_of(loop: Any) -> dict[asyncio.Task[Any], CoroutineFork]:
    """The coroutine forks running on ``loop``, by task."""
    forks = getattr(loop, _FORKS_ATTRIBUTE, None)
    if forks is None:
        forks = {}
        setattr(loop, _FORKS_ATTRIBUTE, forks)
    return forks


def _is_cancellation(exc: BaseException) -> bool:
    if isinstance(exc, asyncio.CancelledError):
        return True
    trio = sys.modules.get("trio")
    return trio is not None and isinstance(exc, trio.Cancelled)


class CoroutineFork:
    """What a coroutine fork's future knows of its run (the future's task):
    where it runs, so a blocking wait that could never end fails at once,
    and a run that ends any other way than by finishing still settles the
    future."""

    __slots__ = ("__weakref__", "future", "loop", "name", "thread_id")

    stealable = False
    record = None  # the profiler's record (coroutine forks have none)

    def __init__(self, fut: Any, fn: Callable[..., Any], loop: Any, thread_id: int) -> None:
        self.future = fut
        self.name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        # Weakly: a future must not keep a dropped loop alive.
        self.loop = None if loop is None else weakref.ref(loop)
        self.thread_id = thread_id  # of the loop, when it started the coroutine

    def runs_on_this_thread(self) -> bool:
        if self.loop is None:  # trio's
            return self.thread_id == threading.get_ident() and running_async_library() == "trio"
        loop = self.loop()
        if loop is None or loop.is_closed():
            self.abandoned("was closed before it finished")
            return False
        return _get_running_loop() is loop

    def abandoned(self, what_happened: str) -> None:
        """The loop will never run the coroutine to its end: settle the future."""
        fut = self.future
        if fut is None or fut.done():
            return
        if not fut.cancel():  # it had started
            settle(
                fut, None, CancelledError(f"the event loop running this coroutine {what_happened}")
            )


def settling_run(
    fut: Any,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    record: Any,
) -> Callable[[], Coroutine[Any, Any, None]]:
    """The coroutine function a loop runs for the fork: it claims ``fut``,
    awaits ``fn(*args, **kwargs)`` (through the profiler's ``record`` if
    there is one) and settles ``fut`` with what came of it."""

    async def run() -> None:
        nonlocal fut
        try:
            if not claim(fut):
                return
            try:
                if record is None:
                    result = await fn(*args, **kwargs)
                else:
                    result = await record.run_in_steps(fn, args, kwargs)
            except BaseException as exc:
                if not _is_cancellation(exc) and not isinstance(exc, GeneratorExit):
                    settle(fut, None, exc)
                    return
                closed = isinstance(exc, GeneratorExit)
                what = "was closed before it finished" if closed else "cancelled it"
                error = CancelledError(f"the event loop running this coroutine {what}")
                error.__cause__ = exc
                settle(fut, None, error)
                raise  # a task must not swallow its own cancellation
            settle(fut, result, None)
        finally:
            fut = None  # a failure's traceback holds this frame: no cycle (see Future)

    return run


def start_on_asyncio(
    fork: CoroutineFork,
    loop: asyncio.AbstractEventLoop,
    run: Callable[[], Coroutine[Any, Any, None]],
    context: Any,
) -> None:
    """Start ``run()`` as a task of ``loop``, from the loop's own thread."""
    task = loop.create_task(run(), context=context)
    forks = forks_of(loop)
    forks[task] = fork

    def done(task: asyncio.Task[Any]) -> None:
        del forks[task]
        fork.abandoned("cancelled it")  # before its first step: its body never ran

    task.add_done_callback(done)
    # Collected unfinished, with its loop dropped. Not at exit, which runs
    # the forks on aiopar's own loop to their end.
    weakref.finalize(task, fork.abandoned, "was closed before it finished").atexit = False
