"""aiopar.rpc on dask.distributed: every peer is a dask worker.

A peer is a :class:`Peer`, a ``distributed.Worker`` that also serves rpc
calls. The scheduler is the phone book (each peer's name, rank and
addresses) and dask runs the processes (nannies restart dead peers of an
embedded cluster). Calls do not go through the scheduler: a caller keeps one
connection to each callee it calls (see ``_wire`` for why not a dask comm),
writes its calls on it from its own thread, and one thread reads the
replies. The callee runs each call in its worker's thread pool; a call
blocked in ``wait`` leaves the pool after 0.1 s, and an ``async_execution``
call holds no thread while its future is pending.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import heapq
import itertools
import logging
import signal
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import distributed
from distributed import Nanny, Scheduler, Security, SpecCluster
from distributed.core import clean_exception, error_message
from distributed.worker import _worker_cvar as _worker_context

import aiopar
from aiopar.backends import set_waiter
from aiopar.rpc.agent import RpcAgent, RpcBackendOptions, WorkerInfo, run_callee, set_current_agent

from . import _wire
from ._cluster import LOOPBACK, protocol_for
from ._settle import Settler
from ._worker import Seceder

__all__ = ["Peer", "rpc_engine"]

_logger = logging.getLogger("aiopar.rpc")

_CONNECT_TIMEOUT = 5.0  # a peer that does not accept a connection by then is gone
_POLL = 0.05  # seconds before the first new look at the scheduler while waiting for peers
_TICK = 0.05  # timeouts are checked this often

# Threads that read connections: a done-callback never runs there (see _RpcFuture).
_wire_thread = threading.local()


class _Value:
    """A startup_information entry (a picklable callable, as dask requires)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, worker: Any) -> Any:
        return self.value


def _rpc_port(worker: Peer) -> int:
    return worker.rpc_agent.port


class Peer(distributed.Worker):
    """A dask worker that is also an rpc peer, named ``name`` with id ``rank``.

    ``joined`` marks a peer whose process called ``init_rpc``: graceful
    shutdown waits for those. ``rpc_timeout`` is the default timeout of the
    calls made from this process.
    """

    def __init__(
        self,
        *args: Any,
        rank: int,
        rpc_timeout: float = aiopar.rpc.DEFAULT_RPC_TIMEOUT,
        joined: bool = False,
        **kwargs: Any,
    ) -> None:
        self.rpc_token = uuid.uuid4().hex
        kwargs["startup_information"] = {
            **kwargs.get("startup_information", {}),
            "aiopar_rank": _Value(rank),
            "aiopar_joined": _Value(joined),
            "aiopar_token": _Value(self.rpc_token),
            "aiopar_rpc_port": _rpc_port,
        }
        kwargs["plugins"] = (*kwargs.get("plugins", ()), _Listen())
        super().__init__(*args, **kwargs)
        self.rpc_agent = DaskRpcAgent(self, rank, rpc_timeout)

    async def start_unsafe(self) -> Peer:
        await super().start_unsafe()
        set_current_agent(self.rpc_agent)
        return self

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        self.rpc_agent._stop(RuntimeError(f"rpc peer {self.name!r} is shutting down"))
        return await super().close(*args, **kwargs)


class _Listen(distributed.WorkerPlugin):
    """Listens for calls once the worker knows its address, before the
    scheduler lists it (dask sets plugins up between the two)."""

    name = "aiopar-rpc"

    def setup(self, worker: Peer) -> None:  # type: ignore[override]
        worker.rpc_agent._listen(worker.ip)


class _RpcFuture(aiopar.Future[Any]):
    """The future of a call. The thread that reads replies settles it, which
    wakes ``rpc_sync`` at once; a done-callback that would run in that thread
    runs in the settler thread instead, since it may block."""

    __slots__ = ("_settler",)

    def __init__(self, settler: Settler) -> None:
        super().__init__()
        self._settler = settler

    def add_done_callback(self, fn: Callable[[aiopar.Future[Any]], object]) -> None:
        settler = self._settler

        def off_the_wire(future: aiopar.Future[Any]) -> None:
            if getattr(_wire_thread, "active", False):
                settler.call(fn, future)
            else:
                fn(future)

        super().add_done_callback(off_the_wire)


