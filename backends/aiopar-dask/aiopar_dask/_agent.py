"""The rpc agent of one peer: it knows the peers, calls them, and serves their calls.

The scheduler is the phone book (each peer's name, id and rpc port). A
call goes on the :class:`~._link.Link` to its callee, connected on first
use. The callee runs each call in its worker's thread pool; a call blocked
in ``wait`` leaves the pool after 0.1 s (so another thread takes its place),
at most :data:`COMPENSATION_LIMIT` at once, and an ``async_execution`` call
holds no thread while its future is pending.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, NamedTuple

import distributed
from distributed import SpecCluster
from distributed.comm.addressing import get_address_host
from distributed.worker import _worker_cvar as _worker_context

import aiopar
from aiopar.lowlevel import HAVE_MEMFD, SegmentPool, set_callback_runner, set_waiter
from aiopar.rpc.agent import RpcAgent, WorkerInfo, run_callee

from . import _errors, _rounds, _wire
from ._link import Link, Timeouts, fail
from ._script import script_identity
from ._settle import Settler
from ._worker import Seceder

__all__ = ["COMPENSATION_LIMIT", "DaskRpcAgent", "close_peer"]

COMPENSATION_LIMIT = 64
"""How many calls blocked in ``wait`` a peer replaces in its thread pool at once.

