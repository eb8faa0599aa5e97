"""Argument checks shared by the public calls: each refuses a bad value at the
call that made it, naming what was wrong and what would be right.

A leaf module: it imports nothing of aiopar.
"""

from __future__ import annotations

__all__ = ["check_count", "check_initializer"]


def check_count(n: object, what: str, *, minimum: int = 1, none: str | None = None) -> None:
    """Refuse ``n`` unless it is a whole number >= ``minimum`` (or None, if
    ``none`` says what None means)."""
    if n is None and none is not None:
        return
    if not isinstance(n, int) or isinstance(n, bool) or n < minimum:
        alternative = f" or None ({none})" if none is not None else ""
        raise ValueError(f"{what} must be a whole number >= {minimum}{alternative}, got {n!r}")


def check_initializer(initializer: object) -> None:
    """Refuse a pool's ``initializer`` unless it is callable or None."""
    if initializer is not None and not callable(initializer):
        raise TypeError(f"initializer must be a callable or None, got {type(initializer).__name__}")
