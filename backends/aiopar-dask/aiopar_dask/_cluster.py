"""How aiopar starts dask processes: loopback only, TLS, quiet, without the user's ``__main__``.

Every cluster aiopar starts (the dask backend's, ``init_rpc``'s) is made of
the pieces here:

- **addresses**: dask binds more than its comms: the scheduler starts an
  HTTP server even without a dashboard (dask/distributed#7207), and an
  in-process cluster binds its servers to the machine's address unless told
  otherwise. Every address is spelled out (:func:`loopback_cluster_options`).
- **TLS by default** (:func:`cluster_security`): certificates made at
  start-up (dask's ``Security.temporary()``), so a local process that is
  not part of the cluster can neither use the scheduler nor reach a worker,
  unless the user gives a ``Security`` of their own, or ``False`` for none.
- **HTTP under the cluster's TLS**: a dask server takes TLS for its HTTP
  server (info pages, metrics, health) only from the dashboard's own config
  files; a :class:`TlsHttp` server serves them with the context of its
  comms, so only a client with the cluster's certificate gets them.
- **quiet workers**: a dask worker that closes while its heartbeat is on the
  wire aborts that heartbeat's connection itself, then logs "Failed to
  communicate with scheduler during heartbeat" with two tracebacks
  (dask/distributed#9032): a script that ran without fault ends with that
  error on its stderr, one worker in a few. A :class:`QuietWorker` drops
  that error when it is closing, and only then.
- **fresh nannies**: a :class:`distributed.Nanny` started in the user's
  process starts its worker with multiprocessing, which runs the user's
  ``__main__`` again there: a script without an ``if __name__ ==
  "__main__":`` guard then starts its cluster over and over, and a script
  read from stdin cannot start one. A :class:`FreshNanny` runs the nanny in
  a fresh interpreter (:func:`aiopar.lowlevel.fresh_python`), whose worker
  processes run only dask's code and the tasks they are sent. It exits with
  the process that started it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import pickle
import signal
import socket
import sys
import traceback
from typing import Any

import distributed
import psutil
from distributed import LocalCluster, Nanny, Security, SpecCluster
from distributed.comm.addressing import unparse_host_port
from distributed.core import Status
from distributed.deploy.spec import ProcessInterface
from distributed.utils import silence_logging_cmgr

from aiopar.lowlevel import fresh_python

__all__ = [
    "HEARTBEAT_FAILED",
    "LOOPBACK",
    "ClusterWorker",
    "FreshNanny",
    "LoopbackCluster",
    "QuietWorker",
    "TlsHttp",
    "TlsScheduler",
    "cluster_security",
    "loopback_cluster_options",
    "protocol_for",
    "scheduler_spec",
]

LOOPBACK = "127.0.0.1"


# -- addresses and TLS -----------------------------------------------------------------


def cluster_security(security: Security | bool | None) -> Security | None:
    """The security of a cluster aiopar starts: ``security`` itself if it
    is a ``distributed.Security``, none for False, else TLS with
    certificates made now (``Security.temporary()``, in memory)."""
    if security is False:
        return None
    if isinstance(security, Security):
        return security
    made: Security = Security.temporary()
    return made


def protocol_for(security: Security | None) -> str:
    """tls:// when ``security`` asks for encryption, else tcp://."""
    return "tls://" if security is not None and security.require_encryption else "tcp://"


def scheduler_spec(
    security: Security | None, host: str = LOOPBACK, port: int = 0
) -> dict[str, Any]:
    """The ``SpecCluster`` spec of a scheduler aiopar starts at ``host:port``
    (any free port for 0), whose HTTP server listens on that host too."""
    return {
        "cls": TlsScheduler,  # its HTTP pages over TLS when the cluster has TLS
        "options": {
            "host": host,
            "port": port,
            "protocol": protocol_for(security),
            "dashboard": False,
            "dashboard_address": unparse_host_port(host, 0),  # its HTTP server starts regardless
            "security": security,
        },
    }


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
        options["worker_class"] = ClusterWorker
        del options["host"]
    if security is not None:
        options["security"] = security
    return options


# -- HTTP under the cluster's TLS -----------------------------------------------------------


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


class _TlsSchedulerSpec(SpecCluster):
    """Makes the scheduler of the cluster a :class:`TlsScheduler` (``LocalCluster``
    names its scheduler's class itself, and hands it to ``SpecCluster``)."""

    def __init__(self, *, scheduler: dict[str, Any], **kwargs: Any) -> None:
        scheduler = {**scheduler, "cls": TlsScheduler}
        super().__init__(scheduler=scheduler, **kwargs)  # type: ignore[no-untyped-call]


class LoopbackCluster(LocalCluster, _TlsSchedulerSpec):
    """A ``LocalCluster`` whose scheduler serves its HTTP pages under the
    cluster's TLS; give it :func:`loopback_cluster_options`."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)  # type: ignore[no-untyped-call]


# -- quiet workers ----------------------------------------------------------------------------

HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat."
_CLOSING = frozenset({Status.closing, Status.closing_gracefully, Status.closed})

# The worker whose heartbeat the current task runs, if any.
_beating: contextvars.ContextVar[QuietWorker | None] = contextvars.ContextVar(
    "aiopar_dask_beating", default=None
)


class _HeartbeatCutByClose(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        worker = _beating.get()
        return not (
            worker is not None and record.msg == HEARTBEAT_FAILED and worker.status in _CLOSING
        )


_FILTER = _HeartbeatCutByClose()


class QuietWorker(distributed.Worker):
    """A ``distributed.Worker`` that does not log, as an error, the heartbeat
    its own close cut short."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        logging.getLogger("distributed.worker").addFilter(_FILTER)  # once: filters are a set

    async def heartbeat(self) -> None:
        beating = _beating.set(self)
        try:
            await super().heartbeat()
        finally:
            _beating.reset(beating)


