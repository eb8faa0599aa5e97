"""aiopar on dask.distributed: the "dask" backend and the engine of aiopar.rpc."""

from ._agent import COMPENSATION_LIMIT, DaskRpcAgent
from ._backend import DaskBackend
from ._engine import rpc_engine
from ._peer import Peer

__all__ = ["COMPENSATION_LIMIT", "DaskBackend", "DaskRpcAgent", "Peer", "rpc_engine"]
