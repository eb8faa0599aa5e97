"""The engine behind ``aiopar.rpc``: ``init_rpc`` and ``aiopar worker`` start peers here.

``init_rpc`` without a scheduler address starts an embedded cluster (its
other peers in nannies, everything on loopback); with one, it joins that
scheduler, which rank 0 starts at a ``tcp://`` rendezvous if none answers
there (``_rendezvous``). Either way this process's :class:`~._peer.Peer`
runs on an event loop in a thread of its own, and leaves at exit if
``rpc.shutdown()`` was not called.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import signal
import sys
import threading
import weakref
from collections.abc import Coroutine
from typing import Any

import distributed
from distributed import Security, SpecCluster
from distributed.core import rpc
from tornado.ioloop import IOLoop

from aiopar.lowlevel import at_exit
from aiopar.rpc.agent import (
    RpcBackendOptions,
    TlsFiles,
    current_agent_or_none,
    set_current_agent,
)

from . import _rendezvous, _rounds, _wire
from ._agent import DaskRpcAgent, close_peer
from ._cluster import LOOPBACK, FreshNanny, cluster_security, scheduler_spec
from ._peer import SECRET_KEY, Peer
from ._rendezvous import endpoint
from ._torchrun import agent_store, meet

__all__ = ["rpc_engine"]

_logger = logging.getLogger("aiopar.rpc")


def _peer_options(
    peer_id: int, joined: bool, options: RpcBackendOptions, secret: bytes | None
) -> dict[str, Any]:
    return {
        "peer_id": peer_id,
        "joined": joined,
        "rpc_secret": secret,
        "rpc_timeout": options.rpc_timeout,
        "run_tasks": options.run_tasks,
        "nthreads": options.num_worker_threads,
        "security": options.security,
        "silence_logs": logging.WARN,  # as quiet as a LocalCluster
    }


def _host_towards(address: str) -> str:
    """The local IP that reaches ``address``: 127.0.0.1 for a loopback scheduler."""
    from distributed.comm.addressing import get_address_host
    from distributed.utils import get_ip

    ip: str = get_ip(get_address_host(address))
    return ip


class _Parts:
    """What ``init_rpc`` has started so far: stopped again if it fails."""

    def __init__(self) -> None:
        self.peer: Peer | None = None
        self.cluster: SpecCluster | None = None


async def _start_peer(
    address: str,
    name: str,
    rank: int | None,
    joined: bool,
    options: RpcBackendOptions,
    parts: _Parts | None = None,
    secret: bytes | None = None,
    world_size: int | None = None,
) -> Peer:
    """Start this process's :class:`Peer` on the scheduler at ``address``.

    Without a rank, a peer that joins (``init_rpc``) takes the smallest
    rank free, and one that only serves (``aiopar worker``) takes no rank:
    its id is negative (-1, -2, ...), so it never stands in for a rank of
    ``world_size``. A peer with a rank joins the rendezvous of its job (see
    ``_rounds``), which ``world_size`` is the size of. Ids are chosen, and
    rounds entered, under a dask lock, so two peers joining at once do not
    take the same. The peer is noted in ``parts`` as soon as it exists.
    Without ``secret``, the peer takes the cluster's from the scheduler.
    """
    kwargs = {
        **_peer_options(0, joined, options, secret),
        "name": name,
        "host": _host_towards(address),
    }

    def new_peer(peer_id: int) -> Peer:
        peer = Peer(address, **{**kwargs, "peer_id": peer_id})
        if parts is not None:
            parts.peer = peer
        return peer

    if rank is not None:
        peer = await _registered(new_peer(rank), name)
        others = await peer.scheduler.identity(n_workers=-1)
        clash = [
            w["name"]
            for a, w in others["workers"].items()
            if a != peer.address and w.get("aiopar_id") == rank
        ]
        if clash:
            await peer.close(reason="rank taken")
            raise ValueError(
                f"rank {rank} is taken by rpc peer {clash[0]!r}; give each a rank of its own"
            )
        async with distributed.Lock(_rounds.LOCK, scheduler_rpc=peer.scheduler, loop=peer.loop):
            await _enter_round(peer, rank, world_size)
    else:
        security = options.security or Security()  # (what a worker uses without one)
        async with (
            rpc(address, connection_args=security.get_connection_args("worker")) as scheduler,
            distributed.Lock(_rounds.LOCK, scheduler_rpc=scheduler, loop=IOLoop.current()),
        ):
            identity = await scheduler.identity(n_workers=-1)
            taken = {w["aiopar_id"] for w in identity["workers"].values() if "aiopar_id" in w}
            ids = itertools.count(0) if joined else itertools.count(-1, -1)
            peer = await _registered(new_peer(next(i for i in ids if i not in taken)), name)
            if joined:
                await _enter_round(peer, peer.rpc_agent.worker_info.id, world_size)
    return peer


async def _enter_round(peer: Peer, rank: int, world_size: int | None) -> None:
    agent = peer.rpc_agent
    agent.round = await _rounds.enter(peer.scheduler, agent.token, rank, world_size)


async def _registered(peer: Peer, name: str) -> Peer:
    try:
        started: Peer = await peer
        return started
    except Exception as exc:
        if "name taken" in str(exc) or "name taken" in str(exc.__cause__):
            raise ValueError(
                f"an rpc peer called {name!r} is in the cluster already; names are unique"
            ) from None
        raise


async def _start(
    name: str,
    rank: int | None,
    world_size: int | None,
    options: RpcBackendOptions,
    parts: _Parts,
) -> DaskRpcAgent:
    """Start this process's peer (and the embedded cluster, or the scheduler
    of a rendezvous), noting each in ``parts``; the caller stops them if
    this raises."""
    address = options.init_method
    secret = None
    if address is None:
        secret = _wire.new_secret()
        address = await _start_embedded(
            name, 0 if rank is None else rank, world_size, options, secret, parts
        )
    else:
        store = None
        if rank is not None:
            store = await asyncio.to_thread(agent_store, address, options.rpc_timeout)
        hosted = held = None
        if store is not None and rank is not None:  # torchrun started this job, and holds it
            hosted, address = await meet(
                store, rank, address, options.security, options.rpc_timeout
            )
        elif rank == 0 and endpoint(address) is not None:
            hosted = await _rendezvous.host(address, options.security)
            held = hosted is None  # something holds the port: join_held says what, or joins
        parts.cluster = hosted
        if hosted is not None:
            address, security = hosted.scheduler_address, hosted.security
        elif held:
            address, security = await _rendezvous.join_held(address, options.security)
        else:
            address, security = await _rendezvous.join(
                address, options.security, options.rpc_timeout
            )
        options = dataclasses.replace(options, security=security)
    joining = options.init_method is not None
    peer = await _start_peer(
        address, name, rank, True, options, parts, secret, world_size if joining else None
    )
    agent = peer.rpc_agent
    agent.cluster = parts.cluster
    if world_size is not None and joining:
        assert agent.round is not None
        waiting = _rounds.wait_for_ranks(
            peer.scheduler, agent.round, world_size, options.rpc_timeout
        )
        try:
            met = await agent.unless_scheduler_lost(waiting)
        except TimeoutError:  # an OSError too: the ranks did not come in time
            raise
        except OSError as exc:  # its connection broke before the scheduler counted as lost
            agent.lose_scheduler(f"the scheduler went away ({type(exc).__name__}: {exc})")
            met = False
        if not met:
            raise ConnectionError(
                f"init_rpc: the scheduler at {address} went away while this rank waited for "
                f"ranks 0 to {world_size - 1} to join ({agent.scheduler_gone}); the rank that "
                f"started it (rank 0, at a tcp:// rendezvous) may have crashed"
            )
        await agent.refresh_peers()
    return agent


async def _start_embedded(
    name: str,
    rank: int,
    world_size: int | None,
    options: RpcBackendOptions,
    secret: bytes,
    parts: _Parts,
) -> str:
    """Start the embedded cluster, with a peer of each rank below
    ``world_size`` but ``rank`` (this process's); return its address."""
    others = {f"worker{r}": r for r in range(world_size or 1) if r != rank}
    if name in others:
        raise ValueError(
            f"the embedded cluster names its other peers as torch does ({', '.join(others)}); "
            f"{name!r} is rank {others[name]}'s name: call this peer worker{rank}"
        )
    cluster = parts.cluster = SpecCluster(
        scheduler=scheduler_spec(options.security),
        workers={
            peer_name: {
                "cls": FreshNanny,
                "options": {
                    **_peer_options(peer_rank, False, options, secret),
                    "run_tasks": True,  # the cluster's only workers, which no stranger reaches
                    "name": peer_name,
                    "worker_class": Peer,
                    "host": LOOPBACK,
                },
            }
            for peer_name, peer_rank in others.items()
        },
        security=options.security,
        asynchronous=True,
        silence_logs=logging.WARN,
        name="aiopar.rpc",
    )
    await cluster
    # for peers that join it later (its own got the secret in their options)
    scheduler = cluster.scheduler_comm
    assert scheduler is not None  # (the cluster has started)
    await scheduler.set_metadata(keys=[SECRET_KEY], value=secret.hex())
    address: str = cluster.scheduler_address
    return address


class _LoopThread:
    """The event loop of this process's peer, in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aiopar-rpc-loop")
        self._thread.daemon = True
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and return its result. If this thread is
        interrupted (Ctrl-C) meanwhile, ``coro`` is cancelled, and its
        cleanup has run when the interruption propagates."""
        task: asyncio.Task[Any] | None = None
        finished = threading.Event()

        def start() -> None:
            nonlocal task
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda _: finished.set())

        def cancel() -> None:
            assert task is not None  # start() ran first: the loop runs callbacks in order
            task.cancel()

        self.loop.call_soon_threadsafe(start)
        try:
            finished.wait()
        except BaseException:
            self.loop.call_soon_threadsafe(cancel)
            finished.wait()
            raise
        assert task is not None
        return task.result()

    def stop(self) -> None:
        # dask resolves host names in the loop's default executor: stop its thread too
        self.run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class _Engine:
    """What ``aiopar.rpc`` finds under the ``aiopar.rpc_agents`` entry point."""

    def start(
        self, name: str, rank: int | None, world_size: int | None, options: RpcBackendOptions
    ) -> DaskRpcAgent:
        """Make this process the peer ``name`` (``init_rpc``). An embedded
        cluster, and the scheduler rank 0 starts at a rendezvous, use TLS
        unless the options' ``security`` is False (with certificates made
        now, unless it is a ``Security`` of the user's)."""
        _check_security(options.security)
        if options.init_method is None:
            options = dataclasses.replace(options, security=cluster_security(options.security))
        runner = _LoopThread()
        parts = _Parts()
        try:
            agent: DaskRpcAgent = runner.run(_start(name, rank, world_size, options, parts))
        except BaseException:
            _undo(runner, parts)
            raise
        agent.on_close = runner.stop
        _started.add(agent)
        return agent

    def serve(
        self,
        scheduler: str,
        name: str,
        rank: int | None,
        options: RpcBackendOptions,
        tls: TlsFiles | None = None,
    ) -> None:
        """Run the peer ``name`` on ``scheduler`` in this process until it is
        interrupted (SIGINT, SIGTERM) or the scheduler goes away, saying on
        stderr what it serves once it has joined, and why it stopped (a
        signal while it waits for the scheduler ends the wait; one while
        its peer starts stops the peer as soon as it has started). Its
        TLS is what ``tls`` gives, the rest from dask's configuration, as
        ``dask worker`` takes them (the options' ``security`` wins)."""
        _check_security(options.security)
        if options.security is None:
            options = dataclasses.replace(options, security=_dask_worker_tls(tls or TlsFiles()))

        async def main() -> None:
            loop = asyncio.get_running_loop()
            why: asyncio.Future[str] = loop.create_future()
            # Before joining: from the moment others can see this peer, or
            # read that it serves, a signal stops it cleanly.
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, _settle_once, why, signal.Signals(signum).name)
            # Waiting for the scheduler may take for ever: a signal ends it.
            joining: asyncio.Future[Any] = asyncio.ensure_future(
                _rendezvous.join(scheduler, options.security, options.rpc_timeout)
            )
            await asyncio.wait([why, joining], return_when=asyncio.FIRST_COMPLETED)
            if not joining.done():
                joining.cancel()
                await asyncio.wait([joining])
                _say(f"rpc peer {name!r} stopped before it joined: {why.result()}")
                return
            address, security = joining.result()
            # The peer's start is not cut short (dask logs a cancelled start
            # as an error): a signal meanwhile stops the peer once started.
            joined = dataclasses.replace(options, security=security)
            peer = await _start_peer(address, name, rank, False, joined)
            if not why.done():
                peer_id = peer.rpc_agent.worker_info.id
                which = f"rank {peer_id}" if peer_id >= 0 else f"id {peer_id}, no rank"
                _say(
                    f"rpc peer {name!r} ({which}) serves at {peer.address} "
                    f"for the scheduler at {scheduler}; Ctrl-C or SIGTERM stops it"
                )
                finished = asyncio.ensure_future(peer.finished())  # type: ignore[no-untyped-call]
                await asyncio.wait([why, finished], return_when=asyncio.FIRST_COMPLETED)
                finished.cancel()
            reason = why.result() if why.done() else f"the scheduler at {scheduler} went away"
            await peer.close(reason="aiopar worker stopped")
            _say(f"rpc peer {name!r} stopped: {reason}")

        asyncio.run(main())