A call that has waited 0.1 s leaves the pool, and a new thread takes its
place, so calls that wait on each other do not deadlock a small pool. Past
this many, a blocked call keeps its pool thread: a peer runs calls in at
most ``num_worker_threads + COMPENSATION_LIMIT`` threads, and a chain of
nested blocking calls deeper than that through one peer waits for its
timeout (``@async_execution`` functions hold no thread while they wait).
As :data:`aiopar.backends.thread.COMPENSATION_LIMIT` does for a thread pool.
"""

_logger = logging.getLogger("aiopar.rpc")

_CONNECT_TIMEOUT = 5.0  # a peer that does not accept a connection by then is gone
# Calls to a peer known to have gone ask the scheduler whether it is back at
# most this often (seconds), whatever their number: a retry loop aimed at a
# dead peer costs the scheduler nothing, and one that joins again is found.
_RELOOK = 1.0
_REPLY_THREADS = 16  # replies unpickled at once, each behind no other (see _link)


class _Where(NamedTuple):
    """Where a peer listens, as the scheduler lists it."""

    info: WorkerInfo
    address: str  # its dask worker's
    port: int  # its rpc listener's, on the address's host
    local: str | None  # its Unix socket's name, for peers of its machine
    script: str | None  # what it runs as __main__ (see _script)


class DaskRpcAgent(RpcAgent):
    """The rpc agent of one peer: the dask ``worker`` it serves calls in,
    with id ``peer_id``; ``token`` tells this peer from the others on the
    scheduler (see :meth:`shutdown`)."""

    def __init__(
        self, worker: distributed.Worker, peer_id: int, default_timeout: float, token: str
    ) -> None:
        self._worker = worker
        self._id = peer_id
        self._default_timeout = default_timeout
        self._token = token
        self._secret: bytes | None = None  # the cluster's, once this peer listens
        self._lock = threading.Lock()
        self._peers: dict[str, _Where] = {}  # by name
        self._departed: dict[str, _Where] = {}  # by name: peers seen that have gone since
        self._looked_up = -_RELOOK  # time.monotonic() of the last look-up of the peers
        self._links: dict[str, Link] = {}  # by callee name
        # whether the caller on a connection runs this process's script
        self._callers: weakref.WeakKeyDictionary[_wire.Connection, bool] = (
            weakref.WeakKeyDictionary()
        )
        self._settler = Settler("rpc")
        self._timeouts = Timeouts(self._settler.call)
        self._compensation = threading.BoundedSemaphore(COMPENSATION_LIMIT)
        # The one thread that reads this peer's connections, and the threads
        # that unpickle the replies it does not: a callback of a call they
        # settle may block, even on a reply they are to read.
        self._hub = _wire.Hub(thread_init=lambda: set_callback_runner(self._settler.call))
        self._replies = Settler(
            "rpc-reply",
            threads=_REPLY_THREADS,
            thread_init=lambda: set_callback_runner(self._settler.call),
        )
        self._listener: _wire.Listener | None = None
        # Big buffers to peers of this machine go through shared memory from here.
        self._segments = SegmentPool() if HAVE_MEMFD else None
        self._stopped: BaseException | None = None
        self._scheduler_gone: str | None = None  # why the peers cannot be looked up
        self._scheduler_lost = asyncio.Event()  # set with _scheduler_gone, on the worker's loop
        self._staying: list[int] | None = None  # the ranks shutdown's barrier last waited for
        self.cluster: SpecCluster | None = None  # the cluster or scheduler init_rpc started
        self.round: str | None = None  # the rendezvous this peer's rank joined (see _rounds)
        self.on_close: Callable[[], None] | None = None

    @property
    def worker(self) -> distributed.Worker:
        """The dask worker this peer serves its calls in."""
        return self._worker

    @property
    def token(self) -> str:
        """What tells this peer from the others on the scheduler, whatever its name."""
        return self._token

    @property
    def hub(self) -> _wire.Hub:
        return self._hub

    @property
    def timeouts(self) -> Timeouts:
        return self._timeouts

    @property
    def stopped(self) -> BaseException | None:
        """Why this peer stopped serving and calling, or None while it serves."""
        return self._stopped

    def read_later(self, fn: Callable[..., object], *args: Any) -> None:
        self._replies.call(fn, *args)

    @property
    def port(self) -> int:
        assert self._listener is not None
        return self._listener.port

    @property
    def local(self) -> str | None:
        """The name of the Unix socket that peers of this machine connect to, if any."""
        assert self._listener is not None
        return self._listener.local

    # -- RpcAgent ------------------------------------------------------------------

    @property
    def worker_info(self) -> WorkerInfo:
        return WorkerInfo(str(self._worker.name), self._id)

    @property
    def default_timeout(self) -> float:
        return self._default_timeout

    def set_default_timeout(self, seconds: float) -> None:
        self._default_timeout = seconds

    def peer(self, to: str | int) -> WorkerInfo:
        """The peer called or ranked ``to``. One known to have gone fails
        at once: the scheduler is asked whether it is back at most once
        every ``_RELOOK`` seconds."""
        found = self._lookup(to)
        if found is None and self._scheduler_gone is None:
            known_gone = self._lookup(to, self._departed) is not None
            if not known_gone or time.monotonic() - self._looked_up >= _RELOOK:
                self._run(self.refresh_peers())
                found = self._lookup(to)
        if found is None:
            gone = self._lookup(to, self._departed)
            if gone is not None:
                raise aiopar.BrokenWorkerError(
                    f"rpc peer {gone.info.name!r} (id {gone.info.id}) has left or died "
                    f"(it was at {gone.address})"
                )
            listing = ", ".join(f"{info.name} (id {info.id})" for info in self.peers()) or "none"
            what = f"called {to!r}" if isinstance(to, str) else f"with id {to}"
            if self._scheduler_gone is not None:
                raise ValueError(
                    f"this peer knows no rpc peer {what}, and cannot look it up: "
                    f"{self._scheduler_gone}; the peers it knows are: {listing}"
                )
            raise ValueError(f"there is no rpc peer {what}; the peers are: {listing}")
        return found.info

    def peers(self) -> list[WorkerInfo]:
        if self._scheduler_gone is None:  # else: the peers known when it went
            self._run(self.refresh_peers())
        with self._lock:
            return sorted((p.info for p in self._peers.values()), key=lambda info: info.id)

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
            frames = _wire.dumps((fn, args, kwargs), self._same_script(to.name))
        except (TypeError, AttributeError, pickle.PicklingError) as exc:  # what cannot pickle
            raise TypeError(
                f"the call of {_name(fn)} to {to.name!r} cannot be sent: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        future: aiopar.Future[Any] = aiopar.Future()
        what = _name(fn)
        try:
            link = self._link(to.name)
            link.call(future, what, frames, timeout)
        except (OSError, aiopar.BrokenWorkerError) as exc:
            with self._lock:
                found = self._peers.get(to.name)
                if found is not None:
                    self._depart(to.name, found.address)
            error = aiopar.BrokenWorkerError(
                f"rpc peer {to.name!r} cannot be reached, it may have left or died "
                f"({type(exc).__name__}: {exc})"
            )
            error.__cause__ = exc
            fail(future, error)
        return future

    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        deadline = None if not timeout else time.monotonic() + timeout
        try:
            if graceful:
                self._run(self._leave_together(deadline), timeout=None)
            self._run(close_peer(self._worker, self.cluster), timeout=None)
        finally:  # whatever failed above, no thread of this peer stays
            self.join()
            if self.on_close is not None:
                self.on_close()

    # -- the caller's side -------------------------------------------------------------

    @property
    def scheduler_gone(self) -> str | None:
        """Why the scheduler is lost, or None while it serves."""
        return self._scheduler_gone

    def lose_scheduler(self, reason: str) -> None:
        """The scheduler is gone: the peers known now are all this peer will
        know. On the worker's loop."""
        self._scheduler_gone = reason
        self._scheduler_lost.set()

    def _lookup(self, to: str | int, among: dict[str, _Where] | None = None) -> _Where | None:
        """The peer called or ranked ``to`` among the peers (or ``among``)."""
        with self._lock:
            where = self._peers if among is None else among
            if isinstance(to, str):
                return where.get(to)
            return next((p for p in where.values() if p.info.id == to), None)

    async def refresh_peers(self) -> None:
        """Look the peers up on the scheduler again."""
        self._looked_up = time.monotonic()
        identity = await self._worker.scheduler.identity(n_workers=-1)
        peers = {
            str(w["name"]): _Where(
                WorkerInfo(str(w["name"]), w["aiopar_id"]),
                a,
                w["aiopar_rpc_port"],
                w.get("aiopar_rpc_local"),
                w.get("aiopar_script"),
            )
            for a, w in identity["workers"].items()
            if "aiopar_id" in w
        }
        with self._lock:
            for name in self._peers.keys() - peers.keys():
                self._departed[name] = self._peers[name]
            for name in peers.keys() & self._departed.keys():
                del self._departed[name]  # back (a nanny restarted it)
            self._peers = peers

    def _same_script(self, name: str) -> bool:
        """Whether the peer called ``name`` runs this process's script as
        its ``__main__``: what this process sends it of ``__main__`` goes
        by name (see ``_script``)."""
        found = self._lookup(name)
        return found is not None and found.script is not None and found.script == script_identity()

    def _caller_runs_this_script(self, connection: _wire.Connection) -> bool:
        """:meth:`_same_script` for the caller on ``connection``, found out
        on its first call (looked up if it is new here: a rank that met
        the others first calls before they know it)."""
        known = self._callers.get(connection)
        if known is None:
            name = connection.peer_name
            if self._lookup(name) is None and self._scheduler_gone is None:
                with contextlib.suppress(Exception):  # then its replies go by value
                    self._run(self.refresh_peers())
            known = self._callers[connection] = self._same_script(name)
        return known

    def _depart(self, name: str, address: str) -> None:
        """The peer ``name`` at ``address`` cannot be reached: look it up
        again next time (it may be back elsewhere). With the lock held."""
        found = self._peers.get(name)
        if found is not None and found.address == address:
            self._departed[name] = self._peers.pop(name)

    def _link(self, name: str) -> Link:
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
        host = get_address_host(found.address)
        context = self._worker.connection_args.get("ssl_context")
        secret = self._secret
        assert secret is not None  # set before the peer listens, and so before any call
        connection = _wire.connect(
            host,
            found.port,
            _CONNECT_TIMEOUT,
            context,
            secret,
            self.worker_info.name,
            local=found.local,
            segments=self._segments,
        )
        with self._lock:
            if self._stopped is not None:
                connection.close()
                raise RuntimeError(f"this rpc peer has shut down: {self._stopped}")
            link = self._links.get(name)
            if link is None:
                link = self._links[name] = Link(self, name, found.address, connection)
                return link
        connection.close()  # another thread connected first
        return link

    def forget_link(self, link: Link) -> None:
        """A broken link: the next call reconnects, to wherever the peer is then
        (the nanny of an embedded cluster restarts a dead peer elsewhere)."""
        with self._lock:
            if self._links.get(link.name) is link:
                del self._links[link.name]
            self._depart(link.name, link.address)

    # -- the callee's side ----------------------------------------------------------------

    def listen(self, host: str, secret: bytes) -> None:
        """Serve calls on ``host`` from peers that hold the cluster's ``secret``."""
        self._secret = secret
        context = self._worker.security.get_listen_args("worker").get("ssl_context")
        self._listener = _wire.Listener(
            self._hub, host, context, secret, self._on_call, self._segments
        )

    def _on_call(self, connection: _wire.Connection, kind: int, call_id: int, frames: Any) -> None:
        try:
            self._worker.executors["default"].submit(self._run_call, connection, call_id, frames)
        except RuntimeError as exc:  # the worker is closing
            _reply_error(connection, call_id, exc)

    def _run_call(self, connection: _wire.Connection, call_id: int, frames: Any) -> None:
        """In a worker thread: run one call and reply (for a Future, once it is done)."""
        previous = set_waiter(_CallWaiter(self._compensation))
        # As in a dask task, distributed.get_worker() and get_client() work
        # here (dask's actors set the same context variable).
        token = _worker_context.set(self._worker)
        what = "a call that cannot be unpickled"
        try:
            fn, args, kwargs = _read_call(frames, connection.peer_name, self._worker.name)
            frames.clear()  # (the pool's work item holds the list until this returns)
            what = _name(fn)
            result = run_callee(fn, args, kwargs)
            # Let go of the arguments before replying: the release of the
            # shared memory they came in then goes ahead of the reply.
            del fn, args, kwargs
        except BaseException as exc:
            _raised(what, connection, exc)
            _reply_error(connection, call_id, exc)
            return
        finally:
            _worker_context.reset(token)
            set_waiter(previous)
        by_name = self._caller_runs_this_script(connection)
        if isinstance(result, aiopar.Future):
            result.add_done_callback(
                lambda done: _reply_future(what, connection, call_id, done, by_name)
            )
        else:
            _reply_value(connection, call_id, result, by_name)
        # A future that failed inside fn holds this frame: no cycle (see aiopar's Future).
        del result

    # -- lifecycle --------------------------------------------------------------------------

    def stop(self, reason: BaseException) -> None:
        """Stop serving and calling (on the loop: nothing here waits for threads)."""
        with self._lock:
            if self._stopped is not None:
                return
            self._stopped = reason
            links = list(self._links.values())
        if self._listener is not None:
            self._listener.close()
        for link in links:
            link.fail_all(reason)
        self._timeouts.close()
        self._replies.close(timeout=0)
        self._settler.close(timeout=0)

    def join(self) -> None:
        """Wait for the threads that :meth:`stop` told to end."""
        if self._listener is not None:
            self._listener.close()
        thread = self._timeouts.close()
        if thread is not None:
            thread.join(5)
        self._hub.close()
        if self._segments is not None:
            self._segments.close()  # (the mappings of other peers stay valid)
        self._replies.close()
        self._settler.close()

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float | None = 30) -> Any:
        """Run a coroutine on the worker's loop from another thread and return its result."""
        loop = self._worker.loop.asyncio_loop  # type: ignore[attr-defined]
        if _running_loop() is loop:
            coro.close()
            raise RuntimeError("a blocking rpc call was made on the peer's event loop thread")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def _leave_together(self, deadline: float | None) -> None:
        """Graceful shutdown: this peer's calls finish, then the peers of its
        round that joined leave together (without a scheduler to meet at,
        this one alone)."""
        while any(link.pending for link in list(self._links.values())):
            if deadline is not None and time.monotonic() > deadline:
                break
            await asyncio.sleep(_rounds.POLL)
        if self._scheduler_gone is None and self._stopped is None and self.round is not None:
            # Whatever the barrier waits on, the scheduler's going ends it: a
            # rank that crashed took it along (rank 0 hosts it), or left
            # without a word; there is no one left to meet.
            try:
                await self.unless_scheduler_lost(self._meet_and_outlast(deadline))
            except OSError as exc:  # the scheduler went meanwhile
                self.lose_scheduler(f"the scheduler went away ({type(exc).__name__}: {exc})")
            if self._scheduler_gone is not None:
                self._warn_left_without()

    async def unless_scheduler_lost(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Await ``coro`` and return True; once the scheduler is lost (even
        while dask tries to reconnect to it), cancel it and return False."""
        task = asyncio.ensure_future(coro)
        lost = asyncio.ensure_future(self._scheduler_lost.wait())
        try:
            await asyncio.wait([task, lost], return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
            if not task.done():
                task.cancel()
                await asyncio.wait([task])
        if task.cancelled():
            return False
        task.result()
        return True

    async def _meet_and_outlast(self, deadline: float | None) -> None:
        await self._meet_the_others(deadline)
        if self.cluster is not None:
            await self._outlast_the_others(deadline)

    def _warn_left_without(self) -> None:
        """Say which ranks this peer's shutdown did not wait for, as the scheduler went."""
        ranks = [r for r in self._staying or () if r != self._id]
        named = ", ".join(
            f"{r} ({where.info.name})"
            if (where := self._lookup(r) or self._lookup(r, self._departed))
            else str(r)
            for r in ranks
        )
        if not ranks:  # (it had not heard from the scheduler who stays)
            waited = "without meeting the other ranks"
        else:
            whom = f"rank {named}" if len(ranks) == 1 else f"ranks {named}"
            waited = f"without waiting for {whom}, which had not called shutdown"
        _logger.warning(
            "rpc peer %r: shutdown left %s: %s (a rank that crashed takes the scheduler it "
            "started along)",
            self.worker_info.name,
            waited,
            self._scheduler_gone,
        )

    async def _meet_the_others(self, deadline: float | None) -> None:
        """Wait until every member of this peer's round that joined has said it leaves."""
        assert self.round is not None
        scheduler = self._worker.scheduler
        await _rounds.leaving(scheduler, self.round, self._token)
        async for _ in _rounds.polls(deadline):
            self._staying = await _rounds.staying(scheduler, self.round)
            if self._scheduler_gone is not None or not self._staying:
                return

    async def _outlast_the_others(self, deadline: float | None) -> None:
        """The scheduler this process started closes with it: the peers met
        go first, so that none of them sees the scheduler go."""
        assert self.round is not None
        async for _ in _rounds.polls(deadline):
            if self._scheduler_gone is not None:
                return
            if not await _rounds.present(self._worker.scheduler, self.round) - {self._token}:
                return


class _CallWaiter(Seceder):
    """The waiter of a thread that runs a call: it leaves the pool once
    blocked long, while the peer has compensation left."""

    __slots__ = ("_compensation",)

    def __init__(self, compensation: threading.BoundedSemaphore) -> None:
        super().__init__(is_task=False)
        self._compensation = compensation

    def blocked_long(self) -> None:
        if self._seceded or not self._compensation.acquire(blocking=False):
            return
        super().blocked_long()
        if not self._seceded:  # not a pool thread: nothing to replace
            self._compensation.release()

    def resumed(self) -> None:
        seceded = self._seceded
        super().resumed()
        if seceded:
            self._compensation.release()


# -- replies -----------------------------------------------------------------------------------


def _read_call(frames: Any, caller: str, callee: object) -> Any:
    """A call's function and arguments. What unpickling them raises is the
    data's, not this process's, and goes back to the caller noted as such:
    an exception as itself (an AttributeError for a function the callee
    lacks, as torch raises), anything else (a SystemExit, which would end
    the caller) as a TypeError."""
    try:
        return _wire.loads(frames)
    except Exception as exc:
        exc.add_note(f"(raised unpickling a call from rpc peer {caller!r} on {callee!r})")
        raise
    except BaseException as exc:
        raise TypeError(
            f"a call from rpc peer {caller!r} cannot be unpickled on rpc peer {callee!r}: "
            f"unpickling it raised {type(exc).__name__}({exc})"
        ) from exc


def _reply_value(connection: _wire.Connection, call_id: int, value: Any, by_name: bool) -> None:
    try:
        frames = _wire.dumps(value, by_name)
    except Exception as exc:
        error = TypeError(
            f"the result ({type(value).__name__}) cannot be sent back: {type(exc).__name__}: {exc}"
        )
        _reply_error(connection, call_id, error)
        return
    with contextlib.suppress(_wire.ConnectionClosed):  # the caller is gone
        connection.send(_wire.VALUE, call_id, *frames, wait=False)  # never blocks the pool


def _reply_error(connection: _wire.Connection, call_id: int, exc: BaseException) -> None:
    with contextlib.suppress(_wire.ConnectionClosed):
        connection.send(_wire.ERROR, call_id, *_wire.dumps(_errors.pack(exc)), wait=False)


def _reply_future(
    what: str, connection: _wire.Connection, call_id: int, done: aiopar.Future[Any], by_name: bool
) -> None:
    # Read without raising: a raise here would add this frame, which holds
    # ``done``, to the traceback of its exception (a reference cycle).
    if done.cancelled():
        error: BaseException | None = aiopar.CancelledError(f"{done!r} was cancelled")
    else:
        error = done.exception()
    if error is None:
        _reply_value(connection, call_id, done.value(), by_name)
    else:
        _raised(what, connection, error)
        _reply_error(connection, call_id, error)


def _raised(what: str, connection: _wire.Connection, exc: BaseException) -> None:
    """A call failed here: the caller gets the exception; the callee's log
    has it at debug level, naming the caller (as torch's callee logs it)."""
    _logger.debug(
        "%s, called by rpc peer %r, raised %s",
        what,
        connection.peer_name,
        type(exc).__name__,
        exc_info=exc,
    )


def _name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{name}()"


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def close_peer(worker: distributed.Worker | None, cluster: SpecCluster | None) -> None:
    if worker is not None:
        await worker.close(reason="aiopar.rpc.shutdown")
    if cluster is not None:
        await cluster.close()  # type: ignore[misc]
