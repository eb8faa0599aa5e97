"""aiopar on dask.distributed: the "dask" backend and the engine of aiopar.rpc."""

# ruff: noqa: E402  (the check comes before anything imports dask)
from ._shadow import check_not_shadowed

check_not_shadowed()

from ._agent import COMPENSATION_LIMIT, DaskRpcAgent
from ._backend import DaskBackend
from ._engine import rpc_engine
from ._peer import Peer

__all__ = ["COMPENSATION_LIMIT", "DaskBackend", "DaskRpcAgent", "Peer", "rpc_engine"]
