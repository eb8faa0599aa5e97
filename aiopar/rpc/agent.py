"""What an rpc engine implements: the :class:`RpcAgent` of one peer process.

``aiopar.rpc`` holds torch's names and semantics (RRefs, ``async_execution``,
timeouts, argument checks); an agent carries calls between peers. A plugin
distribution registers an :class:`RpcEngine` under the ``aiopar.rpc_agents``
entry-point group::

    [project.entry-points."aiopar.rpc_agents"]
    dask = "aiopar_dask:rpc_engine"

``init_rpc`` calls ``engine.start(name, rank, world_size, options)`` and
makes the returned agent this process's current one; a peer that an engine
starts by itself (a worker process) calls :func:`set_current_agent`. On the
callee, the agent runs each incoming call through :func:`run_callee`.
"""

from __future__ import annotations

import enum
import inspect
import os
import re
import sys
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, NamedTuple, Protocol
from urllib.parse import urlsplit

from aiopar import Future, wrap
from aiopar.lowlevel import check_count

from ._rendezvous import ENV

__all__ = [
    "DEFAULT_RPC_TIMEOUT",
    "ENTRY_POINT_GROUP",
    "BackendType",
    "RpcAgent",
    "RpcBackendOptions",
    "RpcEngine",
    "TlsFiles",
    "WorkerInfo",
    "check_address",
    "check_peer_name",
    "check_rpc_timeout",
    "current_agent",
    "current_agent_or_none",
    "find_engine",
    "installed_engines",
    "is_async_execution",
    "run_callee",
    "serve_peer",
    "set_current_agent",
]

ENTRY_POINT_GROUP = "aiopar.rpc_agents"
"""The entry-point group under which a plugin registers its :class:`RpcEngine`."""

DEFAULT_RPC_TIMEOUT = 60.0
"""Seconds a call may wait for its reply unless told otherwise: torch.distributed.rpc's default.

The default of :attr:`RpcBackendOptions.rpc_timeout`; a call with no reply
by then fails with TimeoutError.
"""


class BackendType(enum.StrEnum):
    """The engines ``init_rpc(backend=...)`` takes, as torch's ``BackendType``.

    Each member is the engine's name, so a plain string works as well.
    ``TENSORPIPE``, torch's default, stands for aiopar's default engine, so
    code written for torch runs unchanged.
    """

    DASK = "dask"
    TENSORPIPE = "dask"


class _WorkerInfoFields(NamedTuple):
    name: str
    id: int


class WorkerInfo(_WorkerInfoFields):
    """A peer: its unique ``name`` and its ``id`` (the rank), as in torch.

    A named tuple: immutable, hashable, comparable and picklable. Wherever
    a call takes a peer (``to=``), a WorkerInfo stands for the peer of its
    ``name``. Raises TypeError unless ``name`` is a string and ``id`` a
    whole number.
    """

    __slots__ = ()

    def __new__(cls, name: str, id: int) -> WorkerInfo:
        if not isinstance(name, str):
            raise TypeError(
                f"WorkerInfo(name, id): name is the peer's name, a string, got {name!r}"
            )
        if not isinstance(id, int) or isinstance(id, bool):
            raise TypeError(f"WorkerInfo(name, id): id is the peer's rank, an int, got {id!r}")
        return super().__new__(cls, name, id)

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self.id}, name={self.name})"


