"""Which script this process runs as ``__main__``: functions of it travel by name to its twins.

torch's rpc pickles a function by name, and the callee finds it in its own
modules: a function of the caller's ``__main__`` runs as the callee's own
``__main__`` has it, module state included (a counter of calls counts
every call; a module-level lock is the callee's). That holds when every
rank runs the same script, as torch's jobs do. Each peer tells the
scheduler which script it runs (a hash of the file's contents); a call
to a peer that runs the same one sends what it holds of ``__main__`` by
name. To any other peer, such a function travels by value (cloudpickle),
with copies of the globals it uses.
"""

from __future__ import annotations

import functools
import hashlib
import sys

__all__ = ["script_identity"]


@functools.cache
def script_identity() -> str | None:
    """The SHA-256 of the file this process runs as ``__main__`` (read once,
    when first asked), or None if it runs none (``python -c``, a notebook,
    a REPL, stdin) or cannot read it."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(path, str):
        return None
    try:
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    except OSError:
        return None