def _settle_once(future: asyncio.Future[str], value: str) -> None:
    if not future.done():
        future.set_result(value)


def _say(line: str) -> None:
    sys.stderr.write(f"aiopar worker: {line}\n")
    sys.stderr.flush()


def _check_security(security: object) -> None:
    if security is not None and security is not False and not isinstance(security, Security):
        raise TypeError(
            f"the security of aiopar-dask's rpc_backend_options is a distributed.Security "
            f"(such as Security.temporary()), False for no TLS, or None, "
            f"got {type(security).__name__}"
        )


def _dask_worker_tls(tls: TlsFiles) -> Security | None:
    """The security of ``dask worker --tls-ca-file ... --tls-cert ... --tls-key ...``
    (what is not given comes from dask's configuration); None if neither
    asks for TLS."""
    given = {
        field: value
        for field, value in (
            ("tls_ca_file", tls.ca_file),
            ("tls_worker_cert", tls.cert),
            ("tls_worker_key", tls.key),
        )
        if value is not None
    }
    security = Security(**given)
    configured = security.get_tls_config_for_role("worker")["ca_file"] is not None
    return security if security.require_encryption or configured else None


def _undo(runner: _LoopThread, parts: _Parts) -> None:
    """After a failed start: stop what it started, threads included, and the loop."""
    try:
        runner.run(close_peer(parts.peer, parts.cluster))
        if parts.peer is not None:
            agent = parts.peer.rpc_agent
            agent.join()
            if current_agent_or_none() is agent:  # Peer.start_unsafe made it current
                set_current_agent(None)
    finally:
        runner.stop()


