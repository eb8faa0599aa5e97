"""The thread budget's adapter to the libraries: threadpoolctl's handles,
and the cheapest calls that read and set each library's thread count."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

__all__ = ["limiting_thread", "process_wide_getter", "process_wide_setter"]


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
