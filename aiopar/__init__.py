"""aiopar: TorchScript-style fork/wait parallelism for plain Python, asyncio-native.

``fork(fn, *args)`` starts work and returns a :class:`Future` at once; the
future can be waited on in a script (``wait``), awaited on asyncio, uvloop or
trio, or chained with ``then``. Backends decide where the work runs.
"""

# The profiler is a submodule of the public API (aiopar.profiler.profile());
# loading it registers its recorder with the seam the task machinery reads.
from . import profiler as profiler
from ._api import (
    TaskGroup,
    as_completed,
    collect_all,
    drain,
    fork,
    map,
    task_group,
    wait,
    wait_all,
    wrap,
)
from ._budget import (
    get_num_interop_threads,
    get_num_threads,
    num_threads,
    set_num_interop_threads,
    set_num_threads,
)
from ._config import get_backend, set_backend, use_backend
from ._errors import BrokenWorkerError, CancelledError, InvalidStateError
from ._executor import Executor
from ._future import Future
from ._info import parallel_info
from ._parallel import in_parallel_region, parallel_for
from .backends import Backend, available_backends

__version__ = "0.1.0"

__all__ = [
    "Backend",
    "BrokenWorkerError",
    "CancelledError",
    "Executor",
    "Future",
    "InvalidStateError",
    "TaskGroup",
    "as_completed",
    "available_backends",
    "collect_all",
    "drain",
    "fork",
    "get_backend",
    "get_num_interop_threads",
    "get_num_threads",
    "in_parallel_region",
    "map",
    "num_threads",
    "parallel_for",
    "parallel_info",
    "set_backend",
    "set_num_interop_threads",
    "set_num_threads",
    "task_group",
    "use_backend",
    "wait",
    "wait_all",
    "wrap",
]
