"""Helpers for the plugin's tests: loopback clusters, what a test leaves
behind, functions that peers run, and the helpers both suites share (child
interpreters, waiting), which live in the core's tests/helpers.py and are
re-exported here.

The functions that workers and peers run travel by name, so the worker
processes import them from here.
"""

from __future__ import annotations

import queue
import socket
import sys
import threading
import weakref
from pathlib import Path

import distributed
import psutil
import pytest
from aiopar_dask import DaskBackend

import aiopar
from aiopar import rpc

# The shared helpers' directory, for a child interpreter that imports this
# module by its own directory's path as much as for pytest.
_SHARED = str(Path(__file__).resolve().parents[3] / "tests")
if _SHARED not in sys.path:
    sys.path.append(_SHARED)

from helpers import run_python as run_python  # noqa: E402
from helpers import start_python as start_python  # noqa: E402
from helpers import wait_until as wait_until  # noqa: E402

LOOPBACK = "127.0.0.1"

# -- clusters ------------------------------------------------------------------------


def loopback_cluster(n_workers: int) -> distributed.LocalCluster:
    """A cluster in this process with ``n_workers`` one-thread workers, whose
    scheduler listens on tcp://127.0.0.1 for clients and peers to join."""
    return distributed.LocalCluster(
        n_workers=n_workers,
        threads_per_worker=1,
        processes=False,
        host=LOOPBACK,
        protocol="tcp://",
        dashboard_address=f"{LOOPBACK}:0",
    )


def tasks_to_run(backend: DaskBackend) -> int:
    """The most tasks not run yet, or running, that the scheduler or a
    worker of ``backend``'s in-process cluster holds (a task that has run
    stays a while, its result in memory)."""
    cluster = backend._cluster
    held = [cluster.scheduler.tasks.values()]
    held += [worker.state.tasks.values() for worker in cluster.workers.values()]
    return max(sum(task.state not in _DONE for task in tasks) for tasks in held)


_DONE = {"memory", "erred", "error", "released", "forgotten", "cancelled"}


def descendant_pids() -> set[int]:
    """Live (not yet reaped) processes this process started, and the ones
    they started (a nanny's worker), but multiprocessing's resource tracker."""
    return {
        child.pid
        for child in psutil.Process().children(recursive=True)
        if not _is_resource_tracker(str(child.pid))
    }


def _is_resource_tracker(pid: str) -> bool:
    """multiprocessing's resource tracker: started by the first spawn, it
    lives as long as this process, whoever spawned."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


def aiopar_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("aiopar-")}


class Leftovers:
    """The child processes and aiopar threads started since it was made."""

    def __init__(self) -> None:
        self._children = descendant_pids()
        self._threads = aiopar_threads()

    def processes(self) -> set[int]:
        return descendant_pids() - self._children

    def threads(self) -> set[threading.Thread]:
        return aiopar_threads() - self._threads


def listening_addresses(pids: set[int]) -> set[str]:
    """The IP addresses that these processes' listening TCP sockets are bound to."""
    psutil = pytest.importorskip("psutil")
    hosts = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                hosts.add(conn.laddr.ip)
    return hosts


# -- what workers and peers run -------------------------------------------------------


def fail_deep():
    """Raises ValueError from a nested frame, for tracebacks to show."""

    def inner_helper():
        raise ValueError("failed on purpose")

    inner_helper()


class TrackedFailure(Exception):
    """An exception that counts itself in its process while it lives (a
    built-in exception takes no weak reference)."""

    alive: weakref.WeakSet[TrackedFailure] = weakref.WeakSet()

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        TrackedFailure.alive.add(self)


class Faulty:
    """An RRef's value whose method fails."""

    def fail(self) -> None:
        raise TrackedFailure("failed on purpose")


def tracked_failures_alive() -> int:
    return len(TrackedFailure.alive)


@rpc.functions.async_execution
def after_timer(seconds: float, value):
    """Replies ``value`` after ``seconds`` without holding the callee's thread."""
    fut: aiopar.Future = aiopar.Future()
    threading.Timer(seconds, fut.set_result, args=(value,)).start()
    return fut


def log_debug_to(path: str) -> None:
    """Write this process's aiopar.rpc log, from debug level up, to ``path``."""
    import logging

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("aiopar.rpc")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


# -- the rpc wire, on sockets of this process -----------------------------------------------


class Served:
    """A socket served as a peer's connection: sends through it, and the
    messages that arrive (each one's kind, call id and unpickled payload)
    in ``received``. A closed or broken connection puts why there."""

    def __init__(self, sock: socket.socket) -> None:
        from aiopar_dask import _wire

        self.hub = _wire.Hub(name="aiopar-rpc-io-test")
        self.received: queue.Queue[object] = queue.Queue()
        self.connection = _wire.Connection(sock, None)

        def on_message(connection: object, kind: int, call_id: int, frames: object) -> None:
            self.received.put((kind, call_id, _wire.loads(frames)))

        self.connection.serve(
            self.hub, _wire.messages(self.connection, on_message), self.received.put
        )

    def take(self, count: int, timeout: float = 30) -> list[object]:
        return [self.received.get(timeout=timeout) for _ in range(count)]

    def close(self) -> None:
        self.connection.close()
        self.hub.close()
