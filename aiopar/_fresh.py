"""Worker processes as fresh interpreters.

multiprocessing's ``spawn`` runs the parent's ``__main__`` again in every
child, so a script without an ``if __name__ == "__main__":`` guard starts
its workers over and over, and a script read from stdin cannot start any.
A worker started with :func:`fresh_python` is a new interpreter that runs
one named function and nothing of the user's program. It has the parent's
interpreter flags and ``sys.path`` (set before anything is imported, so a
``json.py`` in the working directory shadows nothing), and it exits as soon
as the process that started it dies, however it dies.
"""

from __future__ import annotations

import importlib
import os
import select
import subprocess
import sys
import threading
import time
from typing import Any

__all__ = ["exit_with_parent", "fresh_python", "importable"]

# argv: parent pid, "module:function", its arguments, "--", then sys.path.
BOOT = (
    "import sys; i = sys.argv.index('--'); sys.path[:] = sys.argv[i + 1:]; "
    "from aiopar._fresh import _run; _run(sys.argv[1:i])"
)


def fresh_python(target: str, *args: object, path: list[Any] | None = None) -> list[str]:
    """The command line of a fresh interpreter that calls ``target(*args)``.

    ``target`` is ``"module:function"``; the function gets each argument as
    a string. ``path`` (this process's ``sys.path`` by default) becomes the
    child's ``sys.path`` before it imports anything.
    """
    return [
        sys.executable,
        # The flags this interpreter runs with (-X, -W...), as multiprocessing passes them.
        *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
        "-c",
        BOOT,
        str(os.getpid()),
        target,
        *map(str, args),
        "--",
        *importable(sys.path if path is None else path),
    ]


def importable(path: list[Any]) -> list[str]:
    """The entries of ``sys.path`` a child can use (strings and path objects)."""
    return [os.fspath(p) for p in path if isinstance(p, str | os.PathLike)]


def _run(argv: list[str]) -> None:
    parent_pid, target, *args = argv
    exit_with_parent(int(parent_pid))
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(*args)


def exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the process ``parent_pid`` dies, however it dies
    (SIGKILL included) and whatever this process is doing: no work is worth
    doing for a parent that cannot take its result."""
    try:
        pidfd: int | None = os.pidfd_open(parent_pid)
    except (AttributeError, OSError):  # not Linux >= 5.3: poll the parent's pid instead
        pidfd = None
    if os.getppid() != parent_pid:  # it died before the watch began
        os._exit(1)

    def watch() -> None:
        if pidfd is not None:
            select.select([pidfd], [], [])  # readable once the process has exited
        else:
            while os.getppid() == parent_pid:
                time.sleep(0.2)
        os._exit(1)

    threading.Thread(target=watch, name="aiopar-parent-watch", daemon=True).start()