class _Link:
    """This peer's connection to one callee, and the calls waiting for its replies."""

    def __init__(self, agent: DaskRpcAgent, name: str, address: str, connection: Any) -> None:
        self.agent = agent
        self.name = name
        self.address = address
        self.connection: _wire.Connection = connection
        self.ids = itertools.count()
        self.lock = threading.Lock()
        # call id -> (future, what was called, its timeout's tick or None)
        self.pending: dict[int, tuple[aiopar.Future[Any], str, int | None]] = {}
        self.broken: BaseException | None = None
        self.reader = threading.Thread(
            target=self._read, name=f"aiopar-rpc-link-{name}", daemon=True
        )
        self.reader.start()

    def call(self, future: aiopar.Future[Any], what: str, frames: Any, timeout: float) -> None:
        with self.lock:
            if self.broken is not None:
                raise aiopar.BrokenWorkerError(str(self.broken)) from self.broken
            call_id = next(self.ids)
            # 0, infinity and more than a lock can wait: no limit (aiopar.rpc gives 0 for all)
            limited = 0 < timeout <= threading.TIMEOUT_MAX
            tick = self.agent._timeouts.add(timeout, self, call_id) if limited else None
            self.pending[call_id] = (future, what, tick)
        try:
            self.connection.send(_wire.CALL, call_id, *frames)
        except OSError as exc:
            self.fail_all(exc)

    def pop(self, call_id: int) -> tuple[aiopar.Future[Any], str] | None:
        """The call's future and name, unless it was settled already."""
        with self.lock:
            entry = self.pending.pop(call_id, None)
        if entry is None:
            return None
        future, what, tick = entry
        if tick is not None:
            self.agent._timeouts.discard(tick, self, call_id)
        return future, what

    def _read(self) -> None:
        _wire_thread.active = True
        try:
            while True:
                kind, call_id, frames = self.connection.receive()
                entry = self.pop(call_id)
                if entry is not None:  # else it timed out already
                    _settle_reply(entry[0], kind, frames, entry[1], self.name)
        except Exception as exc:
            self.fail_all(exc)

    def fail_all(self, exc: BaseException) -> None:
        """The connection broke: every pending call fails, naming the peer."""
        stopped = self.agent._stopped
        with self.lock:
            if self.broken is None:
                self.broken = stopped or self._gone(exc, "")
            call_ids = list(self.pending)
        self.agent._forget_link(self)
        self.connection.close()
        for call_id in call_ids:
            entry = self.pop(call_id)
            if entry is None:
                continue
            future, what = entry
            if stopped is not None:
                error: BaseException = RuntimeError(
                    f"the call of {what} to {self.name!r} was pending when this peer shut down"
                )
            else:
                error = self._gone(exc, f" while the call of {what} was pending")
            error.__cause__ = exc
            _fail(future, error)

    def _gone(self, exc: BaseException, during: str) -> aiopar.BrokenWorkerError:
        return aiopar.BrokenWorkerError(
            f"rpc peer {self.name!r} ({self.address}) is gone: the connection to it broke"
            f"{during} ({type(exc).__name__}: {exc})"
        )


