"""A peer: a ``distributed.Worker`` that also serves rpc calls.

dask runs the processes (nannies restart dead peers of an embedded
cluster) and the scheduler lists each peer's name, id and rpc port. The
scheduler is only the phone book: a peer whose process called ``init_rpc``
goes on serving and calling the peers it knows when the scheduler is gone
(a dask worker would close itself). A peer that ``aiopar worker`` or a
nanny runs leaves then, as dask workers do.

A peer runs no dask task, from the peers' clients or any other client of
its scheduler, unless it is asked to (``run_tasks``): a trainer is no
ordinary worker. It tells the scheduler that it is paused, dask's own
"give me no new task" (the scheduler assigns tasks to running workers
only, also tasks restricted to the paused one), from the moment it
registers, and it has no memory pause of its own to resume from.

The peers of a cluster share a secret that each connection between them
proves (see ``_wire``): ``init_rpc`` gives its embedded cluster's peers one,
and the first peer to join a scheduler makes it and leaves it in the
scheduler's metadata, where the others find it.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import distributed
from distributed.comm.core import Comm
from distributed.core import Status

from aiopar.rpc.agent import DEFAULT_RPC_TIMEOUT, set_current_agent

from . import _wire
from ._agent import DaskRpcAgent
from ._cluster import ClusterWorker
from ._script import script_identity

__all__ = ["SECRET_KEY", "Peer"]

SECRET_KEY = "aiopar-rpc-secret"  # the scheduler's metadata key for the cluster's secret

_logger = logging.getLogger("aiopar.rpc")


class _Value:
    """A startup_information entry (a picklable callable, as dask requires)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, worker: Any) -> Any:
        return self.value


def _rpc_port(worker: Peer) -> int:
    return worker.rpc_agent.port


def _rpc_local(worker: Peer) -> str | None:
    return worker.rpc_agent.local


class Peer(ClusterWorker):
    """A dask worker that is also an rpc peer, named ``name`` with id
    ``peer_id``: its rank, or a negative id for a peer without one.

    ``joined`` marks a peer whose process called ``init_rpc``: graceful
    shutdown waits for those, and they outlive the scheduler. ``rpc_timeout``
    is the default timeout of the calls made from this process.
    ``rpc_secret`` is the cluster's secret; without it, the peer takes the
    one in the scheduler's metadata (making it if it is the first). With
    ``run_tasks``, it also runs dask tasks as any worker does.
    """

    def __init__(
        self,
        *args: Any,
        peer_id: int,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        joined: bool = False,
        rpc_secret: bytes | None = None,
        run_tasks: bool = False,
        **kwargs: Any,
    ) -> None:
        token = uuid.uuid4().hex
        self.rpc_secret = rpc_secret
        self.run_tasks = run_tasks  # (before the worker sets its status)
        kwargs["startup_information"] = {
            **kwargs.get("startup_information", {}),
            "aiopar_id": _Value(peer_id),
            "aiopar_joined": _Value(joined),
            "aiopar_token": _Value(token),
            "aiopar_rpc_port": _rpc_port,
            "aiopar_rpc_local": _rpc_local,
            "aiopar_script": _Value(script_identity()),
        }
        kwargs["plugins"] = (*kwargs.get("plugins", ()), _Listen())
        super().__init__(*args, **kwargs)
        if not run_tasks:  # nothing to pause for memory, nor to resume from
            self.memory_manager.memory_pause_fraction = False
        self.joined = joined
        self.rpc_agent = DaskRpcAgent(self, peer_id, rpc_timeout, token)

    @distributed.Worker.status.setter  # type: ignore[untyped-decorator]
    def status(self, value: Status) -> None:
        if value == Status.running and not self.run_tasks:
            value = Status.paused  # what the scheduler hears as it registers: no task comes
        distributed.Worker.status.__set__(self, value)

    async def start_unsafe(self) -> Peer:
        await super().start_unsafe()  # type: ignore[no-untyped-call]
        set_current_agent(self.rpc_agent)
        return self

    async def handle_scheduler(self, comm: Comm) -> None:
        if not self.joined:
            await super().handle_scheduler(comm)  # closes this worker when the scheduler goes
            return
        try:
            await self.handle_stream(comm)
        finally:
            if self.status in (Status.running, Status.paused):  # the scheduler went
                self._lose_scheduler()
            else:
                await self.close(reason="worker-handle-scheduler-connection-broken")

    def _lose_scheduler(self) -> None:
        """Go on without the scheduler: stop telling it we live, and serve on."""
        for name in ("heartbeat", "keep-alive"):
            callback = self.periodic_callbacks.get(name)
            if callback is not None:
                callback.stop()
        gone = f"the scheduler at {self.scheduler.address} is gone"
        _logger.warning("rpc peer %r: %s; calls to the peers it knows go on", self.name, gone)
        self.rpc_agent.lose_scheduler(gone)

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        if self.joined and kwargs.get("reason") == "scheduler-close":
            # A closing scheduler closes its workers; a peer whose process
            # called init_rpc outlives it (handle_scheduler sees it go), so
            # that a rank whose rank 0 crashed, taking the scheduler along,
            # still calls its peers and shuts down as it means to.
            return None
        self.rpc_agent.stop(RuntimeError(f"rpc peer {self.name!r} is shutting down"))
        return await super().close(*args, **kwargs)


class _Listen(distributed.WorkerPlugin):
    """Listens for calls once the worker knows its address, before the
    scheduler lists it (dask sets plugins up between the two)."""

    name = "aiopar-rpc"

    async def setup(self, worker: Peer) -> None:  # type: ignore[override]
        if worker.rpc_secret is None:
            worker.rpc_secret = await _cluster_secret(worker)
        worker.rpc_agent.listen(worker.ip, worker.rpc_secret)


async def _cluster_secret(worker: Peer) -> bytes:
    """The secret in the scheduler's metadata; the first peer makes it
    (under a dask lock, so two peers joining at once find the same)."""
    scheduler = worker.scheduler
    async with distributed.Lock(SECRET_KEY, scheduler_rpc=scheduler, loop=worker.loop):
        found = await scheduler.get_metadata(keys=[SECRET_KEY], default=None)
        if found is not None:
            return bytes.fromhex(found)
        secret = _wire.new_secret()
        await scheduler.set_metadata(keys=[SECRET_KEY], value=secret.hex())
        return secret
