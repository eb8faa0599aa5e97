"""The report of a failure that nobody read, logged when its future goes."""

from __future__ import annotations

import logging
from typing import Any

from ._log import logger

__all__ = ["Unretrieved"]


class Unretrieved:
    """Logs ``exception``, the failure of ``fut``, on the ``aiopar`` logger
    when it is collected with the future that holds it, unless it was read
    first (``exception`` set to None), as asyncio's "exception was never
    retrieved" does.

    It logs at ERROR, or at DEBUG once the future was abandoned (see
    :meth:`abandon`); a report made for a future that has not failed yet
    (``exception`` None) waits for its failure.
    """

    __slots__ = ("exception", "future_repr", "level")

    def __init__(self, fut: Any, exception: BaseException | None) -> None:
        self.exception = exception
        # Not repr(fut): the future is still being settled.
        self.future_repr = f"<aiopar.{type(fut).__name__} at {id(fut):#x}>"
        self.level = logging.ERROR

    def abandon(self) -> None:
        """Whoever waited for the future gave up on it (a cancelled ``await``,
        a wait ended by Ctrl-C, a ``cancel()`` that came too late): what it
        would have read is no error of the program's, as the failure of a
        call whose caller was cancelled is none for ``asyncio.to_thread``."""
        self.level = logging.DEBUG

    def __del__(self) -> None:
        exc = self.exception
        if exc is not None:
            logger.log(
                self.level,
                "%s failed and nobody retrieved its exception (wait(), value(), exception() "
                "or await would have raised it)%s:",
                self.future_repr,
                "; whoever waited for it gave up" if self.level < logging.ERROR else "",
                exc_info=(type(exc), exc, exc.__traceback__),
            )
