"""Which backend forks go to.

The current backend is a :mod:`contextvars` scope set by ``use_backend``
over a process-wide default set by ``set_backend``, so a scope holds across
``await`` and inside every task forked under it.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from .backends import Backend, create_backend

__all__ = ["current_backend", "get_backend", "scoped_or_default", "set_backend", "use_backend"]

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
    if backend is None or backend.closed:
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


def scoped_or_default() -> Backend | None:
    """The backend ``fork`` would use here, without creating one."""
    backend = _scoped_backend.get() or _default_backend
    return None if backend is None or backend.closed else backend
