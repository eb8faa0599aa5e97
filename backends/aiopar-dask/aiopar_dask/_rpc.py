"""aiopar.rpc on dask.distributed: every peer is a dask worker.

A peer is a :class:`Peer`, a ``distributed.Worker`` that also serves rpc
calls; the scheduler is the phone book (a peer's name, rank and address).
Calls do not go through the scheduler: each caller keeps one comm per callee
(dask's own comms, so TLS and serialization are dask's) on which calls and
replies travel in batches, so a call costs one round trip between the two
processes. The callee runs each call in its worker's thread pool; a call
blocked in ``wait`` leaves the pool after 0.1 s, and an ``async_execution``
call holds no thread while its future is pending.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import pickle
import signal
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

import distributed
from distributed import Nanny, Scheduler, Security, SpecCluster
from distributed.comm import CommClosedError, connect
from distributed.core import clean_exception, error_message
from distributed.protocol import Serialized
from distributed.protocol import pickle as dask_pickle
from distributed.worker import _worker_cvar as _worker_context

import aiopar
from aiopar.backends import set_waiter
from aiopar.rpc.agent import RpcAgent, RpcBackendOptions, WorkerInfo, run_callee, set_current_agent

from ._cluster import LOOPBACK, protocol_for
from ._settle import Settler
from ._worker import Seceder

__all__ = ["Peer", "rpc_engine"]

_logger = logging.getLogger("aiopar.rpc")

_CONNECT_TIMEOUT = 5.0  # a peer that does not accept a connection by then is gone
_POLL = 0.05  # seconds between looks at the scheduler while waiting for peers


class _Value:
    """A startup_information entry (a picklable callable, as dask requires)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __call__(self, worker: Any) -> Any:
        return self.value


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
        }
        super().__init__(*args, **kwargs)
        self.rpc_agent = DaskRpcAgent(self, rank, rpc_timeout)
        self.handlers["aiopar_rpc"] = self.rpc_agent._serve

    async def start_unsafe(self) -> Peer:
        self.rpc_agent._attach()
        await super().start_unsafe()
        set_current_agent(self.rpc_agent)
        return self

    async def close(self, *args: Any, **kwargs: Any) -> Any:
        self.rpc_agent._stop(RuntimeError(f"rpc peer {self.name!r} is shutting down"))
        return await super().close(*args, **kwargs)


class _Link:
    """This peer's comm to one callee, and the calls waiting for its replies."""

    __slots__ = ("address", "name", "pending", "reader", "send")

    def __init__(self, name: str, address: str) -> None:
        self.name = name
        self.address = address
        self.send = _Sender()
        # call id -> (future, what was called, timer)
        self.pending: dict[int, tuple[aiopar.Future[Any], str, asyncio.TimerHandle | None]] = {}
        self.reader: asyncio.Task[None] | None = None  # connects, then reads the replies


def _dumps(obj: Any) -> Serialized:
    """``obj`` pickled (protocol 5, array buffers out of band) as a dask
    message part that the comm passes through untouched.

    Plain pickle first, which is what dask's pickler tries first too; its
    cloudpickle fallback (lambdas, functions defined in ``__main__``) only
    when that fails or refers to ``__main__``.
    """
    buffers: list[pickle.PickleBuffer] = []
    try:
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    except Exception:
        data = b"__main__"
    if b"__main__" in data:
        buffers.clear()
        data = dask_pickle.dumps(obj, buffer_callback=buffers.append)
    views = [memoryview(b) for b in buffers]
    return Serialized({"writeable": [not v.readonly for v in views]}, [data, *views])


def _loads(part: Serialized) -> Any:
    data, *views = part.frames
    buffers = [
        memoryview(bytearray(v)) if w and v.readonly else v
        for v, w in zip(map(memoryview, views), part.header["writeable"], strict=True)
    ]
    return pickle.loads(data, buffers=buffers)


class _Sender:
    """Messages to one comm: the first is written at once, those that come
    while a write is under way go together in the next."""

    __slots__ = ("_buffer", "_comm", "_task")

    def __init__(self) -> None:
        self._comm: Any = None
        self._buffer: list[Any] = []
        self._task: asyncio.Task[None] | None = None

    def start(self, comm: Any) -> None:
        comm.allow_offload = False  # the parts are pickled already; sizing them costs more
        self._comm = comm
        if self._buffer:
            self._task = asyncio.ensure_future(self._write())

    def send(self, *msgs: Any) -> None:
        self._buffer.extend(msgs)
        if self._task is None and self._comm is not None:
            self._task = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while self._buffer:
                batch, self._buffer = self._buffer, []
                await self._comm.write(batch, on_error="raise")
        except Exception:
            self._comm.abort()  # the reader sees it and fails what is pending
        finally:
            self._task = None

    def abort(self) -> None:
        self._buffer = []
        if self._comm is not None:
            self._comm.abort()


