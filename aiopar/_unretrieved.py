"""The report of a failure that nobody read, logged when its future goes."""

from __future__ import annotations

from typing import Any

from ._log import logger

__all__ = ["Unretrieved"]


class Unretrieved:
    """Logs ``exception``, the failure of ``fut``, on the ``aiopar`` logger
    when it is collected with the future that holds it, unless it was read
    first (``exception`` set to None), as asyncio's "exception was never
    retrieved" does."""

    __slots__ = ("exception", "future_repr")

    def __init__(self, fut: Any, exception: BaseException) -> None:
        self.exception: BaseException | None = exception
        # Not repr(fut): the future is still being settled.
        self.future_repr = f"<aiopar.{type(fut).__name__} at {id(fut):#x}>"

    def __del__(self) -> None:
        exc = self.exception
        if exc is not None:
            logger.error(
                "%s failed and nobody retrieved its exception (wait(), value(), exception() "
                "or await would have raised it):",
                self.future_repr,
                exc_info=(type(exc), exc, exc.__traceback__),
            )
