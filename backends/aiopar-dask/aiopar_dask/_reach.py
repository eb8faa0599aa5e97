"""Is a dask scheduler at this address? A look before joining it.

dask's own connect retries a refused or unknown address for its whole
connect timeout (30 s, whatever the caller's), waits without limit for the
handshake of a server that accepts and never answers, and reads whatever
answers as its frames (an HTTP reply's first bytes ask it for exabytes).
This look takes at most the caller's timeout and says what it found.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import ssl
import threading
import time
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed.comm.addressing import parse_address, parse_host_port
from distributed.comm.core import connect

__all__ = [
    "TLS_ADVICE",
    "check_scheduler",
    "check_scheduler_blocking",
    "listener",
    "wait_for_listener",
]

RETRY = 0.1  # seconds between tries of a refused connection
SILENT = 10.0  # seconds a server that accepted a connection has to answer, TLS or dask


TLS_ADVICE = (
    "give this process certificates that the scheduler trusts: "
    "RpcBackendOptions(security=distributed.Security(...)) to init_rpc, "
    "use_backend('dask', security=...), or to aiopar worker --tls-ca-file, --tls-cert and "
    "--tls-key (or dask's distributed.comm.tls configuration)"
)


async def check_scheduler(
    address: str,
    security: Any,
    timeout: float,
    *,
    role: str = "client",
    tls_advice: str = TLS_ADVICE,
) -> str:
    """Return the address of the dask scheduler at ``address`` as dask
    reaches it, once it answers, within ``timeout`` seconds (0, or more
    than a lock can wait: dask's connect timeout), reached with
    ``security``'s connection arguments for ``role``.

    A ``tcp://`` address is reached as ``tls://`` when ``security`` has
    certificates and the server there speaks TLS: a scheduler is named by
    its host and port, and the certificates say how to reach it.

    Raises OSError naming ``address`` and what was found there: nothing
    (the connection is refused, or the host name does not resolve), a server
    that accepts and stays silent for :data:`SILENT` seconds (TimeoutError,
    however long ``timeout``: a scheduler answers at once, a torch
    ``TCPStore`` never does), an HTTP server, another
    dask server, a scheduler that takes TLS when this process has no
    certificates, or none when ``security`` requires encryption (each
    message names TLS and ends with ``tls_advice``), or something else
    that does not speak dask's protocol.
    """
    if not 0 < timeout <= threading.TIMEOUT_MAX:
        timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")
    deadline = time.monotonic() + timeout
    scheme, location = parse_address(address)
    endpoint = parse_host_port(location) if scheme in ("tcp", "tls") else None
    connection_args = {} if security is None else security.get_connection_args(role)
    context = connection_args.get("ssl_context")
    if scheme == "tls" and context is None:
        raise OSError(
            f"the scheduler at {address} takes TLS, and this process has no TLS "
            f"certificates: {tls_advice}"
        )
    if endpoint is not None:
        try:
            tls = await wait_for_listener(*endpoint, deadline, context)
        except TimeoutError:
            raise TimeoutError(
                f"no dask scheduler at {address}: connecting to it took more than "
                f"{min(timeout, SILENT):g} s{_SILENT_HINT if context else ''}"
            ) from None
        except socket.gaierror as exc:
            raise OSError(
                f"no dask scheduler at {address}: its host name does not resolve ({exc})"
            ) from exc
        except OSError as exc:
            raise OSError(
                f"no dask scheduler at {address}: the connection was refused for "
                f"{timeout:g} s ({exc.strerror or exc}); nothing listens on that port"
            ) from exc
        if scheme == "tcp" and tls:
            scheme, address = "tls", f"tls://{location}"
    if scheme == "tcp" and connection_args.get("require_encryption"):
        required = "this process's Security requires encryption (require_encryption=True)"
        if context is None:
            raise OSError(
                f"{required} and has no TLS certificates for the scheduler at {address}: "
                f"{tls_advice}; or give a Security without require_encryption"
            )
        raise OSError(
            f"the scheduler at {address} takes no TLS, and {required}: start the "
            f"scheduler with TLS, or give a Security without require_encryption"
        )
    # Keep a moment to ask what answers, if it is no dask scheduler.
    start = time.monotonic()
    answer_by = min(deadline, start + SILENT)
    spare = min(1.0, (answer_by - start) / 5) if endpoint is not None else 0.0
    try:
        async with asyncio.timeout(answer_by - spare - start):
            comm = await connect(address, timeout=timeout, **connection_args)
            try:
                await comm.write({"op": "identity", "reply": True})
                identity = await comm.read()
            finally:
                comm.abort()
    except Exception as exc:  # silent, or its reply is no dask frame (dask may ask exabytes)
        if endpoint is not None:
            await _explain(address, scheme, *endpoint, answer_by, tls_advice)
        if isinstance(exc, TimeoutError):
            raise TimeoutError(
                f"no dask scheduler at {address}: the server there accepted a connection "
                f"and did not answer within {min(timeout, SILENT):g} s{_SILENT_HINT}"
            ) from None
        raise OSError(
            f"no dask scheduler at {address}: what answers there does not speak dask's "
            f"protocol ({type(exc).__name__}: {exc})"
        ) from exc
    kind = identity.get("type") if isinstance(identity, dict) else type(identity).__name__
    if not str(kind).endswith("Scheduler"):  # (aiopar's own are TlsSchedulers)
        raise OSError(f"no dask scheduler at {address}: a dask {kind} answers there")
    return address


_SILENT_HINT = (
    " (a torch TCPStore is silent so: torchrun's, or init_process_group's on the same port)"
)


async def _explain(
    address: str, scheme: str, host: str, port: int, deadline: float, tls_advice: str
) -> None:
    """Where dask's protocol failed: raise OSError saying so if an HTTP server
    answers at ``host:port``, or TLS where this process spoke none (or the
    other way round)."""
    http = await _http_status(host, port, deadline)
    if http is not None:
        raise OSError(
            f"no dask scheduler at {address}: an HTTP server answers there ({http!r}); "
            f"a dashboard's port? (a scheduler's is 8786 unless set)"
        )
    tls = await _speaks_tls(host, port, deadline)
    if tls and scheme == "tcp":
        raise OSError(
            f"the scheduler at {address} takes TLS only (tls://{host}:{port}), and this "
            f"process reached it without: {tls_advice}"
        )
    if tls:
        raise OSError(
            f"the scheduler at {address} refused this process's TLS certificates "
            f"(or is no dask scheduler): {tls_advice}"
        )
    if scheme == "tls":
        raise OSError(
            f"no TLS at {address}: what listens there does not speak TLS (a scheduler "
            f"without TLS is reached at tcp://{host}:{port}, without certificates)"
        )


async def wait_for_listener(
    host: str, port: int, deadline: float | None, context: ssl.SSLContext | None = None
) -> bool:
    """Return once ``host:port`` accepts a connection (see :func:`listener`),
    whether it spoke TLS; until ``deadline`` (``time.monotonic()``; None:
    no limit) one that fails is tried again (the scheduler may be
    starting). Raises TimeoutError if a try outlasts the deadline,
    ``socket.gaierror`` for a host name that does not resolve, and
    ConnectionRefusedError once the deadline has passed."""
    while (tls := await listener(host, port, deadline, context)) is None:
        if deadline is not None and time.monotonic() + RETRY >= deadline:
            raise ConnectionRefusedError(errno.ECONNREFUSED, os.strerror(errno.ECONNREFUSED))
        await asyncio.sleep(RETRY)
    return tls


async def listener(
    host: str, port: int, deadline: float | None, context: ssl.SSLContext | None = None
) -> bool | None:
    """One try: None if nothing accepts a connection at ``host:port``
    (refused, or the connection failed), else whether what accepted spoke
    TLS, which only a try with ``context`` can tell (without one: False).
    With ``context`` the try is a TLS handshake, so that a TLS server is not
    left with a connection that never spoke TLS (dask logs a warning for
    each); a handshake that the server breaks off over certificates or with
    a TLS alert tells a TLS server too. Raises TimeoutError past
    ``deadline``, or after :data:`SILENT` seconds (a server that accepts and
    never answers the handshake), and ``socket.gaierror`` for a host name
    that does not resolve."""
    left = SILENT if deadline is None else min(max(deadline - time.monotonic(), 0), SILENT)
    try:
        async with asyncio.timeout(left):
            _, writer = await asyncio.open_connection(host, port, ssl=context)
    except ssl.SSLError as exc:
        reason = exc.reason or ""
        return "ALERT" in reason or "CERTIFICATE" in reason
    except (TimeoutError, socket.gaierror):
        raise
    except OSError:
        return None
    writer.close()
    return context is not None


async def _speaks_tls(host: str, port: int, deadline: float) -> bool:
    """Whether a TLS server answers at ``host:port``: a handshake that ends,
    or that the server breaks off with a TLS alert (it wanted a certificate)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.5)):
            _, writer = await asyncio.open_connection(host, port, ssl=context)
        writer.close()
        return True
    except ssl.SSLError as exc:
        return "ALERT" in (exc.reason or "")
    except OSError:  # TimeoutError too: what answers is no TLS server
        return False


async def _http_status(host: str, port: int, deadline: float) -> str | None:
    """The status line of an HTTP server at ``host:port``, if one answers by ``deadline``."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(max(deadline - time.monotonic(), 0.05)):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                writer.write(b"HEAD / HTTP/1.0\r\n\r\n")
                line = await reader.readline()
            finally:
                writer.close()
        if line.startswith(b"HTTP/"):
            return line.decode("latin-1").strip()
    return None


def check_scheduler_blocking(address: str, security: Any, timeout: float) -> str:
    """:func:`check_scheduler` from synchronous code, whether or not this
    thread runs an event loop (it runs in a thread of its own)."""
    outcome: list[Any] = []

    def look() -> None:
        try:
            outcome.append(asyncio.run(check_scheduler(address, security, timeout)))
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=look, name="aiopar-dask-reach", daemon=True)
    thread.start()
    thread.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    reached: str = outcome[0]
    return reached