class _Outbox:
    """Messages from any thread to a loop: one wake-up per batch, not per message."""

    __slots__ = ("_drain", "_items", "_lock", "_loop", "_scheduled")

    def __init__(self, loop: asyncio.AbstractEventLoop, drain: Callable[[list[Any]], None]):
        self._loop = loop
        self._drain = drain
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def put(self, item: Any) -> None:
        with self._lock:
            self._items.append(item)
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: the peer is gone
            self._loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._scheduled = False
        self._drain(items)


class _RpcFuture(aiopar.Future[Any]):
    """The future of a call. Replies settle it on the event loop, which wakes
    ``rpc_sync`` at once; a done-callback that would run on the loop runs in
    the settler thread instead, since it may block."""

    __slots__ = ("_agent",)

    def __init__(self, agent: DaskRpcAgent) -> None:
        super().__init__()
        self._agent = agent

    def add_done_callback(self, fn: Callable[[aiopar.Future[Any]], object]) -> None:
        agent = self._agent

        def off_the_loop(future: aiopar.Future[Any]) -> None:
            if threading.get_ident() == agent._loop_thread:
                agent._settler.call(fn, future)
            else:
                fn(future)

        super().add_done_callback(off_the_loop)


_SMALL = 64 * 1024  # replies up to this size are unpickled on the loop