rpc_engine = _Engine()


_started: weakref.WeakSet[DaskRpcAgent] = weakref.WeakSet()


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: its parent's peers are not its own
    to leave at exit (their loop threads do not exist here, and their
    sockets stay the parent's: the child neither uses nor shuts them)."""
    global _started
    for agent in list(_started):
        _disown(agent)
    _started = weakref.WeakSet()


def _disown(agent: DaskRpcAgent) -> None:
    """In the child of a fork, leave to the parent what dask would clean up
    at the child's exit: the peer's and the scheduler's directories, and
    the embedded cluster. (Its nannies are no children of the child, which
    cannot wait for them, so asyncio leaves them alone too.)"""
    servers: list[Any] = [agent.worker]
    cluster = agent.cluster
    if cluster is not None:
        SpecCluster._instances.discard(cluster)
        servers.append(cluster.scheduler)
    for server in servers:
        workdir = getattr(server, "_workdir", None)
        if workdir is not None:
            workdir._finalizer.detach()


os.register_at_fork(after_in_child=_forget_in_child)


def _leave_at_exit() -> None:
    """A peer whose process exits without ``rpc.shutdown()`` leaves anyway,
    its cluster and worker processes too."""
    for agent in list(_started):
        if agent.stopped is None:
            try:
                agent.shutdown(graceful=False)
            except Exception:
                _logger.exception("closing rpc peer %r at exit", agent.worker_info.name)
            if current_agent_or_none() is agent:
                set_current_agent(None)


# Once the tasks queued at exit have run, since they may still make calls.
at_exit(_leave_at_exit)