class ClusterWorker(TlsHttp, QuietWorker):
    """The worker of every cluster aiopar starts: quiet as it closes, its
    HTTP pages under the cluster's TLS."""


# -- nannies in fresh interpreters -----------------------------------------------------------

# How long a nanny may take to stop its worker once told to, before it is killed.
CLOSE_TIMEOUT = 10.0


class FreshNanny(ProcessInterface):
    """A :class:`distributed.Nanny` in a process of its own, for ``SpecCluster``
    (and ``LocalCluster(worker_class=FreshNanny)``): it takes the nanny's
    arguments, and its ``address`` is the nanny's once it has started. Its
    worker is a :class:`ClusterWorker` unless ``worker_class`` names another."""

    def __init__(self, scheduler: str, name: object = None, **options: Any) -> None:
        super().__init__(scheduler, name)  # type: ignore[no-untyped-call]
        self.scheduler = scheduler
        self.name = name
        self.options = {"worker_class": ClusterWorker, **options}
        self.worker_address: str | None = None
        self.process: asyncio.subprocess.Process | None = None
        self._channel: socket.socket | None = None

    async def start(self) -> None:
        """Start the nanny and return once it has registered its worker with
        the scheduler; raise what stopped it if it could not."""
        ours, theirs = socket.socketpair()
        try:
            self.process = await asyncio.create_subprocess_exec(
                *fresh_python("aiopar_dask._cluster:serve_nanny", theirs.fileno()),
                pass_fds=[theirs.fileno()],
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._channel = ours
        ours.setblocking(False)
        await _send(ours, (self.scheduler, self.name, self.options))
        try:
            started = await _receive(ours)
        except EOFError:
            started = ("failed", f"it exited with code {await self.process.wait()}")
        if started[0] != "started":
            await self.close()
            raise RuntimeError(f"the nanny of worker {self.name!r} did not start: {started[1]}")
        _, self.address, self.worker_address = started
        await super().start()  # type: ignore[no-untyped-call]

    async def close(self) -> None:
        """Tell the nanny to stop its worker and exit; kill it (and what it
        started) if it has not exited within ``CLOSE_TIMEOUT`` seconds."""
        process, channel = self.process, self._channel
        self.process = self._channel = None
        if channel is not None:
            channel.close()  # the nanny's end reads EOF: it closes its worker and exits
        if process is not None:
            try:
                await asyncio.wait_for(process.wait(), CLOSE_TIMEOUT)
            except TimeoutError:
                _kill_tree(process.pid)
                await process.wait()
        await super().close()  # type: ignore[no-untyped-call]


def _kill_tree(pid: int) -> None:
    with contextlib.suppress(psutil.NoSuchProcess):
        parent = psutil.Process(pid)
        for child in parent.children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        parent.kill()


async def _send(channel: socket.socket, message: object) -> None:
    data = pickle.dumps(message)
    await asyncio.get_running_loop().sock_sendall(channel, len(data).to_bytes(8, "big") + data)


async def _receive(channel: socket.socket) -> Any:
    loop = asyncio.get_running_loop()
    data = b""
    while len(data) < 8 or len(data) < 8 + int.from_bytes(data[:8], "big"):
        chunk = await loop.sock_recv(channel, 65536)
        if not chunk:
            raise EOFError("the other end closed its socket")
        data += chunk
    return pickle.loads(data[8:])


def serve_nanny(fd: str) -> None:
    """The nanny process: read what to start from the socket ``fd``, start
    it, send back its addresses (or why it failed), and run until the
    socket closes or the nanny stops."""
    # Ctrl-C in a terminal reaches the whole process group: the process
    # that started the cluster decides when it stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    asyncio.run(_serve(socket.socket(fileno=int(fd))))


async def _serve(channel: socket.socket) -> None:
    channel.setblocking(False)
    scheduler, name, options = await _receive(channel)
    with contextlib.ExitStack() as stack:
        if options.get("silence_logs"):  # also what the nanny logs as it closes
            stack.enter_context(silence_logging_cmgr(options["silence_logs"]))
        await _run_nanny(channel, scheduler, name, options)


async def _run_nanny(channel: socket.socket, scheduler: str, name: object, options: Any) -> None:
    try:
        nanny = await Nanny(scheduler, name=name, **options)
    except Exception:
        await _send(channel, ("failed", traceback.format_exc()))
        sys.exit(1)
    await _send(channel, ("started", nanny.address, nanny.worker_address))
    told = asyncio.ensure_future(asyncio.get_running_loop().sock_recv(channel, 1))  # EOF: stop
    finished = asyncio.ensure_future(nanny.finished())
    await asyncio.wait([told, finished], return_when=asyncio.FIRST_COMPLETED)
    for wait in (told, finished):
        wait.cancel()
    await nanny.close(reason="its cluster closed it")
    channel.close()