class DaskRpcAgent(RpcAgent):
    """The rpc agent of one :class:`Peer`."""

    def __init__(self, worker: Peer, rank: int, default_timeout: float) -> None:
        self._worker = worker
        self._rank = rank
        self._default_timeout = default_timeout
        self._lock = threading.Lock()
        self._peers: dict[str, tuple[WorkerInfo, str]] = {}  # name -> (info, address)
        self._links: dict[str, _Link] = {}  # by callee address
        self._ids = itertools.count()
        self._settler = Settler("rpc")
        self._outbox: _Outbox | None = None
        self._loop_thread = 0
        self._stopped: BaseException | None = None
        self.cluster: SpecCluster | None = None  # the embedded cluster init_rpc started
        self.on_close: Callable[[], None] | None = None

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
            return sorted((info for info, _ in self._peers.values()), key=lambda i: i.id)

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
        found = self._lookup(to.name)
        if found is None:
            self.peer(to.name)  # refreshes, or raises naming the peers
            found = self._lookup(to.name)
            assert found is not None
        try:
            payload = _dumps((fn, args, kwargs))
        except Exception as exc:
            raise TypeError(
                f"the call of {_name(fn)} to {to.name!r} cannot be sent: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        future = _RpcFuture(self)
        assert self._outbox is not None
        self._outbox.put((to.name, found[1], payload, future, _name(fn), timeout))
        return future

    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        deadline = None if not timeout else time.monotonic() + timeout
        if graceful:
            self._run(self._leave_together(deadline), timeout=None)
        self._run(_close(self._worker, self.cluster), timeout=None)
        self._settler.close()
        if self.on_close is not None:
            self.on_close()

    # -- the caller's side ---------------------------------------------------------------

    def _lookup(self, to: str | int) -> tuple[WorkerInfo, str] | None:
        with self._lock:
            if isinstance(to, str):
                return self._peers.get(to)
            return next((p for p in self._peers.values() if p[0].id == to), None)

    async def _refresh_peers(self) -> None:
        identity = await self._worker.scheduler.identity(n_workers=-1)
        peers = {
            str(w["name"]): (WorkerInfo(str(w["name"]), w["aiopar_rank"]), address)
            for address, w in identity["workers"].items()
            if "aiopar_rank" in w
        }
        with self._lock:
            self._peers = peers

    def _send(self, calls: list[tuple[Any, ...]]) -> None:
        """On the loop: put calls on their links."""
        loop = asyncio.get_running_loop()
        for name, address, payload, future, what, timeout in calls:
            if self._stopped is not None:
                future.set_exception(RuntimeError(f"this rpc peer has shut down: {self._stopped}"))
                continue
            link = self._links.get(address)
            if link is None:
                link = self._links[address] = _Link(name, address)
                link.reader = loop.create_task(self._open(link))
            call_id = next(self._ids)
            timer = None
            if timeout:
                timer = loop.call_later(timeout, self._expire, link, call_id, timeout)
            link.pending[call_id] = (future, what, timer)
            link.send.send({"i": call_id, "c": payload})

    async def _open(self, link: _Link) -> None:
        try:
            comm = await connect(
                link.address,
                timeout=_CONNECT_TIMEOUT,
                deserialize=False,
                **self._worker.connection_args,
            )
            await comm.write({"op": "aiopar_rpc", "caller": self._worker.name, "reply": False})
        except Exception as exc:
            self._drop(link, exc)
            return
        link.send.start(comm)
        try:
            while True:
                replies = await comm.read()
                for reply in replies:
                    entry = link.pending.pop(reply["i"], None)
                    if entry is None:
                        continue  # it timed out already
                    future, what, timer = entry
                    if timer is not None:
                        timer.cancel()
                    if "r" in reply and sum(map(len, reply["r"].frames)) > _SMALL:
                        self._settler.call(_settle_reply, future, reply, what, link.name)
                    else:
                        _settle_reply(future, reply, what, link.name)
        except Exception as exc:
            self._drop(link, exc)

    def _drop(self, link: _Link, exc: BaseException) -> None:
        """The link broke: its pending calls fail, naming the peer; the next call reconnects."""
        if self._links.get(link.address) is link:
            del self._links[link.address]
        with self._lock:
            if self._peers.get(link.name, (None, None))[1] == link.address:
                del self._peers[link.name]  # it may come back elsewhere (a nanny restarts it)
        link.send.abort()
        if not link.pending:
            return
        stopped = self._stopped
        for call_id, (future, what, timer) in list(link.pending.items()):
            if timer is not None:
                timer.cancel()
            if stopped is not None:
                error: BaseException = RuntimeError(
                    f"the call of {what} to {link.name!r} was pending when this peer shut down"
                )
            else:
                error = aiopar.BrokenWorkerError(
                    f"rpc peer {link.name!r} ({link.address}) is gone: the connection to it "
                    f"broke while the call of {what} was pending ({type(exc).__name__}: {exc})"
                )
            error.__cause__ = exc if stopped is None else stopped
            self._settler.call(_fail, future, error)
            del link.pending[call_id]

    def _expire(self, link: _Link, call_id: int, timeout: float) -> None:
        entry = link.pending.pop(call_id, None)
        if entry is not None:
            future, what, _ = entry
            error = TimeoutError(
                f"the call of {what} to rpc peer {link.name!r} had no reply after {timeout:g} s "
                f"(pass timeout= to the call, or rpc_timeout to init_rpc's options)"
            )
            self._settler.call(_fail, future, error)

    # -- the callee's side ----------------------------------------------------------------

    async def _serve(self, comm: Any, caller: str) -> Any:
        """The handler of a caller's comm: run its calls, send their replies."""
        comm.deserialize = False  # each call is unpickled in its own thread
        replies = _Sender()
        replies.start(comm)
        outbox = _Outbox(asyncio.get_running_loop(), lambda items: replies.send(*items))
        executor = self._worker.executors["default"]
        try:
            while True:
                for call in await comm.read():
                    executor.submit(self._run_call, call, outbox)
        except (CommClosedError, OSError):
            pass
        finally:
            replies.abort()
        return distributed.core.Status.dont_reply

    def _run_call(self, call: dict[str, Any], outbox: _Outbox) -> None:
        """In a worker thread: run one call; its reply goes to ``outbox``."""
        call_id = call["i"]
        previous = set_waiter(Seceder(is_task=False))
        # As in a dask task, distributed.get_worker() and get_client() work
        # here (dask's actors set the same context variable).
        token = _worker_context.set(self._worker)
        try:
            fn, args, kwargs = _loads(call["c"])
            result = run_callee(fn, args, kwargs)
        except BaseException as exc:
            outbox.put(_error_reply(call_id, exc))
            return
        finally:
            _worker_context.reset(token)
            set_waiter(previous)
        if isinstance(result, aiopar.Future):
            result.add_done_callback(lambda done: outbox.put(_future_reply(call_id, done)))
        else:
            outbox.put(_value_reply(call_id, result))

    # -- lifecycle --------------------------------------------------------------------------

    def _attach(self) -> None:
        """On the loop, once the worker runs: the outbox of the calls made here."""
        self._outbox = _Outbox(asyncio.get_running_loop(), self._send)
        self._loop_thread = threading.get_ident()

    def _stop(self, reason: BaseException) -> None:
        if self._stopped is not None:
            return
        self._stopped = reason
        for link in list(self._links.values()):
            self._drop(link, reason)
        self._settler.close(timeout=0)  # on the loop: no joins here; shutdown() joins

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = 30) -> Any:
        """Run a coroutine on the worker's loop from another thread and return its result."""
        loop = self._worker.loop.asyncio_loop
        if _running_loop() is loop:
            coro.close()
            raise RuntimeError("a blocking rpc call was made on the rpc event loop's own thread")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def _leave_together(self, deadline: float | None) -> None:
        """Graceful shutdown: this peer's calls finish, then every peer that joined leaves."""
        while any(link.pending for link in self._links.values()):
            if deadline is not None and time.monotonic() > deadline:
                break
            await asyncio.sleep(_POLL)
        scheduler = self._worker.scheduler
        await scheduler.set_metadata(keys=["aiopar-rpc-leaving", self._worker.rpc_token], value=1)
        while deadline is None or time.monotonic() < deadline:
            identity = await scheduler.identity(n_workers=-1)
            joined = {
                w["aiopar_token"] for w in identity["workers"].values() if w.get("aiopar_joined")
            }
            leaving = await scheduler.get_metadata(keys=["aiopar-rpc-leaving"], default={})
            if joined <= set(leaving):
                return
            await asyncio.sleep(_POLL)


