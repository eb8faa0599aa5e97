"""Under torch's launcher: the ranks meet through torchrun's own store.

``torchrun`` (torch.distributed.run) holds ``MASTER_ADDR:MASTER_PORT``
itself: its agent serves a ``TCPStore`` there and tells its workers so
(``TORCHELASTIC_USE_AGENT_STORE=True``), and torch's own ``env://``
rendezvous reads and writes that store. aiopar's ranks meet the same way:
rank 0 starts the dask scheduler on a free port of ``MASTER_ADDR``'s host
(see ``_rendezvous.host``) and writes its address in the store; the other
ranks read it there and join. torch is installed wherever torchrun runs.
"""

from __future__ import annotations

import asyncio
import datetime
import importlib
import os
import socket
import threading
from typing import Any

from distributed import Security
from distributed.comm.addressing import unparse_host_port

from . import _rendezvous
from ._rendezvous import RendezvousScheduler, endpoint, from_environment

__all__ = ["agent_store", "meet"]

_KEY = "aiopar-rpc/scheduler"  # in the store: the address of the scheduler rank 0 started


def agent_store(address: str, timeout: float) -> Any | None:
    """torchrun's store, a client of it waiting up to ``timeout`` seconds
    (0: no limit) for what it reads, if torchrun started this process and
    serves its store at ``address`` (``tcp://MASTER_ADDR:MASTER_PORT``, as
    ``env://`` reads it); else None. Its keys are this attempt's: a job
    that torchrun restarts meets anew."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or not from_environment(address):
        return None
    where = endpoint(address)
    assert where is not None
    dist: Any = importlib.import_module("torch.distributed")  # (no dependency of this plugin)
    seconds = timeout if 0 < timeout <= threading.TIMEOUT_MAX else 10 * 365 * 86400
    store = dist.TCPStore(*where, is_master=False, timeout=datetime.timedelta(seconds=seconds))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"/aiopar-rpc/attempt_{attempt}", store)


async def meet(
    store: Any, rank: int, address: str, security: Security | bool | None, timeout: float
) -> tuple[RendezvousScheduler | None, str]:
    """For rank 0: the scheduler it starts on a free port of ``address``'s
    host, and that address, written in ``store``; for the others: None and
    the address read there, once rank 0 wrote it (TimeoutError after
    ``timeout`` seconds)."""
    where = endpoint(address)
    assert where is not None
    if rank == 0:
        scheduler_address = f"tcp://{unparse_host_port(where[0], _free_port(where[0]))}"
        hosted = await _rendezvous.host(scheduler_address, security)
        if hosted is None:  # taken since it was free
            raise OSError("rank 0 found the port it picked for the scheduler taken: try again")
        await asyncio.to_thread(store.set, _KEY, scheduler_address)
        return hosted, scheduler_address
    try:
        found: bytes = await asyncio.to_thread(store.get, _KEY)
    except RuntimeError as exc:  # torch's DistStoreError: it timed out
        raise TimeoutError(
            f"init_rpc waited {timeout:g} s for rank 0 to say where the rendezvous is, in "
            f"torchrun's store at {address}, and it did not ({exc})"
        ) from exc
    return None, found.decode()


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
