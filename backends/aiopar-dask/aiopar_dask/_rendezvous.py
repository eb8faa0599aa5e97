"""torch's ``tcp://`` rendezvous on dask: rank 0 starts the scheduler there, the others join it.

``init_rpc`` hands the engine ``tcp://host:port`` for torch's ``env://``
and ``tcp://`` alike. Rank 0 starts a dask scheduler listening there (on
that host only: loopback for ``localhost``), unless a dask scheduler
answers there already (one the user started: rank 0 then joins it as the
others do). Every other rank joins, and tries again while nothing listens
there, until its ``rpc_timeout``: the ranks may start in any order.

Closed by default: the scheduler rank 0 starts uses TLS with certificates
made as it starts, unless the options give a ``Security`` (the user's
certificates, which every rank then gives) or False (no TLS, for every
rank). The ranks of rank 0's machine find those certificates where rank 0
left them for them alone (``_credentials``); a rank of another machine
cannot, and is told to give certificates of the user's own.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
import time

from distributed import Security, SpecCluster
from distributed.comm.addressing import parse_address, parse_host_port

from . import _credentials
from ._cluster import cluster_security, scheduler_spec
from ._reach import RETRY, TLS_ADVICE, check_scheduler, listener

__all__ = ["HELD_TIMEOUT", "RendezvousScheduler", "endpoint", "host", "join", "join_held"]

RENDEZVOUS_TLS_ADVICE = (
    f"{TLS_ADVICE}; or security=False to every rank, for no TLS (the scheduler that rank 0 "
    f"starts at a tcp:// rendezvous makes its certificates as it starts, and only the ranks "
    f"of rank 0's machine can read them)"
)


def from_environment(address: str) -> bool:
    """Whether ``address`` is torch's ``env://`` rendezvous,
    ``tcp://MASTER_ADDR:MASTER_PORT`` of this process's environment."""
    where = endpoint(address)
    master = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return where is not None and (where[0], str(where[1])) == master


def endpoint(address: str) -> tuple[str, int] | None:
    """The host and port of a ``tcp://`` address (dask reads one without a
    scheme as ``tcp://``), or None for another scheme (``tls://``)."""
    scheme, location = parse_address(address)
    if scheme != "tcp":
        return None
    host, port = parse_host_port(location)
    return host, port


class RendezvousScheduler(SpecCluster):
    """The scheduler rank 0 starts at a rendezvous, alone (no workers). The
    certificates it made for the ranks of its machine go as it closes."""

    def __init__(self, host: str, port: int, security: Security | None, shared: bool) -> None:
        super().__init__(  # type: ignore[no-untyped-call]
            scheduler=scheduler_spec(security, host, port),
            workers={},
            security=security,
            asynchronous=True,
            silence_logs=logging.WARN,
            name="aiopar.rpc",
        )
        self._where = (host, port)
        self._shared = shared

    async def _close(self) -> None:
        try:
            await super()._close()  # type: ignore[no-untyped-call]
        finally:
            if self._shared:
                _credentials.discard(*self._where)


async def host(address: str, security: Security | bool | None) -> RendezvousScheduler | None:
    """For rank 0: start the scheduler at the ``tcp://`` ``address``, unless
    something listens there already (then None: rank 0 joins what is there).

    Its security is ``security``, or none for False, or TLS with
    certificates made now for None, which the ranks of this machine then
    find (a file of this user's). Raises OSError naming the address if the
    scheduler cannot start there.
    """
    where = endpoint(address)
    assert where is not None
    if await _listening(address, *where):
        return None
    made = cluster_security(security)
    shared = security is None
    if shared:  # before the scheduler listens: a rank that reaches it finds them
        assert made is not None
        _credentials.save(*where, made)
    else:  # a file there is another job's: these ranks give their own (or none)
        _credentials.discard(*where)
    cluster = RendezvousScheduler(*where, made, shared)
    try:
        await cluster
    except BaseException as exc:
        await cluster.close()  # type: ignore[misc]  # (removes the certificates too)
        if isinstance(exc, Exception):
            raise _cannot_start(address, exc.__cause__ or exc) from exc
        raise
    return cluster


def _cannot_start(address: str, why: BaseException) -> OSError:
    return OSError(
        f"rank 0 cannot start the rendezvous at {address} ({type(why).__name__}: {why}); "
        f"MASTER_ADDR (or the tcp:// address) must name rank 0's own machine, and "
        f"MASTER_PORT (or the port) one free there"
    )


