"""``@async_execution``: a callee that replies later, holding no thread meanwhile."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable[..., Any])


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning an :class:`aiopar.Future` whose outcome is the reply.

    When a peer runs a decorated function for ``rpc_sync``, ``rpc_async`` or
    ``remote``, the thread that called it is free as soon as it returns the
    future; the reply goes out when the future is done (its value, or its
    exception), and the caller's timeout counts that wait. So a callee can
    chain further calls with ``then()`` instead of blocking a thread on
    them. If a decorated function returns anything but an
    :class:`aiopar.Future` (or a coroutine, awaited on the callee) there,
    the caller gets a TypeError that says so. As in torch, stack it under ``@staticmethod`` or
    ``@classmethod``, and use it on methods of a class whose instances live
    behind an :class:`~aiopar.rpc.RRef`.

    The returned function calls ``fn`` and returns what it returns, so a
    local call behaves as an undecorated one. (A callee replies with the
    outcome of any :class:`aiopar.Future` it returns, decorated or not: the
    decorator adds the check above, and keeps code written for torch, which
    requires it, as it is.) Raises TypeError at once if ``fn`` is not
    callable.
    """
    if not callable(fn):
        raise TypeError(f"async_execution decorates a function, got {type(fn).__name__}")

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    # torch's marker: bound methods forward attribute lookups to it, so
    # static, class and instance methods are recognised alike.
    wrapper._wrapped_async_rpc_function = fn  # type: ignore[attr-defined]
    return wrapper  # type: ignore[return-value]
