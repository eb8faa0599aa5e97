"""The "dask" backend: forks run as tasks on a dask.distributed cluster."""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import distributed
from distributed import Client, KilledWorker, LocalCluster, Security
from distributed.client import FutureCancelledError

import aiopar
from aiopar.backends import Backend, Task
from aiopar.lowlevel import at_exit, check_count

from ._cluster import loopback_cluster_options
from ._errors import RemoteFailure, unpack
from ._reach import check_scheduler_blocking
from ._settle import Settler
from ._worker import run_task, run_task_async

__all__ = ["DaskBackend"]


class _AsyncCall:
    """A coroutine function in disguise, so that ``Backend.fork`` hands it to
    :meth:`DaskBackend.submit` (to be awaited on a worker's event loop)
    instead of running it on a local loop."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", None) or type(fn).__qualname__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # never called
        raise AssertionError("the dask backend awaits the wrapped coroutine function")


def _is_coroutine_function(fn: Any) -> bool:
    if inspect.iscoroutinefunction(fn):
        return True
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - an object with an async __call__
    return not isinstance(fn, type) and inspect.iscoroutinefunction(call)


class DaskBackend(Backend):
    """Forks run on a dask.distributed cluster.

    Which cluster: ``client`` (your own :class:`distributed.Client`, which
    stays yours: shutdown leaves it open), else the scheduler at ``address``,
    else an embedded ``LocalCluster`` of ``n_workers`` workers with
    ``threads_per_worker`` threads each (dask's defaults when None), worker
    processes unless ``processes=False``. The embedded cluster listens on
    127.0.0.1 only, its HTTP servers included. ``security`` (a
    :class:`distributed.Security`) gives TLS to the embedded cluster or to
    the connection to ``address``.

    Guarantees: every fork is a new task (``pure=False``: two forks of one
    function with the same arguments both run); the future settles with the
    task's value, or its exception with its type and the worker's traceback
    (a task whose workers kept dying raises :class:`aiopar.BrokenWorkerError`);
    ``cancel()`` cancels the dask task (one already running on a worker runs
    to its end, and its result is dropped); a coroutine function is awaited
    on a worker's event loop; a task that forks and waits secedes from its
    worker's thread pool while it waits, so nested forks never deadlock a
    worker; done-callbacks run in a settler thread of this process, never on
    dask's event loop, so they may block. At interpreter exit pending tasks
    still run, unless the program ended with an uncaught KeyboardInterrupt:
    then those not started are cancelled, as on the other backends.
    """

    name = "dask"
    stealable = False

    def __init__(
        self,
        address: str | None = None,
        *,
        client: Client | None = None,
        n_workers: int | None = None,
        threads_per_worker: int | None = None,
        processes: bool = True,
        security: Security | None = None,
        _client_factory: Callable[[], Client] | None = None,  # inside a task: its worker's
    ) -> None:
        _check_options(address, client, n_workers, threads_per_worker, processes, security)
        self._lock = threading.Lock()
        self._cluster: LocalCluster | None = None
        self._owns_client = client is None and _client_factory is None
        self._client_or_factory = client or _client_factory
        self._client: Client | None = None
        if self._owns_client:
            if address is None:
                self._cluster = LocalCluster(
                    n_workers=n_workers,
                    threads_per_worker=threads_per_worker,
                    processes=processes,
                    **loopback_cluster_options(security, processes),
                )
                try:
                    self._client = Client(
                        self._cluster, set_as_default=False, direct_to_workers=True
                    )
                except BaseException:
                    self._cluster.close()
                    raise
            else:
                # dask's Client waits without limit for a server that never answers
                check_scheduler_blocking(address, security, timeout=0)
                self._client = Client(address, security=security, set_as_default=False)
        elif isinstance(client, Client):
            self._client = client
        self._settler = Settler("dask")
        # the aiopar future of every task not settled yet, by dask key
        self._inflight: dict[object, tuple[distributed.Future[Any], aiopar.Future[Any]]] = {}
        # Registers for shutdown at exit: only now that the backend is whole,
        # so a constructor that raised leaves nothing for exit to trip on.
        super().__init__()
        _live.add(self)

    # -- the client ----------------------------------------------------------

    @property
    def client(self) -> Client:
        """The :class:`distributed.Client` that forks go through."""
        client = self._client
        if client is None:
            with self._lock:
                if self._client is None:
                    made = self._client_or_factory()  # type: ignore[operator, misc]
                    if not isinstance(made, Client):
                        raise TypeError(
                            f"the dask backend's client factory returned {made!r}, "
                            f"not a distributed.Client"
                        )
                    self._client = made
                client = self._client
        return client

    @property
    def max_workers(self) -> int:
        """Worker threads in the cluster now (a scheduler round trip)."""
        return sum(self.client.nthreads().values())

    def __repr__(self) -> str:
        client = self._client
        scheduler = None if client is None else client.scheduler
        where = "not connected" if scheduler is None else scheduler.address
        return f"<DaskBackend {where}>"

    # -- forking -------------------------------------------------------------

    def fork(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> aiopar.Future[Any]:
        """Start ``fn(*args, **kwargs)`` as a dask task and return its future at once.

        A coroutine function is awaited on a worker's event loop.
        """
        if _is_coroutine_function(fn):
            fn = _AsyncCall(fn)
        return super().fork(fn, *args, **kwargs)

    def submit(self, task: Task) -> None:
        if self._closed:
            raise RuntimeError(
                "this dask backend has been shut down; fork on a new one "
                "(aiopar.get_backend('dask', ...) creates one)"
            )
        client = self.client
        fn = task.fn
        runner: Callable[..., Any] = run_task
        if type(fn) is _AsyncCall:
            runner, fn = run_task_async, fn.fn
        record = task.record
        future = task.future
        assert future is not None
        # dask groups keys by the part before the last dash: the task's name.
        key = f"{task.name}-{uuid.uuid4().hex}"
        dask_future = client.submit(
            runner,
            nested_backend,
            fn,
            task.args,
            task.kwargs,
            record is not None,
            key=key,
            pure=False,
        )
        task.fn = task.args = task.kwargs = None  # type: ignore[assignment]
        with self._lock:
            self._inflight[key] = (dask_future, future)
        future.add_done_callback(functools.partial(self._cancel_if_cancelled, dask_future))
        loop = client.loop
        assert loop is not None  # (a client that has started)
        loop.add_callback(self._track, dask_future, future, record)

    async def _track(
        self, dask_future: distributed.Future[Any], future: aiopar.Future[Any], record: Any
    ) -> None:
        """On the client's loop: fetch the result, then settle in the settler thread."""
        try:
            (value,) = await self.client.gather([dask_future], asynchronous=True)
        except BaseException as exc:
            outcome: tuple[Any, BaseException | None] = (None, _translate(exc, dask_future.key))
        else:
            if type(value) is RemoteFailure:  # the task's own exception (see run_task)
                outcome = (None, unpack(value.packed))
            else:
                if record is not None:
                    value, t0, t1, pid, tid, worker = value
                    offset = time.time_ns() - time.perf_counter_ns()
                    where = f"dask worker {worker}"
                    record.on_remote_run(t0 - offset, t1 - offset, pid, tid, where)
                outcome = (value, None)
        with self._lock:
            self._inflight.pop(dask_future.key, None)
        self._settler.call(_settle, future, outcome)

    def _cancel_if_cancelled(
        self, dask_future: distributed.Future[Any], future: aiopar.Future[Any]
    ) -> None:
        if future.cancelled():
            client = self.client
            loop = client.loop
            assert loop is not None
            loop.add_callback(client.cancel, [dask_future], asynchronous=True)

    # -- shutdown --------------------------------------------------------------

    def drain(self) -> bool:
        """Return once no fork of this backend is pending; True if one was."""
        with self._lock:
            pending = [future for _, future in self._inflight.values()]
        if not pending:
            return False
        aiopar.collect_all(pending).wait()
        return True

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            inflight = list(self._inflight.values())
        client = self._client
        if client is not None and client.status == "running":
            if cancel_pending:
                for _, future in inflight:
                    future.cancel()
            if wait:
                aiopar.collect_all([future for _, future in inflight]).wait()
        else:
            lost = RuntimeError("the dask client closed before the task ended")
            for _, future in inflight:
                _settle(future, (None, lost))
        self._settler.close()
        if self._owns_client and client is not None:
            client.close()
        if self._cluster is not None:
            self._cluster.close()
        _live.discard(self)


def _settle(future: aiopar.Future[Any], outcome: tuple[Any, BaseException | None]) -> None:
    Task.settle(future, outcome)


def _translate(exc: BaseException, key: object) -> BaseException:
    """dask's exception for a task, as aiopar raises it."""
    error: BaseException
    if isinstance(exc, KilledWorker):
        error = aiopar.BrokenWorkerError(
            f"the dask workers that ran task {key!r} died each time (dask gave up: {exc})"
        )
        error.__cause__ = exc
        return error
    if isinstance(exc, FutureCancelledError):
        error = aiopar.CancelledError(f"dask cancelled task {key!r}: {exc}")
        error.__cause__ = exc
        return error
    return exc


def _check_options(
    address: object,
    client: object,
    n_workers: object,
    threads_per_worker: object,
    processes: object,
    security: object,
) -> None:
    if address is not None and not isinstance(address, str):
        raise TypeError(
            f"address is a scheduler address such as 'tcp://10.0.0.5:8786', "
            f"got {type(address).__name__}"
        )
    if client is not None and not isinstance(client, Client):
        raise TypeError(
            f"client must be a distributed.Client (such as distributed.Client(address)), "
            f"got {client!r}"
        )
    if address is not None and client is not None:
        raise ValueError("give the dask backend an address or a client, not both")
    for what, n in (("n_workers", n_workers), ("threads_per_worker", threads_per_worker)):
        if n is None:
            continue
        check_count(n, what, none="dask's default")
        if address is not None or client is not None:
            raise ValueError(
                f"{what} sizes the embedded cluster; with an address or a client, "
                f"size the cluster where it is started"
            )
    if not isinstance(processes, bool):
        raise TypeError(f"processes must be True or False, got {processes!r}")
    if security is not None and not isinstance(security, Security):
        raise TypeError(f"security must be a distributed.Security, got {type(security).__name__}")


_nested: DaskBackend | None = None
_nested_lock = threading.Lock()


def nested_backend() -> DaskBackend:
    """In a dask worker: the backend of forks made inside tasks, this
    worker's cluster. It connects its client on the first such fork, not
    before."""
    global _nested
    with _nested_lock:
        if _nested is None or _nested.closed:
            _nested = DaskBackend(_client_factory=distributed.get_client)
        return _nested


_live: weakref.WeakSet[DaskBackend] = weakref.WeakSet()


def _shutdown_live() -> None:
    # After an uncaught Ctrl-C, tasks that have not started never do, as on
    # the other backends (aiopar.backends' own exit hook reads it the same way).
    interrupted = isinstance(getattr(sys, "last_value", None), KeyboardInterrupt)
    for backend in list(_live):
        try:
            backend.shutdown(wait=True, cancel_pending=interrupted)
        except Exception:
            logging.getLogger("aiopar").exception("shutting down %r at exit", backend)


# After every backend has run what was queued (a thread task may still fork
# here), and while the cluster still works: distributed closes its clients in
# atexit hooks, which run later.
at_exit(_shutdown_live)