# -- replies -----------------------------------------------------------------------------------


def _value_reply(call_id: int, value: Any) -> dict[str, Any]:
    try:
        return {"i": call_id, "r": _dumps(value)}
    except Exception as exc:
        error = TypeError(
            f"the result ({type(value).__name__}) cannot be sent back: {type(exc).__name__}: {exc}"
        )
        return _error_reply(call_id, error)


def _error_reply(call_id: int, exc: BaseException) -> dict[str, Any]:
    message = error_message(exc)  # dask's: the exception and traceback, pickled (or as text)
    traceback = message["traceback"]
    return {
        "i": call_id,
        "e": message["exception"].data,
        "t": None if traceback is None else traceback.data,
    }


def _future_reply(call_id: int, done: aiopar.Future[Any]) -> dict[str, Any]:
    try:
        value = done.value()
    except BaseException as exc:
        return _error_reply(call_id, exc)
    return _value_reply(call_id, value)


def _settle_reply(future: aiopar.Future[Any], reply: dict[str, Any], what: str, peer: str) -> None:
    """In the settler thread: unpickle a reply and settle its future."""
    if "e" in reply:
        _, exc, tb = clean_exception(reply["e"], reply["t"])
        assert exc is not None
        if tb is not None:
            exc = exc.with_traceback(tb)
        exc.add_note(f"(raised by {what} on rpc peer {peer!r})")
        _fail(future, exc)
        return
    try:
        value = _loads(reply["r"])
    except Exception as exc:
        error = TypeError(
            f"the result of {what} came back from rpc peer {peer!r} but cannot be unpickled "
            f"here ({type(exc).__name__}: {exc}); is its class importable in this process?"
        )
        error.__cause__ = exc
        _fail(future, error)
        return
    with contextlib.suppress(aiopar.InvalidStateError):  # it timed out meanwhile
        future.set_result(value)


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


async def _close(worker: Peer, cluster: SpecCluster | None) -> None:
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


async def _start_peer(
    address: str, name: str, rank: int | None, joined: bool, options: RpcBackendOptions
) -> Peer:
    """Start this process's :class:`Peer` on the scheduler at ``address``.

    Without a rank it takes the smallest one free, under a dask lock so two
    peers joining at once do not take the same.
    """
    kwargs = {**_peer_options(0, joined, options), "name": name, "host": _host_towards(address)}
    if rank is not None:
        peer = await _registered(Peer(address, **{**kwargs, "rank": rank}), name)
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
        return await _registered(Peer(address, **{**kwargs, "rank": free}), name)


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
    name: str, rank: int | None, world_size: int | None, options: RpcBackendOptions
) -> DaskRpcAgent:
    cluster = None
    address = options.init_method
    if address is None:
        rank = 0 if rank is None else rank
        others = {f"worker{r}": r for r in range(world_size or 1) if r != rank}
        if name in others:
            raise ValueError(
                f"the embedded cluster names its other peers as torch does ({', '.join(others)}); "
                f"{name!r} is rank {others[name]}'s name: call this peer worker{rank}"
            )
        cluster = await SpecCluster(
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
        address = cluster.scheduler_address
    try:
        peer = await _start_peer(address, name, rank, True, options)
    except BaseException:
        if cluster is not None:
            await cluster.close()
        raise
    agent = peer.rpc_agent
    agent.cluster = cluster
    if world_size is not None and options.init_method is not None:
        await _wait_for_peers(agent, world_size, options.rpc_timeout)
    return agent


async def _wait_for_peers(agent: DaskRpcAgent, world_size: int, timeout: float) -> None:
    """torch's rendezvous: return once ``world_size`` peers have joined."""
    deadline = time.monotonic() + timeout if timeout else None
    while True:
        await agent._refresh_peers()
        names = sorted(agent._peers)
        if len(names) >= world_size:
            return
        if deadline is not None and time.monotonic() > deadline:
            await _close(agent._worker, None)
            raise TimeoutError(
                f"init_rpc waited {timeout:g} s for {world_size} peers, and only these joined: "
                f"{', '.join(names)}"
            )
        await asyncio.sleep(_POLL)


class _LoopThread:
    """The event loop of this process's peer, in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="aiopar-rpc-loop")
        self._thread.daemon = True
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

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
        try:
            agent = runner.run(_start(name, rank, world_size, options))
        except BaseException:
            runner.stop()
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