class _Timeouts:
    """Deadlines of pending calls, checked every ``_TICK`` s by one thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # tick -> the calls due then: (link, call id) -> timeout
        self._ticks: dict[int, dict[tuple[_Link, int], float]] = {}
        self._heap: list[int] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, timeout: float, link: _Link, call_id: int) -> int:
        """Fail the call after ``timeout`` s unless discarded first; return its tick."""
        tick = int((time.monotonic() + timeout) / _TICK) + 1
        with self._lock:
            due = self._ticks.get(tick)
            if due is None:
                due = self._ticks[tick] = {}
                heapq.heappush(self._heap, tick)
                if self._heap[0] == tick:
                    self._wake.notify()
            due[(link, call_id)] = timeout
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="aiopar-rpc-timeouts")
                self._thread.daemon = True
                self._thread.start()
        return tick

    def discard(self, tick: int, link: _Link, call_id: int) -> None:
        with self._lock:
            due = self._ticks.get(tick)
            if due is not None:
                due.pop((link, call_id), None)

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    if self._heap and self._heap[0] * _TICK <= now:
                        due = self._ticks.pop(heapq.heappop(self._heap))
                        break
                    self._wake.wait(self._heap[0] * _TICK - now if self._heap else None)
            for (link, call_id), timeout in due.items():
                with link.lock:
                    entry = link.pending.pop(call_id, None)
                if entry is not None:
                    future, what, _ = entry
                    error = TimeoutError(
                        f"the call of {what} to rpc peer {link.name!r} had no reply after "
                        f"{timeout:g} s (pass timeout= to the call, or rpc_timeout to "
                        f"init_rpc's options)"
                    )
                    _fail(future, error)

    def close(self) -> threading.Thread | None:
        with self._lock:
            self._closed = True
            self._wake.notify()
            return self._thread


class DaskRpcAgent(RpcAgent):
    """The rpc agent of one :class:`Peer`."""

    def __init__(self, worker: Peer, rank: int, default_timeout: float) -> None:
        self._worker = worker
        self._rank = rank
        self._default_timeout = default_timeout
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[WorkerInfo, str, int]] = {}  # name -> (info, address, port)
        self._links: dict[str, _Link] = {}  # by callee name
        self._settler = Settler("rpc")
        self._timeouts = _Timeouts()
        self._listener: _wire.Listener | None = None
        self._stopped: BaseException | None = None
        self.cluster: SpecCluster | None = None  # the embedded cluster init_rpc started
        self.on_close: Callable[[], None] | None = None

    @property
    def port(self) -> int:
        assert self._listener is not None
        return self._listener.port

    # -- RpcAgent ------------------------------------------------------------------

    @property
    def worker_info(self) -> WorkerInfo:
        return WorkerInfo(str(self._worker.name), self._rank)

    @property
    def default_timeout(self) -> float:
        return self._default_timeout

    def peer(self, to: str | int) -> WorkerInfo:
        found = self._lookup(to)
        if found is None:
            self._run(self._refresh_peers())
            found = self._lookup(to)
        if found is None:
            listing = ", ".join(f"{info.name} (id {info.id})" for info in self.peers()) or "none"
            what = f"called {to!r}" if isinstance(to, str) else f"with id {to}"
            raise ValueError(f"there is no rpc peer {what}; the peers are: {listing}")
        return found[0]

    def peers(self) -> list[WorkerInfo]:
        self._run(self._refresh_peers())
        with self._lock:
            return sorted((p[0] for p in self._peers.values()), key=lambda info: info.id)

    def call(
        self,
        to: WorkerInfo,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> aiopar.Future[Any]:
        if self._stopped is not None:
            raise RuntimeError(f"this rpc peer has shut down: {self._stopped}")
        try:
            frames = _wire.dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"the call of {_name(fn)} to {to.name!r} cannot be sent: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        future = _RpcFuture(self._settler)
        what = _name(fn)
        try:
            link = self._link(to.name)
            link.call(future, what, frames, timeout)
        except (OSError, aiopar.BrokenWorkerError) as exc:
            with self._lock:
                self._peers.pop(to.name, None)  # it may come back elsewhere: look again next time
            error = aiopar.BrokenWorkerError(
                f"rpc peer {to.name!r} cannot be reached ({type(exc).__name__}: {exc})"
            )
            error.__cause__ = exc
            _fail(future, error)
        return future

    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        deadline = None if not timeout else time.monotonic() + timeout
        if graceful:
            self._run(self._leave_together(deadline), timeout=None)
        self._run(_close(self._worker, self.cluster), timeout=None)
        self._join()
        if self.on_close is not None:
            self.on_close()

    # -- the caller's side -------------------------------------------------------------

    def _lookup(self, to: str | int) -> tuple[WorkerInfo, str, int] | None:
        with self._lock:
            if isinstance(to, str):
                return self._peers.get(to)
            return next((p for p in self._peers.values() if p[0].id == to), None)

    async def _refresh_peers(self) -> None:
        identity = await self._worker.scheduler.identity(n_workers=-1)
        peers = {
            str(w["name"]): (WorkerInfo(str(w["name"]), w["aiopar_rank"]), a, w["aiopar_rpc_port"])
            for a, w in identity["workers"].items()
            if "aiopar_rank" in w
        }
        with self._lock:
            self._peers = peers

    def _link(self, name: str) -> _Link:
        """The link to ``name``, connected on first use (in the calling thread)."""
        with self._lock:
            link = self._links.get(name)
        if link is not None:
            return link
        found = self._lookup(name)
        if found is None:
            self.peer(name)  # refreshes, or raises naming the peers
            found = self._lookup(name)
            assert found is not None
        _, address, port = found
        host = distributed.comm.get_address_host(address)
        context = self._worker.connection_args.get("ssl_context")
        connection = _wire.connect(host, port, _CONNECT_TIMEOUT, context)
        with self._lock:
            if self._stopped is not None:
                connection.close()
                raise RuntimeError(f"this rpc peer has shut down: {self._stopped}")
            link = self._links.get(name)
            if link is None:
                link = self._links[name] = _Link(self, name, address, connection)
                return link
        connection.close()  # another thread connected first
        return link

    def _forget_link(self, link: _Link) -> None:
        """A broken link: the next call reconnects, to wherever the peer is then
        (the nanny of an embedded cluster restarts a dead peer elsewhere)."""
        with self._lock:
            if self._links.get(link.name) is link:
                del self._links[link.name]
            if self._peers.get(link.name, (None, None, None))[1] == link.address:
                del self._peers[link.name]

    # -- the callee's side ----------------------------------------------------------------

    def _listen(self, host: str) -> None:
        context = self._worker.security.get_listen_args("worker").get("ssl_context")
        self._listener = _wire.Listener(host, context, self._on_call)

    def _on_call(self, connection: _wire.Connection, kind: int, call_id: int, frames: Any) -> None:
        try:
            self._worker.executors["default"].submit(self._run_call, connection, call_id, frames)
        except RuntimeError as exc:  # the worker is closing
            _reply_error(connection, call_id, exc)

    def _run_call(self, connection: _wire.Connection, call_id: int, frames: Any) -> None:
        """In a worker thread: run one call and reply (for a Future, once it is done)."""
        previous = set_waiter(Seceder(is_task=False))
        # As in a dask task, distributed.get_worker() and get_client() work
        # here (dask's actors set the same context variable).
        token = _worker_context.set(self._worker)
        try:
            fn, args, kwargs = _wire.loads(frames)
            del frames
            result = run_callee(fn, args, kwargs)
        except BaseException as exc:
            _reply_error(connection, call_id, exc)
            return
        finally:
            _worker_context.reset(token)
            set_waiter(previous)
        if isinstance(result, aiopar.Future):
            result.add_done_callback(lambda done: _reply_future(connection, call_id, done))
        else:
            _reply_value(connection, call_id, result)

    # -- lifecycle --------------------------------------------------------------------------

    def _stop(self, reason: BaseException) -> None:
        """Stop serving and calling (on the loop: nothing here waits for threads)."""
        with self._lock:
            if self._stopped is not None:
                return
            self._stopped = reason
            links = list(self._links.values())
        if self._listener is not None:
            self._listener.close(timeout=None)
        for link in links:
            link.fail_all(reason)
        self._timeouts.close()
        self._settler.close(timeout=0)

    def _join(self) -> None:
        """Wait for the threads that _stop told to end."""
        if self._listener is not None:
            self._listener.close()
        thread = self._timeouts.close()
        if thread is not None:
            thread.join(5)
        for link in list(self._links.values()):
            link.reader.join(5)
        self._settler.close()

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = 30) -> Any:
        """Run a coroutine on the worker's loop from another thread and return its result."""
        loop = self._worker.loop.asyncio_loop
        if _running_loop() is loop:
            coro.close()
            raise RuntimeError("a blocking rpc call was made on the peer's event loop thread")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def _leave_together(self, deadline: float | None) -> None:
        """Graceful shutdown: this peer's calls finish, then every peer that joined leaves."""
        while any(link.pending for link in list(self._links.values())):
            if deadline is not None and time.monotonic() > deadline:
                break
            await asyncio.sleep(_POLL)
        scheduler = self._worker.scheduler
        await scheduler.set_metadata(keys=["aiopar-rpc-leaving", self._worker.rpc_token], value=1)
        async for _ in _polls(deadline):
            identity = await scheduler.identity(n_workers=-1)
            workers = identity["workers"].values()
            joined = {w["aiopar_token"] for w in workers if w.get("aiopar_joined")}
            leaving = await scheduler.get_metadata(keys=["aiopar-rpc-leaving"], default={})
            if joined <= set(leaving):
                return


