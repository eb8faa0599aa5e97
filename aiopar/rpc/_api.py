"""init_rpc, the three ways to call a peer, and shutdown."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from aiopar import Future
from aiopar.lowlevel import check_count

from . import agent as _agent
from ._rendezvous import rendezvous
from ._rref import RRef, call_peer, forget_owned, remote_value, send_changes
from .agent import (
    RpcBackendOptions,
    WorkerInfo,
    check_peer_name,
    check_rpc_timeout,
    check_timeout,
)

__all__ = [
    "get_rpc_timeout",
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "set_rpc_timeout",
    "shutdown",
]

T = TypeVar("T")

_init_lock = threading.Lock()


def is_available() -> bool:
    """Whether an rpc engine (such as the aiopar-dask distribution) is installed.

    True does not mean that :func:`init_rpc` was called; this starts nothing
    and never raises.
    """
    return bool(_agent.installed_engines())


def init_rpc(
    name: str,
    backend: str | None = None,
    rank: int | None = -1,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
) -> None:
    """Make this process the peer called ``name``; return once it can call and be called.

    Where the ranks meet is ``rpc_backend_options.init_method``, as torch
    reads it:

    - ``"env://"``, torch's default, also taken when no ``init_method`` is
      given and ``MASTER_ADDR`` or ``MASTER_PORT`` is set: the rendezvous is
      at ``MASTER_ADDR:MASTER_PORT``, and ``RANK`` and ``WORLD_SIZE`` stand
      for a ``rank`` or ``world_size`` not given;
    - ``"tcp://host:port"``: the rendezvous is there. Rank 0 starts it (a
      dask scheduler listening on that host, with aiopar-dask; loopback for
      ``localhost``) unless one answers there already (then it joins that
      one); every other rank joins it, trying until ``rpc_timeout`` while
      nothing listens there, so the ranks may start in any order;
    - a dask scheduler's address (``"tls://..."`` included): every rank
      joins it;
    - none of them: an embedded cluster on this machine is started,
      listening on loopback only, whose peers are this process (rank 0)
      and the other ranks below ``world_size`` (None counts as 1), started
      as processes of this machine and named as torch names them
      (``worker<rank>``). A peer of that cluster that dies is started
      again, with an empty state. Only rank 0 starts a world of its own.

    Joining, this process is the peer of rank ``rank`` or, without one,
    of the smallest free one; when ``world_size`` is given, ``init_rpc``
    returns once ranks 0 to ``world_size - 1`` of this job have each
    joined (as every process of a torch job calls it; a rank that joined
    and left already counts, peers without a rank or with a higher one do
    not, nor do the ranks of an earlier job on the same scheduler: each
    job meets on its own). ``rank=-1`` is torch's "not set", the same as
    None.
    ``backend`` names the engine when several are installed, as a
    :class:`BackendType` or an engine's name (by default ``"dask"``, or the
    only one). The positional order is torch's.

    Calls from several threads are serialised: one of them makes this
    process a peer, the others raise RuntimeError. If it raises (or is
    interrupted), this process is not a peer, what the engine started
    for it has stopped, and ``init_rpc`` may be called again.

    It raises:

    - RuntimeError if this process is a peer already (call :func:`shutdown`
      first), or no engine is installed (the message says which
      distribution to install);
    - ValueError for a name torch refuses (empty, over 128 characters, or
      with a character other than ``A-Za-z0-9_-:``), a name or rank that
      another peer has, a name the embedded cluster gives one of its own
      peers, ``rank >= world_size``, a rank above 0 with no rendezvous to
      join (the message names ``MASTER_ADDR`` and ``MASTER_PORT``), a rank
      or world size that is not a whole number (ranks from 0, world sizes
      from 1), ``env://`` without ``MASTER_ADDR`` or ``MASTER_PORT`` or with
      a variable that is not a number where one is needed (each message
      names the variable), or an engine ``backend`` that is not installed;
    - TypeError for a ``name`` that is not a string, options that are not
      :class:`RpcBackendOptions`, or a ``backend`` that is not a string;
    - TimeoutError if, joining, nothing listens at a ``tcp://`` rendezvous
      after the options' ``rpc_timeout`` seconds, or fewer than
      ``world_size`` ranks have joined by then (the message names the
      missing ranks; never, if it is 0 or infinite);
    - OSError naming the scheduler's address, and what was found there, if
      no dask scheduler answers at it within ``rpc_timeout`` seconds, or
      if it takes TLS and this process has no certificates for it (the
      message says where to give them) (aiopar-dask).
    """
    check_peer_name(name)
    if rank == -1:  # torch's "not set"
        rank = None
    check_count(rank, "rank", minimum=0, none="the smallest free one")
    check_count(world_size, "world_size", none="any number of peers")
    options = RpcBackendOptions() if rpc_backend_options is None else rpc_backend_options
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(
            f"rpc_backend_options must be aiopar.rpc.RpcBackendOptions, "
            f"got {type(options).__name__}"
        )
    _check_rank_below(rank, world_size)
    init_method, rank, world_size = rendezvous(options.init_method, rank, world_size)
    _check_rank_below(rank, world_size)  # (either may come from env://)
    if init_method != options.init_method:
        options = dataclasses.replace(options, init_method=init_method)
    if backend is not None and not isinstance(backend, str):
        _agent.find_engine(backend)  # raises TypeError, naming what backend would be
    with _init_lock:
        current = _agent.current_agent_or_none()
        if current is not None:
            raise RuntimeError(
                f"this process is RPC peer {current.worker_info.name!r} already; "
                f"call aiopar.rpc.shutdown() before init_rpc() again"
            )
        engine = _agent.find_engine(backend)
        try:
            agent = engine.start(name, rank, world_size, options)
        except BaseException:
            # The engine's peer may have made itself current, and even been
            # called, before the start failed: this process is no peer.
            _agent.set_current_agent(None)
            forget_owned()
            raise
        _agent.set_current_agent(agent)


def _check_rank_below(rank: int | None, world_size: int | None) -> None:
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the group of peers; return once this peer has stopped.

    With ``graceful`` (torch's default), first wait until the calls this
    peer made have their replies, and until every other peer of this job
    whose process called :func:`init_rpc` has called ``shutdown`` too, so
    nobody leaves while a call may still reach it. ``timeout`` bounds that wait, in
    seconds (0: no limit); once it passes, this peer leaves anyway, without
    raising. Then this peer stops serving calls, and the calls it made that
    still have no reply fail with RuntimeError; the embedded cluster that
    :func:`init_rpc` started, if it did, stops with its peers. Values this
    peer owned through RRefs are dropped.

    Afterwards this process is no longer a peer, even if stopping raised,
    and :func:`init_rpc` may be called again. Raises RuntimeError if this
    process is not a peer, and ValueError, before it does anything, for a
    ``timeout`` that is not a number >= 0.
    """
    if (
        not isinstance(timeout, int | float)
        or isinstance(timeout, bool)
        or not timeout >= 0  # NaN is not
    ):
        raise ValueError(
            f"timeout is the most seconds a graceful shutdown waits for the other peers, "
            f"a number >= 0 (0: no limit), got {timeout!r}"
        )
    agent = _agent.current_agent()
    if graceful:
        send_changes(agent)  # the owners hear which RRefs this peer let go
    try:
        agent.shutdown(graceful=graceful, timeout=timeout)
    finally:
        _agent.set_current_agent(None)
        forget_owned()


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of the peer called ``worker_name``, or of this peer.

    ``worker_name`` may also be a peer's id (its rank). A peer that joined
    since this process last looked is found too (aiopar-dask asks the
    scheduler again before it gives up). Raises ValueError listing the peers
    if there is none by that name or id, RuntimeError naming a peer that
    was there and has left or died (:class:`aiopar.BrokenWorkerError` with
    aiopar-dask), TypeError for a ``worker_name`` that is neither, and
    RuntimeError if this process is not a peer.
    """
    agent = _agent.current_agent()
    if worker_name is None:
        return agent.worker_info
    return agent.peer(_check_to(worker_name))


def get_rpc_timeout() -> float:
    """The default timeout of this process's calls, in seconds (0: no limit).

    It is ``rpc_timeout`` of the options given to :func:`init_rpc` until
    :func:`set_rpc_timeout` changes it; a call whose timeout is -1 (the
    default) uses it. Raises RuntimeError if this process is not a peer.
    """
    return _agent.current_agent().default_timeout


def set_rpc_timeout(rpc_timeout: float) -> None:
    """Make ``rpc_timeout`` seconds the default timeout of this process's
    later calls (0 or ``float("inf")``: no limit); calls already made keep
    theirs. torch's tests spell it ``_set_rpc_timeout``, which is this.

    Raises ValueError for anything but a number of seconds >= 0, and
    RuntimeError if this process is not a peer.
    """
    seconds = check_rpc_timeout(rpc_timeout)
    # as every timeout: more seconds than a lock can wait mean no limit
    _agent.current_agent().set_default_timeout(check_timeout(seconds, seconds))


_set_rpc_timeout = set_rpc_timeout


def rpc_async(
    to: str | int | WorkerInfo,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = -1,
) -> Future[T]:
    """Run ``func(*args, **kwargs)`` on peer ``to``; return its future without waiting for it.

    ``to`` is a peer's name, id or :class:`WorkerInfo` (looked up by its
    name); ``args`` a tuple or list, ``kwargs`` a mapping. The future works
    as every :class:`aiopar.Future` does (``wait``, ``await``, ``then``,
    :func:`aiopar.as_completed`) and settles exactly once, with:

    - the value ``func`` returned (for an ``@async_execution`` function,
      the outcome of the future it returned; a coroutine function's
      coroutine is awaited on the callee);
    - or the exception ``func`` raised, with its type and the callee's
      traceback;
    - or TimeoutError once ``timeout`` seconds pass without a reply (-1:
      the ``rpc_timeout`` of :func:`init_rpc`'s options, 60 s unless set;
      0, None or ``float("inf")``: no limit, as is any number of seconds
      too large for a lock to wait, ``threading.TIMEOUT_MAX``);
    - or an error naming the peer, saying that it left or died, as soon as
      its connection breaks or it cannot be reached (a RuntimeError:
      :class:`aiopar.BrokenWorkerError` with aiopar-dask), or RuntimeError
      if this peer shuts down before the reply comes.

    ``func`` and the arguments travel as pickles. A function (or class)
    defined in this process's ``__main__`` travels by name to a peer that
    runs the same script, as torch sends it, so the callee runs its own,
    with its own module state; to any other peer, by value, with copies of
    the globals it uses (aiopar-dask).

    Cancelling the future only stops waiting for it: the call still runs
    on the callee, and its reply is dropped. Safe to call from any thread.

    It raises at once, before the call is sent:

    - RuntimeError if this process is not a peer, and for a ``to`` that
      has left or died once this peer knows it (aiopar-dask:
      :class:`aiopar.BrokenWorkerError`, naming it);
    - ValueError listing the peers for an unknown ``to``, and for a
      ``timeout`` that is not -1, None or a number of seconds >= 0 (NaN
      is not);
    - TypeError for a ``func`` that is not callable, ``args`` or ``kwargs``
      of another type, and arguments that do not pickle.
    """
    agent = _agent.current_agent()
    if not callable(func):
        raise TypeError(f"func must be a callable to run on {to!r}, got {type(func).__name__}")
    return call_peer(
        agent,
        _peer_of(agent, to),
        func,
        _check_args(args),
        _check_kwargs(kwargs),
        check_timeout(timeout, agent.default_timeout),
    )


def rpc_sync(
    to: str | int | WorkerInfo,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = -1,
) -> T:
    """Run ``func(*args, **kwargs)`` on peer ``to``, wait, and return its value.

    ``rpc_async(to, func, args, kwargs, timeout).wait()``: the same
    arguments; what would fail the future of :func:`rpc_async` (the
    callee's exception, TimeoutError, a dead peer) is raised here, and so
    is what :func:`rpc_async` raises at once. Called inside a callee, a
    wait longer than 0.1 s leaves the callee's thread pool (aiopar-dask),
    so one-thread peers that call each other do not deadlock. In async
    code, ``await rpc_async(...)`` instead: this blocks the event loop's
    thread.
    """
    return rpc_async(to, func, args, kwargs, timeout).wait()


def remote(
    to: str | int | WorkerInfo,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = -1,
) -> RRef[T]:
    """Run ``func(*args, **kwargs)`` on peer ``to`` and keep the value there.

    Returns an :class:`RRef` owned by ``to`` without waiting, before the
    value exists; :meth:`RRef.to_here` waits for the value and raises what
    ``func`` raised, and the proxies of :meth:`RRef.rpc_sync` and the like
    run their methods on the value once it exists. ``func`` may be a class:
    ``remote("worker1", Counter)`` makes a Counter that lives on worker1.
    An ``@async_execution`` function's future, and a coroutine function's
    coroutine, are waited for on ``to``: their outcome is the value.

    ``timeout`` (as in :func:`rpc_async`) bounds the call that creates the
    value, not the uses of the RRef; if it times out, the RRef fails, as
    torch's does: its uses raise that TimeoutError, and the owner drops
    the value, if it made it, when this peer next calls. The arguments
    and what is raised at once are those of :func:`rpc_async`.
    """
    agent = _agent.current_agent()
    if not callable(func):
        raise TypeError(f"func must be a callable to run on {to!r}, got {type(func).__name__}")
    return remote_value(
        agent,
        _peer_of(agent, to),
        func,
        _check_args(args),
        _check_kwargs(kwargs),
        check_timeout(timeout, agent.default_timeout),
    )


# -- argument checks ---------------------------------------------------------------


def _peer_of(agent: _agent.RpcAgent, to: object) -> WorkerInfo:
    if isinstance(to, WorkerInfo):
        return agent.peer(to.name)
    return agent.peer(_check_to(to))


def _check_to(to: object) -> str | int:
    if isinstance(to, str | int) and not isinstance(to, bool):
        return to
    raise TypeError(f"to is a peer's name, id or WorkerInfo, got {type(to).__name__}")


def _check_args(args: object) -> tuple[Any, ...]:
    if args is None:
        return ()
    if isinstance(args, tuple | list):
        return tuple(args)
    raise TypeError(
        f"args is a tuple of positional arguments, got {type(args).__name__}; "
        f"for one argument write args=(x,)"
    )


def _check_kwargs(kwargs: object) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"kwargs is a dict of keyword arguments, got {type(kwargs).__name__}")
    named = dict(kwargs)
    for key in named:
        if not isinstance(key, str):
            raise TypeError(
                f"kwargs is a dict of keyword arguments, whose keys are the parameters' names "
                f"(strings), got the key {key!r}"
            )
    return named
