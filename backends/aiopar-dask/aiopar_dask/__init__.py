"""aiopar on dask.distributed: the "dask" backend and the engine of aiopar.rpc."""

from ._backend import DaskBackend
from ._rpc import DaskRpcAgent, Peer, rpc_engine

__all__ = ["DaskBackend", "DaskRpcAgent", "Peer", "rpc_engine"]
