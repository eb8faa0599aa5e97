"""Which backend forks go to, and how many threads the pools may use.

The current backend is a :mod:`contextvars` scope set by ``use_backend``
over a process-wide default set by ``set_backend``, so a scope holds across
``await`` and inside every task forked under it.
"""

from __future__ import annotations

import contextvars
import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .backends import Backend, create_backend

__all__ = [
    "current_backend",
    "get_backend",
    "get_num_interop_threads",
    "set_backend",
    "set_num_interop_threads",
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