async def join(
    address: str, security: Security | bool | None, timeout: float, *, closed: bool = True
) -> tuple[str, Security | None]:
    """The scheduler at ``address`` to join, as dask reaches it (see
    ``check_scheduler``: ``tls://`` for a TLS scheduler at a ``tcp://``
    address), and the security to join it with: ``security`` itself, none
    for False, and for None, at a ``tcp://`` address, the certificates
    rank 0 left for the ranks of this machine, if it did.

    Closed by default (unless ``closed`` is False): at ``env://``'s
    rendezvous with the default security (None), a scheduler without TLS
    is no scheduler of this job's rank 0, which starts its own with TLS:
    OSError names the port and what holds it.

    Waits up to ``timeout`` seconds (0 or more than a lock can wait: no
    limit) while nothing listens there. Raises TimeoutError if nothing
    does by then, and what ``check_scheduler`` raises if no dask scheduler
    answers, or it takes TLS and this process has no certificates for it.
    """
    limited = 0 < timeout <= threading.TIMEOUT_MAX
    deadline = time.monotonic() + timeout if limited else None
    where = endpoint(address)
    found: Security | None = None
    if isinstance(security, Security):
        found = security
    elif security is None and where is not None:
        found = await _certificates_of_rank_0(address, where, deadline)
    left = 0.0 if deadline is None else max(deadline - time.monotonic(), 0.001)
    advice = {"tls_advice": RENDEZVOUS_TLS_ADVICE} if where is not None else {}
    reached = await check_scheduler(
        address, found, left, role="worker", **advice
    )  # a peer is a worker
    if closed and security is None and reached.startswith("tcp://") and from_environment(address):
        raise OSError(_not_this_jobs(address, "a dask scheduler without TLS"))
    return reached, found


def _not_this_jobs(address: str, what: str) -> str:
    return (
        f"{what} holds the rendezvous at {address} (MASTER_ADDR:MASTER_PORT), and this "
        f"job's rank 0 did not start it (with default security, the scheduler rank 0 "
        f"starts there takes TLS): a rank never joins a scheduler its job did not start, "
        f"as torch's rendezvous fails with 'address in use'. Give MASTER_PORT a port free "
        f"on rank 0's machine; to join a scheduler of your own on purpose, give every rank "
        f"its address as init_method, or security=False (or your distributed.Security)"
    )


HELD_TIMEOUT = 5.0  # seconds a dask scheduler already at rank 0's rendezvous has to answer


async def join_held(address: str, security: Security | bool | None) -> tuple[str, Security | None]:
    """For rank 0, which found the ``tcp://`` ``address`` held: :func:`join`
    the dask scheduler there (one the user started, which answers at
    once), or raise OSError within :data:`HELD_TIMEOUT` seconds naming the
    port and what holds it, where other ranks would wait their timeout.
    Closed by default: at ``env://``'s rendezvous with the default
    security (None), rank 0 joins no scheduler at all there (OSError)."""
    try:
        reached, found = await join(address, security, HELD_TIMEOUT, closed=False)
    except OSError as exc:
        raise OSError(
            f"rank 0 cannot start the rendezvous at {address}: something holds that port, "
            f"and it is no dask scheduler that this process can join ({exc}); a server that "
            f"accepts and stays silent may be a torch TCPStore (torch.distributed's "
            f"init_process_group on the same MASTER_PORT). MASTER_PORT (or the port) must be "
            f"free on rank 0's machine"
        ) from exc
    if security is None and from_environment(address):
        raise OSError(_not_this_jobs(address, f"a dask scheduler ({reached})"))
    return reached, found


async def _certificates_of_rank_0(
    address: str, where: tuple[str, int], deadline: float | None
) -> Security | None:
    """Once something listens at ``where``: the certificates rank 0 left
    for the ranks of this machine, if it did (None: no file, so a
    scheduler of another machine, or of the user's; or a dead rank 0's
    file beside a server that speaks no TLS). Tries again while the
    connection is refused, until ``deadline``."""
    start = time.monotonic()
    while True:
        # A file there may be a dead rank 0's, so it is read again once
        # something listens: rank 0 writes it before its scheduler does,
        # and its scheduler always takes TLS.
        found = _credentials.load(*where)
        context = None if found is None else found.get_connection_args("client")["ssl_context"]
        try:
            tls = await listener(*where, deadline, context)
            if tls is not None:
                return None if found is not None and not tls else _credentials.load(*where)
        except (TimeoutError, socket.gaierror):
            return found  # check_scheduler says what is there
        if deadline is not None and time.monotonic() + RETRY >= deadline:
            raise TimeoutError(
                f"no dask scheduler at {address}: the connection was refused for "
                f"{time.monotonic() - start:.3g} s, nothing listens there (at a tcp:// "
                f"rendezvous, rank 0 starts the scheduler: has it started?)"
            )
        await asyncio.sleep(RETRY)


async def _listening(address: str, host: str, port: int) -> bool:
    """Whether something accepts connections at ``host:port``. Raises
    OSError naming ``address`` if that cannot be told (an unknown host
    name, or one that no connection reaches)."""
    try:
        async with asyncio.timeout(5):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return False
    except (OSError, TimeoutError) as exc:
        raise _cannot_start(address, exc) from exc
    writer.close()
    return True
