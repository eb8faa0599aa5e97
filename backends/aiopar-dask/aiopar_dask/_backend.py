"""The "dask" backend: forks run as tasks on a dask.distributed cluster."""

from __future__ import annotations

import inspect
import itertools
import logging
import sys
import threading
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import distributed
from distributed import Client, LocalCluster, Security

import aiopar
from aiopar.backends import Backend, Task
from aiopar.lowlevel import at_exit, check_count

from ._cluster import LoopbackCluster, cluster_security, loopback_cluster_options
from ._inflight import Chunk, Fork, InFlight
from ._reach import check_scheduler_blocking
from ._settle import Settler
from ._worker import Opaque, run_chunk, run_task, run_task_async

__all__ = ["DaskBackend"]

_CONNECT_TIMEOUT = 10.0  # seconds a scheduler at an address has to answer, unless told


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
    stays yours: shutdown leaves it open), else the scheduler at ``address``
    (given ``timeout`` seconds to answer, 10 by default: a silent address
    raises TimeoutError, anything that is no dask scheduler OSError, each
    naming the address), else an embedded ``LocalCluster`` of ``n_workers``
    workers with ``threads_per_worker`` threads each (dask's defaults when
    None), worker processes unless ``processes=False``.

    The embedded cluster listens on 127.0.0.1 only, its HTTP servers
    included, and uses TLS with certificates made as it starts (dask's
    ``Security.temporary()``), so no other process of the machine can use
    its scheduler or reach its workers; ``security`` (a
    :class:`distributed.Security`) gives it your certificates instead, and
    ``security=False`` no TLS. With ``address``, ``security`` is the TLS of
    the connection to that scheduler (none by default), which a
    ``tcp://`` address reaches over TLS when the scheduler there takes it.

    Guarantees: every fork is a new task (``pure=False``: two forks of one
    function with the same arguments both run), named after its function,
    whose arguments reach it as given (dask does not compute a dask
    ``Task`` or future among them); the future settles with the
    task's value, or its exception with its type and the worker's traceback
    (a task whose workers kept dying raises :class:`aiopar.BrokenWorkerError`;
    a function or argument that does not pickle, TypeError);
    ``cancel()`` cancels the dask task (one already running on a worker runs
    to its end, and its result is dropped); a coroutine function is awaited
    on a worker's event loop; a task that forks and waits secedes from its
    worker's thread pool while it waits, so nested forks never deadlock a
    worker; done-callbacks run in a settler thread of this process, never on
    dask's event loop, so they may block. Forks made in quick succession
    reach the cluster as one batch (one graph), and tasks that complete
    close together send their results in one transfer: a task that
    completes while others of this backend still run settles up to 5 ms
    later, so that its result travels with theirs. At interpreter exit
    pending tasks still run, unless the program ended with an uncaught
    KeyboardInterrupt: then those not started are cancelled, as on the
    other backends.
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
        security: Security | bool | None = None,
        timeout: float | None = None,
        _client_factory: Callable[[], Client] | None = None,  # inside a task: its worker's
    ) -> None:
        _check_options(address, client, n_workers, threads_per_worker, processes, security)
        _check_timeout(timeout, address)
        self._lock = threading.Lock()
        self._cluster: LocalCluster | None = None
        self._owns_client = client is None and _client_factory is None
        self._client_or_factory = client or _client_factory
        self._client: Client | None = None
        if self._owns_client:
            if address is None:
                self._cluster = LoopbackCluster(
                    n_workers=n_workers,
                    threads_per_worker=threads_per_worker,
                    processes=processes,
                    **loopback_cluster_options(cluster_security(security), processes),
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
                seconds = _CONNECT_TIMEOUT if timeout is None else timeout
                tls = security if isinstance(security, Security) else None
                address = check_scheduler_blocking(address, tls, seconds)
                self._client = Client(address, security=tls, set_as_default=False, timeout=seconds)
        elif isinstance(client, Client):
            self._client = client
        self._settler = Settler("dask")
        self._inflight = InFlight(self._settler)
        # Keys: the task's name (dask groups keys by it), this backend, a count.
        self._key_prefix = uuid.uuid4().hex[:16]
        self._key_count = itertools.count()
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

    def enqueue(self, task: Task) -> None:
        client = self._client_to_send()
        fn = task.fn
        runner: Callable[..., Any] = run_task
        if type(fn) is _AsyncCall:
            runner, fn = run_task_async, fn.fn
        record = task.record
        future = task.future
        assert future is not None
        key = self._new_key(task.name)  # (the name is read from task.fn, cleared below)
        call = (runner, nested_backend, Opaque((fn, task.args, task.kwargs)), record is not None)
        task.fn = task.args = task.kwargs = None  # type: ignore[assignment]
        self._inflight.send(client, Fork(key, future, record), call)

    def map(
        self, fn: Callable[..., Any], /, *iterables: Iterable[Any], chunksize: int | None = None
    ) -> list[aiopar.Future[Any]]:
        """Start ``fn(*args)`` for each ``args`` of ``zip(*iterables)`` on the
        cluster and return their futures at once, in order.

        The items go in chunks of ``chunksize`` (by default the item count
        over four times :attr:`max_workers`), one dask task each: many small
        calls cost far less than a fork each. An item's failure fails its
        own future only; a ``BaseException`` (``SystemExit``, say) ends its
        chunk there, and the futures of the items after it are cancelled.
        Cancelling an item's future drops its result (its chunk runs
        anyway, unless every item of the chunk is cancelled before it is
        sent). A coroutine function gets a fork per item.
        """
        if not callable(fn):
            raise TypeError(f"DaskBackend.map() needs a callable, got {type(fn).__name__}")
        if not iterables:
            raise TypeError("DaskBackend.map() needs an iterable of arguments: map(fn, xs)")
        check_count(chunksize, "map(chunksize=...)", none="picked from the items and workers")
        items = list(zip(*iterables, strict=False))  # as map(): to the shortest
        if _is_coroutine_function(fn):
            return [self.fork(fn, *args) for args in items]
        client = self._client_to_send()
        futures: list[aiopar.Future[Any]] = [aiopar.Future() for _ in items]
        # four chunks per worker, as Backend.map picks them
        size = chunksize or max(1, -(-len(items) // (4 * max(1, self.max_workers))))
        name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        for start in range(0, len(items), size):
            chunk = Chunk(self._new_key(name), futures[start : start + size])
            call = (run_chunk, nested_backend, Opaque((fn, items[start : start + size])))
            self._inflight.send(client, chunk, call)
        return futures

    def _client_to_send(self) -> Client:
        if self._closed:
            raise RuntimeError(
                "this dask backend has been shut down; fork on a new one "
                "(aiopar.get_backend('dask', ...) creates one)"
            )
        return self.client

    def _new_key(self, name: str) -> str:
        return f"{name}-{self._key_prefix}-{next(self._key_count)}"

    # -- shutdown --------------------------------------------------------------

    def drain(self) -> bool:
        """Return once no fork of this backend is pending; True if one was."""
        pending = self._inflight.futures()
        if not pending:
            return False
        aiopar.collect_all(pending).wait()
        return True

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        client = self._client
        if client is not None and client.status == "running":
            pending = self._inflight.futures()
            if cancel_pending:
                for future in pending:
                    future.cancel()
            if wait:
                aiopar.collect_all(pending).wait()
        else:
            self._inflight.fail_all(RuntimeError("the dask client closed before the task ended"))
        self._settler.close()
        if self._owns_client and client is not None:
            client.close()
        if self._cluster is not None:
            self._cluster.close()
        _live.discard(self)


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
    if security is not None and security is not False and not isinstance(security, Security):
        raise TypeError(
            f"security must be a distributed.Security, or False for no TLS, "
            f"got {type(security).__name__}"
        )


def _check_timeout(timeout: object, address: object) -> None:
    if timeout is None:
        return
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(
            f"timeout is the seconds the scheduler at address has to answer, a number > 0, "
            f"got {timeout!r}"
        )
    if address is None:
        raise ValueError(
            "timeout bounds the wait for the scheduler at address; the embedded cluster "
            "and a client of your own take none"
        )


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