# -- replies -----------------------------------------------------------------------------------


def _reply_value(connection: _wire.Connection, call_id: int, value: Any) -> None:
    try:
        frames = _wire.dumps(value)
    except Exception as exc:
        error = TypeError(
            f"the result ({type(value).__name__}) cannot be sent back: {type(exc).__name__}: {exc}"
        )
        _reply_error(connection, call_id, error)
        return
    with contextlib.suppress(OSError):  # the caller is gone
        connection.send(_wire.VALUE, call_id, *frames)


def _reply_error(connection: _wire.Connection, call_id: int, exc: BaseException) -> None:
    message = error_message(exc)  # dask's: the exception and traceback, pickled (or as text)
    traceback = message["traceback"]
    payload = (message["exception"].data, None if traceback is None else traceback.data)
    with contextlib.suppress(OSError):
        connection.send(_wire.ERROR, call_id, *_wire.dumps(payload))


def _reply_future(connection: _wire.Connection, call_id: int, done: aiopar.Future[Any]) -> None:
    try:
        value = done.value()
    except BaseException as exc:
        _reply_error(connection, call_id, exc)
    else:
        _reply_value(connection, call_id, value)


def _settle_reply(future: aiopar.Future[Any], kind: int, frames: Any, what: str, peer: str) -> None:
    """Unpickle a reply and settle its future."""
    try:
        payload = _wire.loads(frames)
    except Exception as exc:
        error = TypeError(
            f"the result of {what} came back from rpc peer {peer!r} but cannot be unpickled "
            f"here ({type(exc).__name__}: {exc}); is its class importable in this process?"
        )
        error.__cause__ = exc
        _fail(future, error)
        return
    if kind == _wire.VALUE:
        with contextlib.suppress(aiopar.InvalidStateError):  # cancelled meanwhile
            future.set_result(payload)
        return
    _, exc, tb = clean_exception(*payload)
    assert exc is not None
    if tb is not None:
        exc = exc.with_traceback(tb)
    exc.add_note(f"(raised by {what} on rpc peer {peer!r})")
    _fail(future, exc)


