"""The ``aiopar`` logger, whose tracebacks are formatted without parsing source.

Python 3.11 underlines the failing expression of each frame by parsing its
line with :mod:`ast`, and the parser's recursion counter is shared by every
thread (CPython gh-106905): a traceback formatted in a worker thread, or in a
finalizer that runs in the middle of another thread's parse, can leave the
counter wrong, and every later parse in the process (pytest's, or
``torch.jit.script``'s) then fails with "AST constructor recursion depth
mismatch". aiopar logs from worker threads and finalizers, so its records
carry their traceback text ready made, the underlining left out.
"""

from __future__ import annotations

import logging
import traceback

__all__ = ["format_exception", "logger"]


def format_exception(exc: BaseException) -> str:
    """The traceback text of ``exc`` and its causes, without caret lines."""
    top = traceback.TracebackException.from_exception(exc)
    pending, seen = [top], set()
    while pending:
        te = pending.pop()
        if id(te) in seen:
            continue
        seen.add(id(te))
        for frame in te.stack:
            frame.colno = frame.end_colno = None  # no anchors: no parse
        pending.extend(x for x in (te.__cause__, te.__context__) if x is not None)
        pending.extend(te.exceptions or ())
    return "".join(top.format()).rstrip("\n")


def _preformat(record: logging.LogRecord) -> bool:
    exc_info = record.exc_info
    if exc_info and exc_info[1] is not None and not record.exc_text:
        record.exc_text = format_exception(exc_info[1])
    return True


logger = logging.getLogger("aiopar")
logger.addFilter(_preformat)
