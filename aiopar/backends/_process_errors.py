"""How the process backend reports what went wrong: a task's exception from
its worker, a result that did not unpickle, a call that did not pickle, and
how a worker exited."""

from __future__ import annotations

import pickle
import signal
from typing import Any

from ._base import Task

__all__ = [
    "RemoteError",
    "RemoteTraceback",
    "describe_exit",
    "remote_exception",
    "unpicklable_part",
    "unpickling_failed",
]


class RemoteTraceback(Exception):
    """The traceback of an exception raised in a worker process, as text.

    Attached as the ``__cause__`` of the exception that ``wait`` raises, so
    a printed traceback shows where the task failed inside the worker.
    """

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return f'\n\nTraceback in the worker process:\n"""\n{self.tb}"""'


class RemoteError(Exception):
    """Stands in for an exception raised in a worker that could not be pickled."""


def remote_exception(info: tuple[bytes | None, str, str, str], task_name: str) -> BaseException:
    exc_bytes, kind, message, tb_text = info
    exc: BaseException | None = None
    if exc_bytes is not None:
        try:
            exc = pickle.loads(exc_bytes)
        except Exception:
            exc = None
    if exc is None:
        exc = RemoteError(
            f"{kind}: {message} (raised by {task_name}() in a worker process; the exception "
            f"itself could not be pickled, so this stands in for it)"
        )
    exc.__cause__ = RemoteTraceback(tb_text)
    return exc


def unpickling_failed(exc: BaseException, task_name: str) -> BaseException:
    error = TypeError(
        f"the result of {task_name}() came back from the worker process but could not be "
        f"unpickled here ({type(exc).__name__}: {exc}); is its class importable in this process?"
    )
    error.__cause__ = exc
    return error


def unpicklable_part(task: Task) -> str:
    """Name the first part of the call that does not pickle, for the error message."""
    import cloudpickle

    parts: list[tuple[str, Any]] = [("the function", task.fn)]
    parts += [(f"argument {i}", arg) for i, arg in enumerate(task.args)]
    parts += [(f"keyword argument {key!r}", value) for key, value in task.kwargs.items()]
    for label, value in parts:
        try:
            cloudpickle.dumps(value, protocol=5, buffer_callback=lambda _: False)
        except Exception:
            return f"{label} (a {type(value).__module__}.{type(value).__qualname__})"
    return "part of the call"


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        hint = {
            "SIGKILL": " (the out-of-memory killer, or someone, killed it)",
            "SIGSEGV": " (a segmentation fault, usually in a C extension)",
        }.get(name, "")
        return f"it was killed by {name}{hint}"
    return f"it exited with code {returncode}"