@dataclass(frozen=True, kw_only=True)
class RpcBackendOptions:
    """How ``init_rpc`` joins or starts the peers (torch's options, plus what
    an engine needs). Keyword-only and frozen.

    ``rpc_timeout`` is the default timeout of every call from this process,
    in seconds (0 or ``float("inf")``: no limit, as is any number of seconds
    too large for a lock to wait, ``threading.TIMEOUT_MAX``), and also how
    long ``init_rpc`` waits for ``world_size`` peers to join a scheduler
    (and, at a ``tcp://`` rendezvous, for rank 0's scheduler to listen).
    ``init_method`` is where the ranks meet, as torch takes it:
    ``"env://"`` (``MASTER_ADDR:MASTER_PORT``), ``"tcp://host:port"``
    (rank 0 starts the rendezvous there, the other ranks join it), or the
    address of a scheduler to join (such as ``"tls://10.0.0.5:8786"``);
    None is ``"env://"`` when ``MASTER_ADDR`` or ``MASTER_PORT`` is set,
    and otherwise starts an embedded cluster on this machine, listening on
    loopback only (see ``init_rpc``). ``num_worker_threads`` is how many
    calls each peer this process starts runs at once (this process's own and
    those of the embedded cluster; calls blocked in ``wait`` and pending
    ``async_execution`` futures do not count). ``security`` is passed to the
    engine (for dask, a ``distributed.Security``: TLS for the cluster and
    the calls; None, the default: the embedded cluster and the scheduler
    rank 0 starts at a ``tcp://`` rendezvous use TLS with certificates made
    as they start, which the ranks of rank 0's machine find, and a peer
    that joins another scheduler uses none; False: no TLS at all).

    ``run_tasks`` makes the peer of this process run, besides its calls,
    the tasks that any client of its cluster submits (for aiopar-dask, dask
    tasks); by default a peer runs none, and is no ordinary worker of a
    cluster that has some. (The peers that an embedded cluster starts run
    its tasks: they are its only workers.)

    Raises ValueError for an ``rpc_timeout`` that is not a number >= 0, a
    ``num_worker_threads`` that is not a whole number >= 1, and an
    ``init_method`` other than ``"env://"`` with no host or a port outside
    1-65535; TypeError for an ``init_method`` that is not a string or
    None, a ``security`` that is plain data (such as ``"tls"``, or True)
    rather than an engine's object or False, and a ``run_tasks`` that is
    not a bool.
    """

    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    init_method: str | None = None
    num_worker_threads: int = 16
    security: Any = None
    run_tasks: bool = False

    def __post_init__(self) -> None:
        check_rpc_timeout(self.rpc_timeout)
        if self.init_method is not None and self.init_method != ENV:
            check_address(self.init_method, "init_method")
        check_count(self.num_worker_threads, "num_worker_threads")
        if not isinstance(self.run_tasks, bool):
            raise TypeError(f"run_tasks is True or False, got {self.run_tasks!r}")
        if self.security is not False and isinstance(
            self.security, str | bytes | int | float | dict | list | tuple
        ):
            raise TypeError(
                f"security is the engine's security object (for aiopar-dask a "
                f"distributed.Security, such as Security.temporary() or "
                f"Security(tls_ca_file=..., tls_client_cert=..., require_encryption=True)), "
                f"None for the engine's default, or False for no TLS, got {self.security!r}"
            )


