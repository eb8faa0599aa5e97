"""torch.distributed.rpc's names on aiopar futures.

Every process that calls :func:`init_rpc` is a named peer; any peer runs
functions on any other with :func:`rpc_sync`, :func:`rpc_async` (an
:class:`aiopar.Future`: wait, await or chain it) and :func:`remote` (an
:class:`RRef` to a value that stays on its owner). ``@functions.async_execution``
lets a callee reply later without holding a thread. The engine that carries
the calls comes from a plugin (``pip install aiopar-dask``); see
:mod:`aiopar.rpc.agent` for what one implements.
"""

from . import functions
from ._api import (
    _set_rpc_timeout as _set_rpc_timeout,  # torch's tests' spelling
)
from ._api import (
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    set_rpc_timeout,
    shutdown,
)
from ._rref import RRef
from .agent import (
    DEFAULT_RPC_TIMEOUT,
    BackendType,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
    WorkerInfo,
)

__all__ = [
    "DEFAULT_RPC_TIMEOUT",
    "BackendType",
    "RRef",
    "RpcBackendOptions",
    "TensorPipeRpcBackendOptions",
    "WorkerInfo",
    "functions",
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "set_rpc_timeout",
    "shutdown",
]
