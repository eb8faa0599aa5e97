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
import socket
import threading
import time
from typing import Any

import dask
from dask.utils import parse_timedelta
from distributed.comm.addressing import parse_address, parse_host_port
from distributed.comm.core import connect

__all__ = ["check_scheduler", "check_scheduler_blocking"]

_RETRY = 0.1  # seconds between tries of a refused connection


async def check_scheduler(address: str, security: Any, timeout: float) -> None:
    """Return once a dask scheduler answers at ``address``, within ``timeout``
    seconds (0, or more than a lock can wait: dask's connect timeout).

    Raises OSError naming ``address`` and what was found there: nothing
    (the connection is refused, or the host name does not resolve), a server
    that accepts and stays silent (TimeoutError), an HTTP server, another
    dask server, or something else that does not speak dask's protocol.
    """
    if not 0 < timeout <= threading.TIMEOUT_MAX:
        timeout = parse_timedelta(dask.config.get("distributed.comm.timeouts.connect"), "s")
    deadline = time.monotonic() + timeout
    scheme, location = parse_address(address)
    endpoint = parse_host_port(location) if scheme in ("tcp", "tls") else None
    if endpoint is not None:
        await _accepts(address, *endpoint, timeout, deadline)
    # Keep a moment to ask what answers, if it is no dask scheduler.
    spare = min(1.0, timeout / 5) if endpoint is not None else 0.0
    connection_args = {} if security is None else security.get_connection_args("client")
    try:
        async with asyncio.timeout(deadline - spare - time.monotonic()):
            comm = await connect(address, timeout=timeout, **connection_args)
            try:
                await comm.write({"op": "identity", "reply": True})
                identity = await comm.read()
            finally:
                comm.abort()
    except Exception as exc:  # silent, or its reply is no dask frame (dask may ask exabytes)
        silent = isinstance(exc, TimeoutError)
        http = None if endpoint is None else await _http_status(*endpoint, deadline)
        if http is not None:
            raise OSError(
                f"no dask scheduler at {address}: an HTTP server answers there ({http!r}); "
                f"a dashboard's port? (a scheduler's is 8786 unless set)"
            ) from None
        if silent:
            raise TimeoutError(
                f"no dask scheduler at {address}: the server there accepted a connection "
                f"and did not answer within {timeout:g} s"
            ) from None
        raise OSError(
            f"no dask scheduler at {address}: what answers there does not speak dask's "
            f"protocol ({type(exc).__name__}: {exc})"
        ) from exc
    kind = identity.get("type") if isinstance(identity, dict) else type(identity).__name__
    if kind != "Scheduler":
        raise OSError(f"no dask scheduler at {address}: a dask {kind} answers there")


async def _accepts(address: str, host: str, port: int, timeout: float, deadline: float) -> None:
    """Return once ``host:port`` accepts a TCP connection; until ``deadline``
    a refused one is tried again (the scheduler may be starting)."""
    while True:
        try:
            async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                _, writer = await asyncio.open_connection(host, port)
            writer.close()
            return
        except TimeoutError:
            raise TimeoutError(
                f"no dask scheduler at {address}: connecting to it took more than {timeout:g} s"
            ) from None
        except socket.gaierror as exc:
            raise OSError(
                f"no dask scheduler at {address}: its host name does not resolve ({exc})"
            ) from exc
        except OSError as exc:
            if time.monotonic() + _RETRY >= deadline:
                raise OSError(
                    f"no dask scheduler at {address}: the connection was refused for "
                    f"{timeout:g} s ({exc.strerror or exc}); nothing listens on that port"
                ) from exc
            await asyncio.sleep(_RETRY)


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


def check_scheduler_blocking(address: str, security: Any, timeout: float) -> None:
    """:func:`check_scheduler` from synchronous code, whether or not this
    thread runs an event loop (it runs in a thread of its own)."""
    failure: list[BaseException] = []

    def look() -> None:
        try:
            asyncio.run(check_scheduler(address, security, timeout))
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=look, name="aiopar-dask-reach", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
