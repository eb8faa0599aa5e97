"""RRef: a value that lives on one peer (its owner), used from any peer.

The owner keeps each value in a table, under an id its creator picks, so
``remote`` returns before the value exists. The table's functions below run
on the owner through ordinary calls; the ones that wait for the value are
``async_execution``, so a fetch that arrives before the value holds no
thread. A value is dropped once the RRef that ``remote`` returned is collected (the
creator tells the owner with its next call), unless a copy of it was sent to
another peer; then it stays until the owner shuts down. The child of an
``os.fork()`` owns nothing, and drops none of its parent's values.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from .._future import Future
from . import agent as _agent
from .agent import WorkerInfo, run_callee
from .functions import async_execution

__all__ = ["RRef"]

T = TypeVar("T")

# -- the owner's side ------------------------------------------------------------

_owned: dict[str, Future[Any]] = {}
_owned_lock = threading.Lock()
# Calls run concurrently on the owner, so a creator's _delete may run before
# its _create: the ids created and not yet deleted, and those deleted first.
_made: set[str] = set()
_deleted_early: set[str] = set()
_prefix = uuid.uuid4().hex[:12]  # this process, in the ids of the RRefs it creates
_counter = itertools.count()


def _new_id() -> str:
    return f"{_prefix}-{next(_counter)}"


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


def _settle_from(source: Future[Any], target: Future[Any]) -> None:
    try:
        value = source.value()
    except BaseException as exc:
        target.set_exception(exc)
    else:
        target.set_result(value)


def _run_into(target: Future[Any], fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    """Settle ``target`` with what callee ``fn`` gives (for a Future: once it is done)."""
    try:
        result = run_callee(fn, args, kwargs)
    except BaseException as exc:
        target.set_exception(exc)
        return
    if isinstance(result, Future):
        result.add_done_callback(lambda done: _settle_from(done, target))
    else:
        target.set_result(result)


def _create(rref_id: str, fn: Callable[..., Any], args: Any, kwargs: Any) -> None:
    with _owned_lock:
        dropped = rref_id in _deleted_early
        if dropped:  # its RRef is gone already: run fn, keep nothing
            _deleted_early.discard(rref_id)
            target: Future[Any] = Future()
            target.add_done_callback(_ignore_outcome)
        else:
            _made.add(rref_id)
            found = _owned.get(rref_id)  # a fetch may have come first
            target = _owned[rref_id] = Future() if found is None else found
    _run_into(target, fn, args, kwargs)


@async_execution
def _fetch(rref_id: str, known: bool = False) -> Future[Any]:
    return _slot(rref_id, known)


@async_execution
def _call_method(
    rref_id: str, name: str, args: Any, kwargs: Any, known: bool = False
) -> Future[Any]:
    result: Future[Any] = Future()

    def call(value: Future[Any]) -> None:
        try:
            method = getattr(value.value(), name)
        except BaseException as exc:
            result.set_exception(exc)
        else:
            _run_into(result, method, args, kwargs)

    _slot(rref_id, known).add_done_callback(call)
    return result


def _delete(rref_ids: list[str]) -> None:
    with _owned_lock:
        for rref_id in rref_ids:
            _owned.pop(rref_id, None)
            if rref_id in _made:
                _made.discard(rref_id)
            else:
                _deleted_early.add(rref_id)


_collected: deque[tuple[WorkerInfo, str]] = deque()


def _timed_out(created: Future[Any]) -> bool:
    return isinstance(created._exception, TimeoutError)


def forget_if_timed_out(owner: WorkerInfo, rref_id: str, created: Future[Any]) -> None:
    """A done-callback of the call that creates a value: if it timed out, the
    RRef has failed, so the owner is told to drop the value (with the next
    call from this peer), made or not."""
    if _timed_out(created):
        _collected.append((owner, rref_id))  # RRefs collected here, by owner


def send_collected(agent: _agent.RpcAgent) -> None:
    """Tell the owners of the RRefs collected here to drop their values.

    Safe in several threads at once: each id queued is sent by one of them.
    """
    by_owner: dict[WorkerInfo, list[str]] = {}
    while True:
        try:  # popleft is atomic; a check before it could see an id another thread takes
            owner, rref_id = _collected.popleft()
        except IndexError:
            break
        by_owner.setdefault(owner, []).append(rref_id)
    for owner, rref_ids in by_owner.items():
        if owner.name == agent.worker_info.name:
            _delete(rref_ids)
            continue
        with contextlib.suppress(Exception):  # the owner is gone, and its table with it
            agent.call(owner, _delete, (rref_ids,), {}, 0).add_done_callback(_ignore_outcome)


def forget_owned() -> None:
    """Drop every value this process owns (at shutdown)."""
    with _owned_lock:
        _owned.clear()
        _made.clear()
        _deleted_early.clear()
    _collected.clear()


def _forget_in_child() -> None:
    """After ``os.fork()``, in the child: it owns nothing, and the RRefs it
    inherited are its parent's to drop (a new prefix tells them apart)."""
    global _owned_lock, _prefix
    _owned_lock = threading.Lock()  # a parent's thread may have held it
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

    How long the value lives: the owner drops it once the RRef that
    :func:`~aiopar.rpc.remote` returned is garbage-collected on its creator
    (the owner hears of it with the creator's next ``rpc_sync``,
    ``rpc_async`` or ``remote``), unless that RRef was pickled, as it is
    when sent in a call or a result. A value whose RRef was pickled, and
    one made with ``RRef(value)``, stays until its owner shuts down.
    """

    __slots__ = ("__weakref__", "_created", "_id", "_owner", "_shared")

    def __init__(self, value: T) -> None:
        self._owner = _agent.current_agent().worker_info
        self._id = _new_id()
        self._created: Future[Any] | None = None
        self._shared = False
        _slot(self._id).set_result(value)

    @classmethod
    def _make(cls, owner: WorkerInfo, rref_id: str, created: Future[Any] | None) -> RRef[Any]:
        rref = cls.__new__(cls)
        rref._owner, rref._id, rref._created, rref._shared = owner, rref_id, created, False
        return rref

    def __reduce__(self) -> tuple[Any, ...]:
        # The owner can no longer tell when the last copy is gone.
        self._shared = True
        return (_rebuild, (self._owner, self._id))

    def __repr__(self) -> str:
        return f"RRef(owner={self._owner.name}, id={self._id})"

    def __del__(self) -> None:
        # The garbage collector may run this in any thread, holding any lock:
        # only note the id here (deque.append takes no lock); the next call
        # from this peer sends it (see send_collected).
        created = self._created
        if (
            created is not None
            and not self._shared
            and self._id.startswith(_prefix)
            and not _timed_out(created)  # then dropped already (see forget_if_timed_out)
        ):
            _collected.append((self._owner, self._id))

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
            value = agent.call(self._owner, _fetch, fetch, {}, seconds).wait()
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


def _rebuild(owner: WorkerInfo, rref_id: str) -> RRef[Any]:
    return RRef._make(owner, rref_id, None)


class _Proxy:
    __slots__ = ("_kind", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], kind: str, timeout: float) -> None:
        self._rref, self._kind, self._timeout = rref, kind, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        from . import _api

        call = getattr(_api, self._kind)
        rref, timeout = self._rref, self._timeout

        def method(*args: Any, **kwargs: Any) -> Any:
            rref._raise_if_creation_failed()
            known = rref._made_by_owner()
            return call(
                rref.owner(),
                _call_method,
                args=(rref._id, name, args, kwargs, known),
                timeout=timeout,
            )

        method.__name__ = name
        return method

    def __repr__(self) -> str:
        return f"<{self._kind} proxy of {self._rref!r}>"
