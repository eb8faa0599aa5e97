"""The certificates rank 0 made for its rendezvous, for the ranks of its machine.

The scheduler that rank 0 starts at a ``tcp://`` rendezvous uses TLS with
certificates made as it starts (``Security.temporary()``), so a process
that is not one of the job's ranks cannot use it. The other ranks need
them: rank 0 writes them to a file named by the rendezvous address, in a
directory of this user's that no one else may enter (0700: the user's
runtime directory, ``$XDG_RUNTIME_DIR``, or one in the temporary
directory), the file readable by this user only (0600). The ranks that
join on this machine read it; ranks on other machines cannot, and need
certificates of the user's own. Rank 0 removes the file as it shuts down.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

from distributed import Security

__all__ = ["directory", "discard", "load", "path", "save"]


def directory() -> Path:
    """This user's directory for rendezvous credentials (not created here)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime, "aiopar")
    return Path(tempfile.gettempdir(), f"aiopar-{os.getuid()}")


def path(host: str, port: int) -> Path:
    """Where the certificates of the rendezvous at ``host:port`` are kept."""
    safe = "".join(c if c.isalnum() or c in ".-" else "_" for c in host)
    return directory() / f"rendezvous-{safe}-{port}.json"


def save(host: str, port: int, security: Security) -> None:
    """Write the certificates of ``security`` (one certificate and key for
    every role, as ``Security.temporary()`` makes) for the rendezvous at
    ``host:port``, replacing what was there. Raises PermissionError if the
    directory is not this user's alone."""
    folder = directory()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(os.lstat(folder), folder, stat.S_ISDIR)
    tls = security.get_tls_config_for_role("worker")
    data = {"ca": tls["ca_file"], "cert": tls["cert"], "key": tls["key"]}
    fd, temporary = tempfile.mkstemp(dir=folder, prefix=".rendezvous-")  # made 0600
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(temporary, path(host, port))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def load(host: str, port: int) -> Security | None:
    """The security that joins the rendezvous at ``host:port``, if rank 0
    wrote its certificates on this machine; None if there is no such file.
    Raises PermissionError for a file (or directory) that another user
    owns or may read."""
    where = path(host, port)
    try:
        fd = os.open(where, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        _check_private(os.lstat(where.parent), where.parent, stat.S_ISDIR)
        _check_private(os.fstat(f.fileno()), where, stat.S_ISREG)
        data = json.load(f)
    cert, key = data["cert"], data["key"]
    roles = {
        f"tls_{role}_{part}": value
        for role in ("client", "scheduler", "worker")
        for part, value in (("cert", cert), ("key", key))
    }
    return Security(require_encryption=True, tls_ca_file=data["ca"], **roles)


def discard(host: str, port: int) -> None:
    """Remove the file of the rendezvous at ``host:port``, if there is one."""
    with contextlib.suppress(FileNotFoundError):
        path(host, port).unlink()


def _check_private(found: os.stat_result, where: Path, is_kind: Callable[[int], bool]) -> None:
    """PermissionError unless ``found`` (the status of ``where``) is a file
    or directory (``is_kind``) of this user's that no one else can use."""
    if not is_kind(found.st_mode) or found.st_uid != os.getuid() or found.st_mode & 0o077:
        raise PermissionError(
            f"{where} holds rendezvous credentials, so it must be this user's and no "
            f"other user's to read or write (mode 0700 for the directory, 0600 for a "
            f"file); it is not, and aiopar does not trust it: remove it"
        )
