"""init_rpc, the three ways to call a peer, and shutdown."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from .._budget import check_count
from .._future import Future
from . import agent as _agent
from ._rref import RRef, _collected, _create, _new_id, forget_owned, send_collected
from .agent import ENTRY_POINT_GROUP, RpcBackendOptions, WorkerInfo, check_timeout

__all__ = [
    "get_worker_info",
    "init_rpc",
    "is_available",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
]

T = TypeVar("T")

_init_lock = threading.Lock()


def is_available() -> bool:
    """Whether an rpc engine (such as the aiopar-dask distribution) is installed."""
    return bool(_agent.entry_points(group=ENTRY_POINT_GROUP))


def init_rpc(
    name: str,
    rank: int | None = None,
    world_size: int | None = None,
    rpc_backend_options: RpcBackendOptions | None = None,
    *,
    backend: str | None = None,
) -> None:
    """Make this process the peer called ``name``.

    Without a scheduler address (``rpc_backend_options.init_method``), an
    embedded cluster on this machine is started, listening on loopback
    only, with ``world_size - 1`` more peers named as torch names them
    (``worker<rank>``, this process having ``rank``, 0 by default). With an
    address, this process joins that cluster as a peer any other peer can
    call, and when ``world_size`` is given, returns once that many peers
    have joined (as every process of a torch job calls ``init_rpc``).
    ``backend`` picks the engine when several are installed.

    Raises RuntimeError if this process is a peer already, or no engine is
    installed (it says which distribution to install), and ValueError for a
    name or rank that is taken.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name is this peer's name, a non-empty string, got {name!r}")
    if rank == -1:  # torch's "not set"
        rank = None
    check_count(rank, "rank", minimum=0, none="the smallest free one")
    check_count(world_size, "world_size", none="any number of peers")
    if rank is not None and world_size is not None and rank >= world_size:
        raise ValueError(f"rank must be < world_size ({world_size}), got {rank}")
    options = RpcBackendOptions() if rpc_backend_options is None else rpc_backend_options
    if not isinstance(options, RpcBackendOptions):
        raise TypeError(
            f"rpc_backend_options must be aiopar.rpc.RpcBackendOptions, "
            f"got {type(options).__name__}"
        )
    with _init_lock:
        if _agent._current is not None:
            raise RuntimeError(
                f"this process is RPC peer {_agent._current.worker_info.name!r} already; "
                f"call aiopar.rpc.shutdown() before init_rpc() again"
            )
        engine = _agent.find_engine(backend)
        _agent.set_current_agent(engine.start(name, rank, world_size, options))


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """Leave the group of peers.

    With ``graceful`` (torch's default), wait for this peer's outstanding
    calls to finish and for every other peer that joined to call
    ``shutdown`` too (at most ``timeout`` seconds, 0: no limit), so nobody
    leaves while a call may still reach it. Then stop this peer and the
    cluster that ``init_rpc`` started, if it did. Values this peer owned
    through RRefs are dropped.
    """
    agent = _agent.current_agent()
    try:
        agent.shutdown(graceful=graceful, timeout=timeout)
    finally:
        _agent.set_current_agent(None)
        forget_owned()


def get_worker_info(worker_name: str | None = None) -> WorkerInfo:
    """The :class:`WorkerInfo` of the peer called ``worker_name``, or of this peer.

    Raises ValueError naming the peers if there is none by that name.
    """
    agent = _agent.current_agent()
    if worker_name is None:
        return agent.worker_info
    return agent.peer(_check_to(worker_name))


def rpc_async(
    to: str | int | WorkerInfo,
    func: Callable[..., T],
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    timeout: float = -1,
) -> Future[T]:
    """Run ``func(*args, **kwargs)`` on peer ``to``; return its future at once.

    ``to`` is a peer's name, id or :class:`WorkerInfo`. The future works as
    every :class:`aiopar.Future` does (``wait``, ``await``, ``then``) and
    gets the value, or the callee's exception with its type and remote
    traceback, or TimeoutError once ``timeout`` seconds pass (-1: the
    default of ``init_rpc``, 60 s unless set; 0 or None: no limit), or an
    error naming the peer soon after it dies. Raises at once for an unknown
    peer (ValueError listing the peers) and for arguments that do not pickle.
    """
    agent = _agent.current_agent()
    if not callable(func):
        raise TypeError(f"func must be a callable to run on {to!r}, got {type(func).__name__}")
    if _collected:
        send_collected(agent)
    return agent.call(
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
    """Run ``func(*args, **kwargs)`` on peer ``to`` and return its value.

    ``rpc_async(...).wait()``: the same arguments and failures, raised here.
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

    Returns an :class:`RRef` owned by ``to`` at once, before the value
    exists; ``to_here()`` waits for it, and raises what ``func`` raised.
    ``func`` may be a class: ``remote("worker1", Counter)`` makes a Counter
    that lives on worker1. ``timeout`` bounds the creation call.
    """
    agent = _agent.current_agent()
    if not callable(func):
        raise TypeError(f"func must be a callable to run on {to!r}, got {type(func).__name__}")
    owner = _peer_of(agent, to)
    if _collected:
        send_collected(agent)
    rref_id = _new_id()
    created = agent.call(
        owner,
        _create,
        (rref_id, func, _check_args(args), _check_kwargs(kwargs)),
        {},
        check_timeout(timeout, agent.default_timeout),
    )
    return RRef._make(owner, rref_id, created)


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
    if isinstance(kwargs, Mapping):
        return dict(kwargs)
    raise TypeError(f"kwargs is a dict of keyword arguments, got {type(kwargs).__name__}")
