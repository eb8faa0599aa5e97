"""aiopar on dask.distributed: the "dask" backend and the engine of aiopar.rpc."""

from ._backend import DaskBackend

__all__ = ["DaskBackend"]