def _fail(future: aiopar.Future[Any], error: BaseException) -> None:
    with contextlib.suppress(aiopar.InvalidStateError):
        future.set_exception(error)


def _name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{name}()"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def _close(worker: Peer | None, cluster: SpecCluster | None) -> None:
    if worker is not None:
        await worker.close(reason="aiopar.rpc.shutdown")
    if cluster is not None:
        await cluster.close()


# -- starting peers -----------------------------------------------------------------------------


def _scheduler_spec(security: Security | None) -> dict[str, Any]:
    return {
        "cls": Scheduler,
        "options": {
            "host": LOOPBACK,
            "port": 0,
            "protocol": protocol_for(security),
            "dashboard": False,
            "dashboard_address": f"{LOOPBACK}:0",  # its HTTP server starts regardless
            "security": security,
        },
    }


def _peer_options(rank: int, joined: bool, options: RpcBackendOptions) -> dict[str, Any]:
    return {
        "rank": rank,
        "joined": joined,
        "rpc_timeout": options.rpc_timeout,
        "nthreads": options.num_worker_threads,
        "security": options.security,
        "silence_logs": logging.WARN,  # as quiet as a LocalCluster
    }


def _host_towards(address: str) -> str:
    """The local IP that reaches ``address``: 127.0.0.1 for a loopback scheduler."""
    from distributed.comm import get_address_host
    from distributed.utils import get_ip

    return get_ip(get_address_host(address))


