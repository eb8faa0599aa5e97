"""dask's HTTP servers under a cluster's TLS: served over TLS only.

A dask scheduler or worker starts its HTTP server (its info pages, metrics,
health) whatever its ``security`` says (dask/distributed#7207), and takes TLS
for it only from the dashboard's own config files. A :class:`TlsHttp` server
with a TLS ``distributed.Security`` serves those pages with the context of
its comms instead, so only a client with the cluster's certificate gets them.
"""

from __future__ import annotations

from typing import Any

import distributed

__all__ = ["TlsHttp", "TlsScheduler"]


class TlsHttp:
    """A mixin for a dask server (``security`` set, the role it listens as in ``http_role``)."""

    security: distributed.Security
    http_role = "worker"

    def start_http_server(
        self, routes: Any, dashboard_address: Any, default_port: int = 0, ssl_options: Any = None
    ) -> Any:
        if ssl_options is None:
            ssl_options = self.security.get_listen_args(self.http_role)["ssl_context"]
        return super().start_http_server(  # type: ignore[misc]
            routes, dashboard_address, default_port=default_port, ssl_options=ssl_options
        )


class TlsScheduler(TlsHttp, distributed.Scheduler):
    """A dask scheduler whose HTTP pages take TLS from its ``security``."""

    http_role = "scheduler"
