"""Clusters that listen on loopback only, their HTTP servers included.

dask binds more than its comms: the scheduler starts an HTTP server even
without a dashboard (dask/distributed#7207), and an in-process cluster
(``processes=False``) binds its servers to the machine's address unless
told otherwise. Every address is spelled out here.
"""

from __future__ import annotations

from typing import Any

from distributed import Security

from ._nanny import FreshNanny
from ._quiet import QuietWorker

__all__ = ["LOOPBACK", "loopback_cluster_options", "protocol_for"]

LOOPBACK = "127.0.0.1"


def protocol_for(security: Security | None) -> str:
    """tls:// when ``security`` asks for encryption, else tcp://."""
    return "tls://" if security is not None and security.require_encryption else "tcp://"


def loopback_cluster_options(security: Security | None, processes: bool) -> dict[str, Any]:
    """``LocalCluster`` keywords that keep the scheduler, the workers and
    every HTTP server on 127.0.0.1."""
    options: dict[str, Any] = {
        "host": LOOPBACK,
        "dashboard_address": f"{LOOPBACK}:0",
        "worker_dashboard_address": f"{LOOPBACK}:0",
        "scheduler_kwargs": {"dashboard": False},  # the HTTP server only, no bokeh pages
        "protocol": protocol_for(security),
    }
    if processes:
        options["worker_class"] = FreshNanny  # the user's __main__ is not run again
    else:
        # In one process the comms need no sockets at all.
        options["protocol"] = "inproc://"
        options["worker_class"] = QuietWorker
        del options["host"]
    if security is not None:
        options["security"] = security
    return options