def check_address(address: object, what: str) -> None:
    """Refuse what cannot be a scheduler's address (``what`` names the
    argument): TypeError for a non-string, ValueError for no host or a port
    outside 1-65535. Whether a scheduler answers there is the engine's to say."""
    example = "a scheduler address such as 'tcp://10.0.0.5:8786'"
    if not isinstance(address, str):
        raise TypeError(f"{what} is {example}, got {type(address).__name__}")
    try:
        parts = urlsplit(address if "://" in address else f"tcp://{address}")
        port = parts.port  # ValueError out of 0-65535
    except ValueError as exc:
        raise ValueError(f"{what} is {example}, got {address!r}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"{what} is {example}, got {address!r}: it names no host")
    if port == 0:
        raise ValueError(f"{what} is {example}, got {address!r}: port 0 is no scheduler's")


class TlsFiles(NamedTuple):
    """TLS certificates in PEM files, as ``aiopar worker`` takes them (the
    options of ``dask worker``): the certificate authority's, and this
    peer's certificate and key. A field left None is the engine's default
    (for aiopar-dask, dask's ``distributed.comm.tls`` configuration)."""

    ca_file: str | None = None
    cert: str | None = None
    key: str | None = None


TensorPipeRpcBackendOptions = RpcBackendOptions
"""torch's name for the options of its default backend: :class:`RpcBackendOptions` itself."""


class RpcAgent(ABC):
    """One peer's engine: it knows the peers and carries calls to them.

    Every method may be called from any thread.
    """

    @property
    @abstractmethod
    def worker_info(self) -> WorkerInfo:
        """This peer."""

    @property
    @abstractmethod
    def default_timeout(self) -> float:
        """Seconds a call may take when the caller gives no timeout (0: no limit)."""

    @abstractmethod
    def set_default_timeout(self, seconds: float) -> None:
        """Make ``seconds`` (0: no limit) the :attr:`default_timeout` of later calls."""

    @abstractmethod
    def peer(self, to: str | int) -> WorkerInfo:
        """The peer called ``to`` (a name) or ranked ``to`` (an id).

        Raises ValueError naming the peers there are if there is none, and
        RuntimeError (a :class:`aiopar.BrokenWorkerError`) naming a peer
        that was there and has left or died.
        """

    @abstractmethod
    def peers(self) -> list[WorkerInfo]:
        """Every peer, this one included, by id."""

    @abstractmethod
    def call(
        self,
        to: WorkerInfo,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        timeout: float,
    ) -> Future[Any]:
        """Run ``fn(*args, **kwargs)`` on ``to`` through :func:`run_callee`.

        Returns at once. The future gets the value, or the callee's
        exception with its type and remote traceback, or TimeoutError after
        ``timeout`` seconds (0: never; else at most ``threading.TIMEOUT_MAX``,
        as :func:`check_timeout` gives), or an error naming ``to`` soon after
        that peer dies. Raises at once if the call cannot be sent (its
        arguments do not pickle, the agent is shut down).
        """

    @abstractmethod
    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        """Leave. With ``graceful``, first wait for this peer's outstanding
        calls and for every other peer that joined to shut down too (for at
        most ``timeout`` seconds, 0: no limit)."""


class RpcEngine(Protocol):
    """What a plugin registers: it starts this process's agent, or serves a peer."""

    def start(
        self, name: str, rank: int | None, world_size: int | None, options: RpcBackendOptions
    ) -> RpcAgent:
        """Make this process the peer ``name`` (see ``init_rpc``) and return its agent.

        If it raises, or is interrupted, it first stops what it started
        (threads, processes, clusters, connections): the process is left
        as it was.
        """

    def serve(
        self,
        scheduler: str,
        name: str,
        rank: int | None,
        options: RpcBackendOptions,
        tls: TlsFiles | None = None,
    ) -> None:
        """Run the peer ``name`` in this process until it is interrupted
        (``aiopar worker``), reaching the scheduler with the certificates of
        ``tls`` (None: the engine's own TLS configuration)."""


_current: RpcAgent | None = None
_current_lock = threading.Lock()
_forked_from: str | None = None  # the peer this process's parent was when it forked


def current_agent() -> RpcAgent:
    """This process's agent; RuntimeError if there is none (before ``init_rpc``,
    and in the child of an ``os.fork()``)."""
    agent = _current
    if agent is None:
        if _forked_from is not None:
            raise RuntimeError(
                f"this process was forked from rpc peer {_forked_from!r}, and the child of a "
                f"fork is no peer (its parent's connections stay the parent's): call "
                f"aiopar.rpc.init_rpc(name, ...) in this process to make it one"
            )
        raise RuntimeError(
            "RPC has not been initialized in this process: call aiopar.rpc.init_rpc(name, ...) "
            "first"
        )
    return agent


def current_agent_or_none() -> RpcAgent | None:
    """This process's agent, or None if this process is no peer."""
    return _current


def set_current_agent(agent: RpcAgent | None) -> RpcAgent | None:
    """Make ``agent`` this process's agent (None: no agent); return the previous one."""
    global _current
    with _current_lock:
        previous, _current = _current, agent
    return previous


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: no agent. Its connections, threads
    and call ids are the parent's; the child must not touch them."""
    global _current, _current_lock, _forked_from
    _current_lock = threading.Lock()  # a parent's thread may have held it
    if _current is not None:
        try:
            _forked_from = _current.worker_info.name
        except Exception:
            _forked_from = "?"
    _current = None


os.register_at_fork(after_in_child=_forget_in_child)


def run_callee(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run an incoming call in this thread and return what the agent replies with.

    A coroutine that ``fn`` returns is wrapped in an :class:`aiopar.Future`,
    to be awaited on aiopar's loop thread. The Future an
    ``@async_execution`` function returns (aiopar's, or a
    ``torch.futures.Future``, adopted with :func:`aiopar.wrap`) is not a
    value to send: the agent replies with its outcome once it is done, from
    its done-callback, holding no thread meanwhile. Raises what ``fn``
    raises, and TypeError if an ``@async_execution`` function returns
    something else than a Future or a coroutine, or if any other function
    returns a Future (as torch).
    """
    result = fn(*args, **kwargs)
    try:
        if inspect.iscoroutine(result):
            return wrap(result)  # a coroutine function: awaited on aiopar's loop thread
        is_future = isinstance(result, Future) or _is_torch_future(result)
        if is_future != is_async_execution(fn):
            if is_future:
                # torch fails such a call at once too: a Future is no value to send
                kind = "an aiopar.Future" if isinstance(result, Future) else "a torch future"
                raise TypeError(
                    f"{_name(fn)} returned {kind}: decorate it with "
                    f"@rpc.functions.async_execution for its caller to get the Future's "
                    f"value once it is done, or return the value itself"
                )
            raise TypeError(
                f"{_name(fn)} is decorated with @rpc.functions.async_execution, so it must "
                f"return an aiopar.Future, but it returned {_type_name(result)} (a "
                f"torch.futures.Future, or a coroutine, does too)"
            )
        return wrap(result) if is_future else result
    finally:
        del result  # a Future that failed inside fn holds this frame: no cycle (see Future)


def _is_torch_future(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.futures.Future`` (torch is never imported
    here: a process that has not imported it has none)."""
    torch = sys.modules.get("torch")
    kind = getattr(getattr(torch, "_C", None), "Future", None)
    return kind is not None and isinstance(obj, kind)


def _type_name(obj: object) -> str:
    kind = type(obj)
    return (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )


def is_async_execution(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` (a function, or a method bound to a class or an
    instance) was decorated with ``@async_execution``."""
    return getattr(fn, "_wrapped_async_rpc_function", None) is not None


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__qualname__


_PEER_NAME = re.compile(r"[A-Za-z0-9_\-:]{1,128}")


def check_peer_name(name: object) -> None:
    """Refuse a peer name torch would refuse: TypeError for a non-string,
    ValueError for an empty one, one longer than 128 characters, or one with
    a character other than letters, digits, ``_``, ``-`` and ``:``."""
    if not isinstance(name, str):
        raise TypeError(f"name is the peer's name, a non-empty string, got {name!r}")
    if not _PEER_NAME.fullmatch(name):
        raise ValueError(
            f"a peer's name is 1 to 128 of the characters A-Z a-z 0-9 _ - : (as torch's), "
            f"got {name!r}"
        )


def check_rpc_timeout(rpc_timeout: object) -> float:
    """``rpc_timeout`` (a default timeout) if it is a number of seconds >= 0
    (0 or inf: no limit); ValueError otherwise."""
    if (
        isinstance(rpc_timeout, bool)
        or not isinstance(rpc_timeout, int | float)
        or not rpc_timeout >= 0  # also NaN
    ):
        raise ValueError(
            f"rpc_timeout is a number of seconds >= 0 (0 or inf: no limit), got {rpc_timeout!r}"
        )
    return float(rpc_timeout)


def check_timeout(timeout: object, default: float) -> float:
    """A call's timeout in seconds, 0 for no limit, from torch's -1 (``default``),
    None, 0 or ``float("inf")`` (no limit), or a number of seconds.

    As in :meth:`aiopar.Future.wait`, more seconds than a lock can wait
    (``threading.TIMEOUT_MAX``, about 292 years) are no limit too, so an
    engine is given 0 or a number it can wait for. Raises ValueError for
    anything else (a negative number but -1, NaN, a string, a bool).
    """
    if timeout is None:
        return 0.0
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        if timeout == -1:
            timeout = default
        if timeout >= 0:  # False for NaN
            return 0.0 if timeout > threading.TIMEOUT_MAX else float(timeout)
    raise ValueError(
        f"timeout is a number of seconds >= 0 (0, None or inf: no limit; -1: the default "
        f"set in init_rpc), got {timeout!r}"
    )


def installed_engines() -> dict[str, EntryPoint]:
    """The rpc engines installed, by the name their distribution registers."""
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def find_engine(backend: str | None = None) -> RpcEngine:
    """The engine registered as ``backend`` (None: ``"dask"``, or the only one).

    Raises RuntimeError, naming the distribution to install, if no engine
    is installed, ValueError, naming the installed ones, if none is
    called ``backend``, and TypeError for a ``backend`` that is not a string.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(
            f"backend is the name of an installed rpc engine, such as 'dask', or None, "
            f"got {backend!r}"
        )
    found = installed_engines()
    if not found:
        raise RuntimeError(
            "aiopar.rpc needs an engine to carry its calls, and none is installed: "
            "pip install aiopar-dask (it runs the peers on dask.distributed)"
        )
    if backend is None:
        backend = "dask" if "dask" in found or len(found) > 1 else next(iter(found))
    if backend not in found:
        raise ValueError(
            f"no rpc engine called {backend!r} is installed; installed: {', '.join(sorted(found))}"
        )
    engine: RpcEngine = found[backend].load()
    return engine


def serve_peer(
    scheduler: str,
    name: str,
    rank: int | None = None,
    options: RpcBackendOptions | None = None,
    *,
    backend: str | None = None,
    tls: TlsFiles | None = None,
) -> None:
    """Run this process as the peer ``name`` of the cluster at ``scheduler``
    until it is interrupted (what ``aiopar worker`` does), with the TLS
    certificates of ``tls``."""
    check_peer_name(name)
    check_address(scheduler, "scheduler")
    find_engine(backend).serve(scheduler, name, rank, options or RpcBackendOptions(), tls)