class _Parts:
    """What ``init_rpc`` has started so far: stopped again if it fails."""

    def __init__(self) -> None:
        self.peer: Peer | None = None
        self.cluster: SpecCluster | None = None


async def _start_peer(
    address: str,
    name: str,
    rank: int | None,
    joined: bool,
    options: RpcBackendOptions,
    parts: _Parts | None = None,
) -> Peer:
    """Start this process's :class:`Peer` on the scheduler at ``address``.

    Without a rank it takes the smallest one free, under a dask lock so two
    peers joining at once do not take the same. The peer is noted in
    ``parts`` as soon as it exists.
    """
    kwargs = {**_peer_options(0, joined, options), "name": name, "host": _host_towards(address)}

    def new_peer(rank: int) -> Peer:
        peer = Peer(address, **{**kwargs, "rank": rank})
        if parts is not None:
            parts.peer = peer
        return peer

    if rank is not None:
        peer = await _registered(new_peer(rank), name)
        others = await peer.scheduler.identity(n_workers=-1)
        clash = [
            w["name"]
            for a, w in others["workers"].items()
            if a != peer.address and w.get("aiopar_rank") == rank
        ]
        if clash:
            await peer.close(reason="rank taken")
            raise ValueError(
                f"rank {rank} is taken by rpc peer {clash[0]!r}; give each a rank of its own"
            )
        return peer
    async with (
        distributed.Client(
            address, security=options.security, asynchronous=True, set_as_default=False
        ) as client,
        distributed.Lock("aiopar-rpc-ranks", scheduler_rpc=client.scheduler, loop=client.loop),
    ):
        identity = await client.scheduler.identity(n_workers=-1)
        taken = {w["aiopar_rank"] for w in identity["workers"].values() if "aiopar_rank" in w}
        free = min(set(range(len(taken) + 1)) - taken)
        return await _registered(new_peer(free), name)


async def _registered(peer: Peer, name: str) -> Peer:
    try:
        return await peer
    except Exception as exc:
        if "name taken" in str(exc) or "name taken" in str(exc.__cause__):
            raise ValueError(
                f"an rpc peer called {name!r} is in the cluster already; names are unique"
            ) from None
        raise


async def _start(
    name: str,
    rank: int | None,
    world_size: int | None,
    options: RpcBackendOptions,
    parts: _Parts,
) -> DaskRpcAgent:
    """Start this process's peer (and the embedded cluster), noting each in
    ``parts``; the caller stops them if this raises."""
    address = options.init_method
    if address is None:
        rank = 0 if rank is None else rank
        others = {f"worker{r}": r for r in range(world_size or 1) if r != rank}
        if name in others:
            raise ValueError(
                f"the embedded cluster names its other peers as torch does ({', '.join(others)}); "
                f"{name!r} is rank {others[name]}'s name: call this peer worker{rank}"
            )
        cluster = parts.cluster = SpecCluster(
            scheduler=_scheduler_spec(options.security),
            workers={
                peer_name: {
                    "cls": Nanny,
                    "options": {
                        **_peer_options(peer_rank, False, options),
                        "name": peer_name,
                        "worker_class": Peer,
                        "host": LOOPBACK,
                    },
                }
                for peer_name, peer_rank in others.items()
            },
            security=options.security,
            asynchronous=True,
            silence_logs=logging.WARN,
            name="aiopar.rpc",
        )
        await cluster
        address = cluster.scheduler_address
    peer = await _start_peer(address, name, rank, True, options, parts)
    agent = peer.rpc_agent
    agent.cluster = parts.cluster
    if world_size is not None and options.init_method is not None:
        await _wait_for_peers(agent, world_size, options.rpc_timeout)
    return agent


