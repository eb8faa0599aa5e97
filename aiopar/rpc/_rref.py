"""RRef: a value that lives on one peer (its owner), used from any peer.

The handle is here with the calls it makes: the one that creates a value on
its owner (``remote``), the fetch of ``to_here``, and the proxies that call
the value's methods there.

The owner keeps each value in a table, under an id its creator picks, so
``remote`` returns before the value exists. The table's functions below run
on the owner through ordinary calls; the ones that wait for the value are
``async_execution``, so a fetch that arrives before the value holds no
thread.

How long a value lives is counted across peers, as torch counts it: every
RRef object (a *fork*) has an id of its own, and the owner keeps the ids of
the forks alive. ``remote`` makes the first; pickling an RRef (to send it)
makes another, which its sender tells the owner about; an RRef collected
anywhere tells the owner it is gone. The owner drops the value when its
last fork is gone. A peer sends what it has to tell an owner with its next
call (or within ``FLUSH_INTERVAL`` if it makes none), one call per owner at
a time, in order. Since a sender announces a fork before it says that its
own is gone, and an owner applies a peer's changes in order, the owner
never drops a value that a live fork refers to (a fork whose "gone"
arrives before its announcement is noted as such). The child of an
``os.fork()`` owns nothing, and drops none of its parent's values.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from aiopar import Future, InvalidStateError

from . import agent as _agent
from .agent import WorkerInfo, run_callee
from .functions import async_execution

__all__ = ["RRef", "remote_value"]

T = TypeVar("T")

# -- the owner's side ------------------------------------------------------------

_owned: dict[str, Future[Any]] = {}
_owned_lock = threading.Lock()
_forks: dict[str, set[str]] = {}  # the value's id -> the ids of its live forks
# Calls run concurrently on the owner: a fork may be gone before it is
# announced (or before the value is made), by (value id, fork id).
_gone_early: set[tuple[str, str]] = set()
_prefix = uuid.uuid4().hex[:12]  # this process, in the ids it makes
_counter = itertools.count()


def _new_id() -> str:
    return f"{_prefix}-{next(_counter)}"


def _announce(rref_id: str, fork_id: str) -> None:
    """A fork of the value exists (called with the table's lock held)."""
    if (rref_id, fork_id) in _gone_early:
        _gone_early.discard((rref_id, fork_id))
    else:
        _forks.setdefault(rref_id, set()).add(fork_id)


def _forget(rref_id: str, fork_id: str) -> None:
    """A fork of the value is gone: the last one takes the value with it
    (called with the table's lock held)."""
    forks = _forks.get(rref_id)
    if forks is None or fork_id not in forks:
        _gone_early.add((rref_id, fork_id))
        return
    forks.discard(fork_id)
    if not forks:
        del _forks[rref_id]
        _owned.pop(rref_id, None)


def _slot(rref_id: str, known: bool = False) -> Future[Any]:
    """The future of an owned value, made on first use (a fetch may come
    first), unless the value is ``known`` to have been made here: then
    LookupError, since this peer no longer has it (it was restarted)."""
    with _owned_lock:
        slot = _owned.get(rref_id)
        if slot is None:
            if known:
                raise LookupError(
                    f"rpc peer {_agent.current_agent().worker_info.name!r} no longer has the "
                    f"value of RRef {rref_id}: it made it, and lost it since (a restarted "
                    f"peer starts with none)"
                )
            slot = _owned[rref_id] = Future()
        return slot


def _copy_outcome(source: Future[Any], target: Future[Any]) -> None:
    """Settle ``target`` as ``source`` (done) was settled, unless it is done
    already. Nothing is raised, so no frame joins the traceback of
    ``source``'s exception."""
    if source.cancelled():
        target.cancel()
        return
    exc = source.exception()
    with contextlib.suppress(InvalidStateError):
        if exc is None:
            target.set_result(source.value())
        else:
            target.set_exception(exc)


def _run_into(target: Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    """Settle ``target`` with what callee ``fn`` gives (for a Future: once it is done)."""
    try:
        result = run_callee(fn, args, kwargs)
    except BaseException as exc:
        target.set_exception(exc)
        del target  # the traceback holds this frame: no cycle (see aiopar's Future)
        return
    if isinstance(result, Future):
        result.add_done_callback(lambda done: _copy_outcome(done, target))
    else:
        target.set_result(result)


def _create(rref_id: str, fork_id: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    # (no variable of this frame holds the value's future while fn runs)
    _run_into(_value_slot(rref_id, fork_id), fn, args, kwargs)


def _value_slot(rref_id: str, fork_id: str) -> Future[Any]:
    """The future the creating call settles: the value's, unless every fork
    is gone already (then one that nothing keeps)."""
    with _owned_lock:
        _announce(rref_id, fork_id)
        if rref_id in _forks:
            found = _owned.get(rref_id)  # a fetch may have come first
            slot = _owned[rref_id] = Future() if found is None else found
        else:  # every fork is gone already: run fn, keep nothing
            slot = Future()
            slot.add_done_callback(_ignore_outcome)
        return slot


@async_execution
def _fetch(rref_id: str, known: bool = False) -> Future[Any]:
    return _slot(rref_id, known)


@async_execution
def _call_method(
    rref_id: str, name: str, args: Any, kwargs: Any, known: bool = False
) -> Future[Any]:
    result: Future[Any] = Future()
    _slot(rref_id, known).add_done_callback(_MethodCall(result, name, args, kwargs))
    try:
        return result
    finally:
        del result  # the method may have failed in this frame: no cycle (see aiopar's Future)


class _MethodCall:
    """The done-callback of an owned value that a method call waits for: it
    settles ``result`` with the method's outcome, and lets go of it (no
    cycle: see aiopar's Future)."""

    __slots__ = ("args", "kwargs", "name", "result")

    def __init__(self, result: Future[Any], name: str, args: Any, kwargs: Any) -> None:
        self.result, self.name, self.args, self.kwargs = result, name, args, kwargs

    def __call__(self, value: Future[Any]) -> None:
        result = self.result
        del self.result
        if value.cancelled() or value.exception() is not None:
            _copy_outcome(value, result)  # (without raising it here)
        else:
            try:
                method = getattr(value.value(), self.name)
            except BaseException as exc:
                result.set_exception(exc)
            else:
                _run_into(result, method, self.args, self.kwargs)
        del result


def _apply(changes: list[tuple[bool, str, str]]) -> None:
    """On the owner: forks announced (True) and gone (False), in the order
    their peer sent them."""
    with _owned_lock:
        for announced, rref_id, fork_id in changes:
            (_announce if announced else _forget)(rref_id, fork_id)


# What this peer has to tell owners, in order: (owner, (announced, value id,
# fork id)). A collected RRef appends here from any thread, even inside the
# garbage collector (deque.append takes no lock).
_changes: deque[tuple[WorkerInfo, tuple[bool, str, str]]] = deque()
_outbox_lock = threading.Lock()
_waiting: dict[str, tuple[WorkerInfo, list[tuple[bool, str, str]]]] = {}  # by owner name
_in_flight: set[str] = set()  # owners that a call of changes is on its way to
# Forks whose creating call timed out: their owners have been told they are gone.
_timed_out: set[str] = set()


def remote_value(
    agent: _agent.RpcAgent,
    owner: WorkerInfo,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
) -> RRef[Any]:
    """Run ``fn(*args, **kwargs)`` on ``owner`` and return, at once, an RRef
    of the value it makes there (``remote``, its arguments checked)."""
    rref_id, fork_id = _new_id(), _new_id()
    call = call_peer(agent, owner, _create, (rref_id, fork_id, fn, args, kwargs), {}, timeout)
    created: Future[Any] = Future()
    call.add_done_callback(functools.partial(_created, owner, rref_id, fork_id, created))
    return RRef._make(owner, rref_id, fork_id, created)


def _created(
    owner: WorkerInfo, rref_id: str, fork_id: str, created: Future[Any], call: Future[Any]
) -> None:
    """The call that creates a value is done: ``created`` (the RRef's) settles
    as it did. If it timed out, the RRef has failed, so its fork is gone
    (the owner hears of it with the next call from this peer, and drops the
    value unless a copy was sent)."""
    if not call.cancelled() and isinstance(call.exception(), TimeoutError):
        _timed_out.add(fork_id)
        _changes.append((owner, (False, rref_id, fork_id)))
    _copy_outcome(call, created)


def send_changes(agent: _agent.RpcAgent) -> None:
    """Tell owners what changed here: one call per owner at a time, so an
    owner applies them in the order they happened; what happens meanwhile
    goes with the next. Safe in several threads at once."""
    me = agent.worker_info.name
    local: list[tuple[bool, str, str]] = []
    ready: list[tuple[WorkerInfo, list[tuple[bool, str, str]]]] = []
    with _outbox_lock:
        while True:
            try:
                owner, change = _changes.popleft()
            except IndexError:
                break
            if owner.name == me:
                local.append(change)
            else:
                _waiting.setdefault(owner.name, (owner, []))[1].append(change)
        for name in list(_waiting):
            if name not in _in_flight:
                ready.append(_waiting.pop(name))
                _in_flight.add(name)
    if local:
        _apply(local)
    for owner, changes in ready:
        try:
            sent = agent.call(owner, _apply, (changes,), {}, 0)
        except Exception:  # this peer has shut down: its owners forget it anyway
            _sent(agent, owner.name, None)
        else:
            sent.add_done_callback(functools.partial(_sent, agent, owner.name))


def call_peer(
    agent: _agent.RpcAgent,
    to: WorkerInfo,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
) -> Future[Any]:
    """Every call from this peer: what changed for owners goes first."""
    if _changes:
        send_changes(agent)
    return agent.call(to, fn, args, kwargs, timeout)


def _sent(agent: _agent.RpcAgent, owner: str, call: Future[Any] | None) -> None:
    if call is not None:
        _ignore_outcome(call)  # an owner that is gone took its table along
    with _outbox_lock:
        _in_flight.discard(owner)
        more = owner in _waiting
    if more:
        send_changes(agent)


# A peer tells owners what changed with its next call, and this thread tells
# them when the peer makes none for a while (torch sends them at once, from
# a thread of its own too). It starts with the first RRef of the process.
FLUSH_INTERVAL = 0.5  # seconds
_flusher: tuple[threading.Thread, threading.Event] | None = None


def _start_flusher() -> None:
    global _flusher
    if _flusher is not None:
        return
    with _outbox_lock:
        if _flusher is not None:
            return
        stop = threading.Event()
        thread = threading.Thread(
            target=_flush_until, args=(stop,), name="aiopar-rpc-rrefs", daemon=True
        )
        _flusher = (thread, stop)
    thread.start()


def _flush_until(stop: threading.Event) -> None:
    while not stop.wait(FLUSH_INTERVAL):
        agent = _agent.current_agent_or_none()
        if agent is not None and _changes:
            with contextlib.suppress(Exception):  # the peer is shutting down
                send_changes(agent)


def forget_owned() -> None:
    """Drop every value this process owns, and what it had to tell, and stop
    telling (at shutdown)."""
    global _flusher
    with _owned_lock:
        _owned.clear()
        _forks.clear()
        _gone_early.clear()
    with _outbox_lock:
        _changes.clear()
        _waiting.clear()
        _in_flight.clear()
        _timed_out.clear()
        flusher, _flusher = _flusher, None
    if flusher is not None:
        thread, stop = flusher
        stop.set()
        if thread is not threading.current_thread():
            thread.join(5)


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: it owns nothing, and the RRefs it
    inherited are its parent's to drop (a new prefix tells them apart)."""
    global _owned_lock, _outbox_lock, _prefix, _flusher
    _owned_lock = threading.Lock()  # a parent's thread may have held them
    _outbox_lock = threading.Lock()
    _flusher = None  # the parent's thread: none runs here
    _prefix = uuid.uuid4().hex[:12]
    forget_owned()


os.register_at_fork(after_in_child=_forget_in_child)


# -- the handle --------------------------------------------------------------------


class RRef(Generic[T]):
    """A reference to a value on its owner peer.

    ``RRef(value)`` makes this peer the owner of ``value`` (RuntimeError if
    this process is not a peer); :func:`aiopar.rpc.remote` makes one on
    another peer. An RRef can be passed in the arguments and results of rpc
    calls: every copy refers to the same value, and on the owner,
    :meth:`local_value` is that value itself. Its methods may be called
    from any thread.

    How long the value lives: as long as an RRef to it exists on any peer.
    Each RRef object (the one :func:`~aiopar.rpc.remote` returns, and each
    copy sent in a call or a result) tells the owner when it is
    garbage-collected, with its peer's next call or within half a second;
    the owner drops the value when the last one is gone. An RRef whose
    creation failed cannot be sent (RuntimeError, as torch's). A value
    also goes when its owner shuts down.
    """

    __slots__ = ("__weakref__", "_created", "_fork", "_home", "_id", "_owner")

    def __init__(self, value: T) -> None:
        self._owner = _agent.current_agent().worker_info
        self._id = _new_id()
        self._fork = _new_id()
        self._created: Future[Any] | None = None
        self._home = _prefix
        with _owned_lock:
            _announce(self._id, self._fork)
        _slot(self._id).set_result(value)
        _start_flusher()

    @classmethod
    def _make(
        cls, owner: WorkerInfo, rref_id: str, fork_id: str, created: Future[Any] | None
    ) -> RRef[Any]:
        rref = cls.__new__(cls)
        rref._owner, rref._id, rref._fork, rref._created = owner, rref_id, fork_id, created
        rref._home = _prefix
        _start_flusher()
        return rref

    def __reduce__(self) -> tuple[Any, ...]:
        created = self._created
        if created is not None and created.done() and created.exception() is not None:
            raise RuntimeError(
                f"{self!r} cannot be sent: the call that was to create its value failed "
                f"({type(created.exception()).__name__}: {created.exception()})"
            )
        # The copy is a fork of its own, announced to the owner before this
        # one can say that it is gone (see the module's docstring).
        fork_id = _new_id()
        if self._owner.name == _my_name():
            with _owned_lock:
                _announce(self._id, fork_id)
        else:
            _changes.append((self._owner, (True, self._id, fork_id)))
        return (_rebuild, (self._owner, self._id, fork_id))

    def __repr__(self) -> str:
        return f"RRef(owner={self._owner.name}, id={self._id})"

    def __del__(self) -> None:
        # The garbage collector may run this in any thread, holding any lock:
        # only note it here (deque.append takes no lock); the next call from
        # this peer tells the owner (see send_changes).
        if self._home != _prefix:
            return
        if self._fork in _timed_out:  # its creation said it was gone (see _created)
            _timed_out.discard(self._fork)
        else:
            _changes.append((self._owner, (False, self._id, self._fork)))

    # -- where it lives -------------------------------------------------------------

    def owner(self) -> WorkerInfo:
        """The :class:`WorkerInfo` of the peer that holds the value."""
        return self._owner

    def owner_name(self) -> str:
        """The name of the peer that holds the value."""
        return self._owner.name

    def is_owner(self) -> bool:
        """Whether this peer holds the value (RuntimeError if this process is not a peer)."""
        return _agent.current_agent().worker_info.name == self._owner.name

    def confirmed_by_owner(self) -> bool:
        """Whether the owner is known to have this RRef's value, or to be making it.

        True for an RRef made with ``RRef(value)`` and for a copy received
        from another peer. For the RRef that :func:`~aiopar.rpc.remote`
        returned: False until the call that creates the value on the owner
        has returned, then True, unless that call failed (timed out, or the
        owner died). An exception raised by the function that makes the
        value does not count: it is kept for :meth:`to_here`. Never blocks.
        """
        created = self._created
        return created is None or (created.done() and created.exception() is None)

    # -- the value -----------------------------------------------------------------

    def local_value(self) -> T:
        """The value itself, on the owner, waiting as long as it takes to exist.

        Raises RuntimeError on any other peer (use :meth:`to_here` there),
        the exception that the function making the value raised, if it
        did, and the error of the call that was to create it, if that call
        failed.
        """
        if not self.is_owner():
            raise RuntimeError(
                f"local_value() is for the owner of {self!r}, and this peer is "
                f"{_agent.current_agent().worker_info.name!r}: call to_here() to copy it here"
            )
        self._raise_if_creation_failed()
        value: T = _slot(self._id).wait()
        if self._created is not None:
            self._created.wait()  # as in to_here
        return value

    def to_here(self, timeout: float = -1) -> T:
        """A copy of the value, fetched from the owner (the value itself on the owner).

        Blocks until the value exists, for at most ``timeout`` seconds (-1:
        the ``rpc_timeout`` of :func:`~aiopar.rpc.init_rpc`'s options; 0,
        None or ``float("inf")``: no limit), then raises TimeoutError.
        Raises the exception that the function making the value raised, if
        it did; the error of the call that was to create it, if that call
        failed (as :meth:`confirmed_by_owner` is then False: the owner died,
        or it timed out), whatever ``timeout`` is; LookupError naming the
        owner if it made the value and lost it since (it was restarted);
        an error naming the owner if it dies meanwhile; ValueError for a
        bad ``timeout``; and RuntimeError if this process is not a peer.
        """
        agent = _agent.current_agent()
        seconds = _agent.check_timeout(timeout, agent.default_timeout)
        self._raise_if_creation_failed()
        value: T
        if self.is_owner():
            value = _slot(self._id).wait(seconds or None)
        else:
            fetch = (self._id, self._made_by_owner())
            value = call_peer(agent, self._owner, _fetch, fetch, {}, seconds).wait()
        if self._created is not None:
            # The value exists, so the call that made it has replied or failed
            # (it timed out: then the RRef fails, as torch's does).
            self._created.wait()
        return value

    def _made_by_owner(self) -> bool:
        """Whether the owner told this creator that it made the value."""
        created = self._created
        return created is not None and created.done() and created.exception() is None

    def _raise_if_creation_failed(self) -> None:
        created = self._created
        if created is not None and created.done() and created.exception() is not None:
            created.value()

    # -- calling its methods on the owner ---------------------------------------------

    def rpc_sync(self, timeout: float = -1) -> Any:
        """A proxy: ``rref.rpc_sync().method(*args, **kwargs)`` runs
        ``value.method(*args, **kwargs)`` on the owner and returns its result.

        Each method call is a :func:`~aiopar.rpc.rpc_sync` to the owner with
        this ``timeout``: it waits for the value to exist, raises what the
        method raised (AttributeError if the value has no such method, the
        error that creating the value raised, if it did), and honours
        ``@async_execution`` methods and coroutine methods as
        :func:`~aiopar.rpc.rpc_sync` does functions. Any attribute name
        makes a method; a wrong one fails only when it is called.
        """
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1) -> Any:
        """A proxy whose method calls are :func:`~aiopar.rpc.rpc_async` calls to the owner.

        ``rref.rpc_async().method(*args, **kwargs)`` returns an
        :class:`aiopar.Future` of ``value.method(*args, **kwargs)`` at once;
        the future settles as :meth:`rpc_sync`'s call would return or raise.
        """
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1) -> Any:
        """A proxy whose method calls are :func:`~aiopar.rpc.remote` calls to the owner.

        ``rref.remote().method(*args, **kwargs)`` returns at once an RRef,
        owned by this RRef's owner, of ``value.method(*args, **kwargs)``;
        its :meth:`to_here` raises what the method raised.
        """
        return _Proxy(self, "remote", timeout)


def _ignore_outcome(future: Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: an owner that is gone needs no delete


def _rebuild(owner: WorkerInfo, rref_id: str, fork_id: str) -> RRef[Any]:
    return RRef._make(owner, rref_id, fork_id, None)


def _my_name() -> str | None:
    """This peer's name, or None if this process is no peer (an RRef
    pickled there is announced to its owner by the next call, if any)."""
    agent = _agent.current_agent_or_none()
    return None if agent is None else agent.worker_info.name


class _Proxy:
    """What :meth:`RRef.rpc_sync` and its siblings return: each attribute is a
    method that calls the value's method of that name on its owner, as
    ``rpc_sync``, ``rpc_async`` or ``remote`` (``kind``) call a function."""

    __slots__ = ("_kind", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], kind: str, timeout: float) -> None:
        self._rref, self._kind, self._timeout = rref, kind, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        rref, kind, timeout = self._rref, self._kind, self._timeout

        def method(*args: Any, **kwargs: Any) -> Any:
            rref._raise_if_creation_failed()
            call = (rref._id, name, args, kwargs, rref._made_by_owner())
            agent = _agent.current_agent()
            owner = agent.peer(rref.owner().name)
            seconds = _agent.check_timeout(timeout, agent.default_timeout)
            if kind == "remote":
                return remote_value(agent, owner, _call_method, call, {}, seconds)
            future = call_peer(agent, owner, _call_method, call, {}, seconds)
            return future.wait() if kind == "rpc_sync" else future

        method.__name__ = name
        return method

    def __repr__(self) -> str:
        return f"<{self._kind} proxy of {self._rref!r}>"
