"""The backend registry: the built-ins plus plugins from the ``aiopar.backends``
entry-point group.

A plugin distribution registers its :class:`Backend` subclass (or any
callable that takes the options as keywords and returns a Backend) in its
``pyproject.toml``::

    [project.entry-points."aiopar.backends"]
    dask = "aiopar_dask:DaskBackend"
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any

from ._base import Backend, Task

__all__ = ["Backend", "Task", "available_backends", "create_backend"]

ENTRY_POINT_GROUP = "aiopar.backends"

_BUILTINS = {
    "inline": "aiopar.backends.inline:InlineBackend",
    "thread": "aiopar.backends.thread:ThreadBackend",
    "process": "aiopar.backends.process:ProcessBackend",
    "openmp": "aiopar.backends.openmp:OpenMPBackend",
}

_plugins: dict[str, Any] | None = None
_instances: dict[tuple[str, tuple[tuple[str, Any], ...]], Backend] = {}
_lock = threading.Lock()


def _plugin_entry_points() -> dict[str, Any]:
    global _plugins
    if _plugins is None:
        found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
        _plugins = {name: ep for name, ep in found.items() if name not in _BUILTINS}
    return _plugins


def available_backends() -> list[str]:
    """Names ``get_backend`` accepts: the built-ins, then installed plugins."""
    return [*_BUILTINS, *sorted(_plugin_entry_points())]


def _factory(name: str) -> Callable[..., Backend]:
    if name in _BUILTINS:
        module, _, attr = _BUILTINS[name].partition(":")
        builtin: Callable[..., Backend] = getattr(importlib.import_module(module), attr)
        return builtin
    entry_point = _plugin_entry_points().get(name)
    if entry_point is None:
        raise ValueError(
            f"unknown backend {name!r}; available backends: {', '.join(available_backends())}"
        )
    plugin: Callable[..., Backend] = entry_point.load()
    return plugin


def create_backend(name: str, **options: Any) -> Backend:
    """The backend called ``name`` with these options, created on first use.

    The same name and options give the same instance until it is shut down.
    """
    if not isinstance(name, str):
        raise TypeError(f"a backend name is a string, got {type(name).__name__}")
    try:
        key = (name, tuple(sorted(options.items())))
        hash(key)
    except TypeError:
        raise TypeError(f"backend options must be hashable values, got {options!r}") from None
    with _lock:
        backend = _instances.get(key)
        if backend is None or backend.closed:
            backend = _factory(name)(**options)
            if not isinstance(backend, Backend):
                raise TypeError(
                    f"backend {name!r} produced {type(backend).__name__}, not an aiopar Backend"
                )
            _instances[key] = backend
        return backend