async def _wait_for_peers(agent: DaskRpcAgent, world_size: int, timeout: float) -> None:
    """torch's rendezvous: return once ``world_size`` peers have joined."""
    names: list[str] = []
    async for _ in _polls(time.monotonic() + timeout if timeout else None):
        await agent._refresh_peers()
        names = sorted(agent._peers)
        if len(names) >= world_size:
            return
    raise TimeoutError(
        f"init_rpc waited {timeout:g} s for {world_size} peers, and only these joined: "
        f"{', '.join(names)}"
    )


async def _polls(deadline: float | None) -> AsyncIterator[None]:
    """Look again at the scheduler until ``deadline``, more and more rarely
    (from 50 ms to 1 s apart), so a thousand waiting peers do not flood it."""
    delay = _POLL
    while deadline is None or time.monotonic() < deadline:
        yield
        await asyncio.sleep(delay)
        delay = min(2 * delay, 1.0)


class _LoopThread:
    """The event loop of this process's peer, in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aiopar-rpc-loop")
        self._thread.daemon = True
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the loop and return its result. If this thread is
        interrupted (Ctrl-C) meanwhile, ``coro`` is cancelled, and its
        cleanup has run when the interruption propagates."""
        task: asyncio.Task[Any] | None = None
        finished = threading.Event()

        def start() -> None:
            nonlocal task
            task = self.loop.create_task(coro)
            task.add_done_callback(lambda _: finished.set())

        def cancel() -> None:
            assert task is not None  # start() ran first: the loop runs callbacks in order
            task.cancel()

        self.loop.call_soon_threadsafe(start)
        try:
            finished.wait()
        except BaseException:
            self.loop.call_soon_threadsafe(cancel)
            finished.wait()
            raise
        assert task is not None
        return task.result()

    def stop(self) -> None:
        # dask resolves host names in the loop's default executor: stop its thread too
        self.run(self.loop.shutdown_default_executor())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class _Engine:
    """What ``aiopar.rpc`` finds under the ``aiopar.rpc_agents`` entry point."""

    def start(
        self, name: str, rank: int | None, world_size: int | None, options: RpcBackendOptions
    ) -> DaskRpcAgent:
        """Make this process the peer ``name`` (``init_rpc``)."""
        runner = _LoopThread()
        parts = _Parts()
        try:
            agent = runner.run(_start(name, rank, world_size, options, parts))
        except BaseException:
            _undo(runner, parts)
            raise
        agent.on_close = runner.stop
        _started.add(agent)
        return agent

    def serve(
        self, scheduler: str, name: str, rank: int | None, options: RpcBackendOptions
    ) -> None:
        """Run the peer ``name`` on ``scheduler`` in this process until it is
        interrupted (SIGINT, SIGTERM) or the scheduler goes away."""

        async def main() -> None:
            peer = await _start_peer(scheduler, name, rank, False, options)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for signum in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(signum, stop.set)
            waits = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(peer.finished())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for wait in waits:
                wait.cancel()
            await peer.close(reason="aiopar worker stopped")

        asyncio.run(main())


def _undo(runner: _LoopThread, parts: _Parts) -> None:
    """After a failed start: stop what it started, threads included, and the loop."""
    try:
        runner.run(_close(parts.peer, parts.cluster))
        if parts.peer is not None:
            agent = parts.peer.rpc_agent
            agent._join()
            if aiopar.rpc.agent._current is agent:  # Peer.start_unsafe made it current
                set_current_agent(None)
    finally:
        runner.stop()


rpc_engine = _Engine()


_started: weakref.WeakSet[DaskRpcAgent] = weakref.WeakSet()


def _leave_at_exit() -> None:
    """A peer whose process exits without ``rpc.shutdown()`` leaves anyway,
    its cluster and worker processes too."""
    for agent in list(_started):
        if agent._stopped is None:
            try:
                agent.shutdown(graceful=False)
            except Exception:
                _logger.exception("closing rpc peer %r at exit", agent.worker_info.name)
            if aiopar.rpc.agent._current is agent:
                set_current_agent(None)


# Before the thread pools that dask offloads to refuse work (see _backend.py).
getattr(threading, "_register_atexit", atexit.register)(_leave_at_exit)
