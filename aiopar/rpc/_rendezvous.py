"""Where the ranks of a job meet: torch's ``init_method``, read as torch reads it.

torch's default ``init_method`` is ``env://``: the rendezvous is at
``MASTER_ADDR:MASTER_PORT``, and the variables ``RANK`` and ``WORLD_SIZE``
stand for the arguments not given. ``tcp://host:port`` names the place
itself. Either way the engine is handed ``tcp://host:port``: rank 0
starts the rendezvous there, and the other ranks join it. With neither
(no ``init_method``, and neither variable set), ``init_rpc`` starts a world
of its own, the embedded cluster, which only rank 0 may do.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

__all__ = ["ENV", "MASTER_VARIABLES", "Rendezvous", "rendezvous"]

ENV = "env://"
MASTER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT")


class Rendezvous(NamedTuple):
    """What ``init_rpc`` hands its engine: the scheduler's address (None:
    start an embedded cluster), this process's rank and the world's size."""

    init_method: str | None
    rank: int | None
    world_size: int | None


def rendezvous(
    init_method: str | None,
    rank: int | None,
    world_size: int | None,
    environ: Mapping[str, str] = os.environ,
) -> Rendezvous:
    """Read ``init_method`` as torch does, ``env://`` from ``environ``.

    No ``init_method`` means ``env://`` when ``MASTER_ADDR`` or
    ``MASTER_PORT`` is set, else an embedded cluster. For ``env://``, a
    ``rank`` or ``world_size`` that is None is read from ``RANK`` or
    ``WORLD_SIZE`` if set. Raises ValueError naming the variable that is
    missing or not a valid number, and for a rank other than 0 that would
    start a world of its own.
    """
    if init_method is None and any(environ.get(v) for v in MASTER_VARIABLES):
        init_method = ENV
    if init_method == ENV:
        init_method = _master_address(environ)
        if rank is None:
            rank = _number(environ, "RANK", minimum=0)
        if world_size is None:
            world_size = _number(environ, "WORLD_SIZE", minimum=1)
    if rank and init_method is None:
        what = (
            f"rank {rank} needs a world_size > {rank} and the rendezvous that rank 0 starts"
            if world_size is None
            else f"rank {rank} joins the rendezvous that rank 0 starts"
        )
        raise ValueError(
            f"{what}, and none is given: set MASTER_ADDR and MASTER_PORT to rank 0's "
            f"address and a free port "
            f"there (init_method 'env://', torch's default), or give every rank "
            f"rpc_backend_options=RpcBackendOptions(init_method='tcp://host:port'); only "
            f"rank 0 (or a call without a rank) starts a world of its own, an embedded cluster"
        )
    return Rendezvous(init_method, rank, world_size)


def _master_address(environ: Mapping[str, str]) -> str:
    missing = [v for v in MASTER_VARIABLES if not environ.get(v)]
    if missing:
        raise ValueError(
            f"init_method 'env://' (torch's default, taken when MASTER_ADDR or MASTER_PORT "
            f"is set) finds the rendezvous in the environment variables MASTER_ADDR and "
            f"MASTER_PORT, and {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            f"not set: set both to rank 0's address and a free port there, or give "
            f"rpc_backend_options=RpcBackendOptions(init_method='tcp://host:port')"
        )
    host, port = environ["MASTER_ADDR"], environ["MASTER_PORT"]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"MASTER_PORT must be a port number (1 to 65535), got {port!r}")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _number(environ: Mapping[str, str], variable: str, minimum: int) -> int | None:
    value = environ.get(variable)
    if not value:
        return None
    if not value.isdigit() or int(value) < minimum:
        raise ValueError(
            f"the environment variable {variable} (read for init_method 'env://') must be "
            f"a whole number >= {minimum}, got {value!r}"
        )
    return int(value)
