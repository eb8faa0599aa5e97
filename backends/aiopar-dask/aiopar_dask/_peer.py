"""A peer: a ``distributed.Worker`` that also serves rpc calls.

dask runs the processes (nannies restart dead peers of an embedded
cluster) and the scheduler lists each peer's name, rank and rpc port.
"""

from __future__ import annotations

import uuid
from typing import Any

import distributed

from aiopar.rpc.agent import DEFAULT_RPC_TIMEOUT, set_current_agent

from ._agent import DaskRpcAgent

__all__ = ["Peer"]


class _Value:
    """A startup_information entry (a picklable callable, as dask requires)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, worker: Any) -> Any:
        return self.value


def _rpc_port(worker: Peer) -> int:
    return worker.rpc_agent.port


class Peer(distributed.Worker):
    """A dask worker that is also an rpc peer, named ``name`` with id ``rank``.

    ``joined`` marks a peer whose process called ``init_rpc``: graceful
    shutdown waits for those. ``rpc_timeout`` is the default timeout of the
    calls made from this process.
    """

    def __init__(
        self,
        *args: Any,
        rank: int,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT,
        joined: bool = False,
        **kwargs: Any,
    ) -> None:
        self.rpc_token = uuid.uuid4().hex
        kwargs["startup_information"] = {
            **kwargs.get("startup_information", {}),
            "aiopar_rank": _Value(rank),
            "aiopar_joined": _Value(joined),
            "aiopar_token": _Value(self.rpc_token),
            "aiopar_rpc_port": _rpc_port,
        }
        kwargs["plugins"] = (*kwargs.get("plugins", ()), _Listen())
        super().__init__(*args, **kwargs)
        self.rpc_agent = DaskRpcAgent(self, rank, rpc_timeout)

    async def start_unsafe(self) -> Peer:
        await super().start_unsafe()
        set_current_agent(self.rpc_agent)
        return self

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        self.rpc_agent._stop(RuntimeError(f"rpc peer {self.name!r} is shutting down"))
        return await super().close(*args, **kwargs)


class _Listen(distributed.WorkerPlugin):
    """Listens for calls once the worker knows its address, before the
    scheduler lists it (dask sets plugins up between the two)."""

    name = "aiopar-rpc"

    def setup(self, worker: Peer) -> None:  # type: ignore[override]
        worker.rpc_agent._listen(worker.ip)
