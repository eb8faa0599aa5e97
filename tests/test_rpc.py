"""aiopar.rpc without an engine: torch's names, argument checks, RRefs, async_execution.

The semantics that need no cluster run on a fake engine whose two peers,
"me" and "other", live in this process; the calls still pickle their
arguments and results, as a real engine does. aiopar-dask's tests run the
same names across processes.
"""

from __future__ import annotations

import asyncio
import gc
import pickle
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest
from helpers import eventually, python

import aiopar
from aiopar import rpc
from aiopar.rpc import agent as rpc_agent
from aiopar.rpc.agent import RpcAgent, RpcBackendOptions, WorkerInfo, run_callee

pytestmark = pytest.mark.timeout(30)


class FakeAgent(RpcAgent):
    """Peers "me" (this process) and "other"; each call runs in a new thread."""

    def __init__(self, name: str, options: RpcBackendOptions) -> None:
        self._me = WorkerInfo(name, 0)
        self._peers = [self._me, WorkerInfo("other", 1)]
        self._timeout = options.rpc_timeout
        self.closed = False

    @property
    def worker_info(self) -> WorkerInfo:
        return self._me

    @property
    def default_timeout(self) -> float:
        return self._timeout

    def set_default_timeout(self, seconds: float) -> None:
        self._timeout = seconds

    def peer(self, to: str | int) -> WorkerInfo:
        for info in self._peers:
            if to in (info.name, info.id):
                return info
        raise ValueError(f"there is no rpc peer {to!r}; the peers are: me, other")

    def peers(self) -> list[WorkerInfo]:
        return list(self._peers)

    def call(self, to, fn, args, kwargs, timeout) -> aiopar.Future[Any]:
        fn, args, kwargs = pickle.loads(pickle.dumps((fn, args, kwargs)))
        future: aiopar.Future[Any] = aiopar.Future()

        def run() -> None:
            try:
                result = run_callee(fn, args, kwargs)
            except BaseException as exc:
                future.set_exception(exc)
                return
            if isinstance(result, aiopar.Future):
                result.add_done_callback(lambda done: _copy(done, future))
            else:
                future.set_result(pickle.loads(pickle.dumps(result)))

        threading.Thread(target=run).start()
        return future

    def shutdown(self, graceful: bool = True, timeout: float = 0) -> None:
        self.closed = True


def _copy(source: aiopar.Future[Any], target: aiopar.Future[Any]) -> None:
    # Read without raising, as a real agent's reply does (a raise would put
    # this frame, which holds the source, in its exception's traceback).
    exc = source.exception()
    if exc is None:
        target.set_result(source.value())
    else:
        target.set_exception(exc)


class FakeEngine:
    def __init__(self) -> None:
        self.agents: list[FakeAgent] = []

    def start(self, name, rank, world_size, options) -> FakeAgent:
        agent = FakeAgent(name, options)
        self.agents.append(agent)
        return agent


@pytest.fixture
def fake(monkeypatch):
    engine = FakeEngine()
    monkeypatch.setattr(rpc_agent, "find_engine", lambda backend=None: engine)
    rpc.init_rpc("me", rank=0, world_size=2)
    yield engine
    if rpc_agent._current is not None:
        rpc.shutdown()


# -- functions the peers run -----------------------------------------------------------


def add(a, b=0):
    return a + b


def fail():
    raise KeyError("failed on purpose")


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def value(self) -> int:
        return self.n

    @rpc.functions.async_execution
    def later(self, k: int) -> aiopar.Future[int]:
        return rpc.rpc_async("other", add, args=(self.n, k))


class AsyncExecutionClass:
    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to, x, y, z):
        return rpc.rpc_async(to, add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to, x, y, z):
        ret_fut = aiopar.Future()
        rpc.rpc_async(to, add, args=(x, y)).then(lambda fut: ret_fut.set_result(fut.wait() + z))
        return ret_fut

    @rpc.functions.async_execution
    def bound_async_add(self, to, x, y, z):
        return rpc.rpc_async(to, add, args=(x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def not_a_future():
    return 3


async def coroutine_add(a, b):
    await asyncio.sleep(0.01)
    return a + b


# -- without an engine ---------------------------------------------------------------------


def test_without_an_engine_init_rpc_says_what_to_install(monkeypatch):
    monkeypatch.setattr(rpc_agent, "entry_points", lambda group: [])
    with pytest.raises(RuntimeError, match="pip install aiopar-dask"):
        rpc.init_rpc("worker0")
    assert not rpc.is_available()


def test_calls_before_init_rpc_say_so():
    with pytest.raises(RuntimeError, match="init_rpc"):
        rpc.rpc_sync("worker1", add, args=(1, 2))
    with pytest.raises(RuntimeError, match="init_rpc"):
        rpc.get_worker_info()


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"name": ""}, ValueError, "1 to 128 of the characters"),
        ({"name": "a" * 129}, ValueError, "1 to 128 of the characters"),
        ({"name": "worker 1"}, ValueError, "1 to 128 of the characters"),
        ({"name": "w/1"}, ValueError, "1 to 128 of the characters"),
        ({"name": 7}, TypeError, "non-empty string"),
        ({"name": "w", "rank": -2}, ValueError, "rank must be a whole number >= 0"),
        ({"name": "w", "world_size": 0}, ValueError, "world_size must be"),
        ({"name": "w", "rank": 2, "world_size": 2}, ValueError, "rank must be < world_size"),
        ({"name": "w", "rpc_backend_options": {"rpc_timeout": 1}}, TypeError, "RpcBackendOptions"),
    ],
)
def test_init_rpc_checks_its_arguments(kwargs, error, words):
    with pytest.raises(error, match=words):
        rpc.init_rpc(**kwargs)


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"rpc_timeout": -1}, ValueError, "rpc_timeout"),
        ({"num_worker_threads": 0}, ValueError, "num_worker_threads"),
        ({"init_method": 8786}, TypeError, "scheduler address"),
    ],
)
def test_backend_options_check_their_values(options, error, words):
    with pytest.raises(error, match=words):
        RpcBackendOptions(**options)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"name": "a", "rank": 5}, ValueError, "rank 5 needs a world_size > 5"),
        ({"name": "a", "backend": 5}, TypeError, "backend is the name of an installed rpc engine"),
    ],
)
def test_init_rpc_refuses_what_it_cannot_start(kwargs, error, words):
    with pytest.raises(error, match=words):
        rpc.init_rpc(**kwargs)
    assert rpc_agent._current is None


def test_a_serving_peer_refuses_an_address_that_cannot_be_a_schedulers():
    with pytest.raises(ValueError, match=r"scheduler is a scheduler address .* Port out of range"):
        rpc_agent.serve_peer("tcp://127.0.0.1:99999", "server")


def test_peers_options_and_arguments_are_checked_where_they_are_made(fake):
    with pytest.raises(TypeError, match="name is the peer's name, a string, got 1"):
        WorkerInfo(1, 0)
    with pytest.raises(TypeError, match="id is the peer's rank, an int"):
        WorkerInfo("other", "1")
    with pytest.raises(TypeError, match="security is the engine's security object"):
        RpcBackendOptions(security="tls")
    with pytest.raises(ValueError, match=r"'tcp://127\.0\.0\.1:99999': Port out of range"):
        RpcBackendOptions(init_method="tcp://127.0.0.1:99999")
    with pytest.raises(ValueError, match="names no host"):
        RpcBackendOptions(init_method="tcp://:8786")
    with pytest.raises(TypeError, match="got the key 1"):
        rpc.rpc_async("other", add, kwargs={1: 2})
    with pytest.raises(ValueError, match="timeout is the most seconds"):
        rpc.shutdown(timeout="x")
    assert not fake.agents[0].closed  # still a peer
    assert rpc.get_worker_info().name == "me"


def test_torch_spellings():
    assert rpc.TensorPipeRpcBackendOptions is rpc.RpcBackendOptions
    assert rpc.DEFAULT_RPC_TIMEOUT == 60.0
    assert repr(WorkerInfo("worker1", 1)) == "WorkerInfo(id=1, name=worker1)"


def test_async_execution_marks_static_class_and_bound_methods():
    assert rpc_agent.is_async_execution(AsyncExecutionClass.static_async_add)
    assert rpc_agent.is_async_execution(AsyncExecutionClass.class_async_add)
    assert rpc_agent.is_async_execution(AsyncExecutionClass().bound_async_add)
    assert not rpc_agent.is_async_execution(add)
    assert AsyncExecutionClass.static_async_add.__name__ == "static_async_add"
    with pytest.raises(TypeError, match="decorates a function"):
        rpc.functions.async_execution(3)


def test_an_async_execution_function_must_return_a_future():
    with pytest.raises(TypeError, match=r"must return an aiopar\.Future, but it returned int"):
        run_callee(not_a_future, (), {})


def test_timeouts_follow_torch():
    assert rpc_agent.check_timeout(-1, 60.0) == 60.0  # torch's "unset"
    assert rpc_agent.check_timeout(0, 60.0) == 0.0  # no limit
    assert rpc_agent.check_timeout(None, 60.0) == 0.0
    assert rpc_agent.check_timeout(2.5, 60.0) == 2.5
    for bad in (-2, float("nan"), "1", True):
        with pytest.raises(ValueError, match="timeout"):
            rpc_agent.check_timeout(bad, 60.0)


def test_an_infinite_or_huge_timeout_is_no_limit():
    inf = float("inf")
    for huge in (inf, 1e300, 10**400, threading.TIMEOUT_MAX * 2):
        assert rpc_agent.check_timeout(huge, 60.0) == 0.0  # what an engine takes for no limit
        assert rpc_agent.check_timeout(-1, huge) == 0.0  # rpc_timeout in init_rpc's options
    assert rpc_agent.check_timeout(threading.TIMEOUT_MAX, 60.0) == threading.TIMEOUT_MAX
    assert RpcBackendOptions(rpc_timeout=inf).rpc_timeout == inf
    with pytest.raises(ValueError, match="0, None or inf: no limit"):
        rpc_agent.check_timeout(-inf, 60.0)


# -- on the fake engine ---------------------------------------------------------------------


def test_rpc_sync_async_and_worker_info(fake):
    assert rpc.rpc_sync("other", add, args=(1, 2)) == 3
    assert (
        rpc.rpc_async(1, add, args=(1,), kwargs={"b": 5}).then(lambda f: f.value() * 2).wait() == 12
    )
    assert rpc.rpc_sync(WorkerInfo("other", 1), add, args=[2, 2]) == 4
    assert rpc.get_worker_info() == WorkerInfo("me", 0)
    assert rpc.get_worker_info("other").id == 1

    async def main():
        return await rpc.rpc_async("other", add, args=(20, 1))

    assert asyncio.run(main()) == 21


def test_init_rpc_twice_says_so(fake):
    with pytest.raises(RuntimeError, match="is RPC peer 'me' already"):
        rpc.init_rpc("again")


def test_a_failed_init_rpc_leaves_no_peer(monkeypatch):
    from aiopar.rpc import _rref

    class FailingEngine(FakeEngine):
        """Its peer makes itself current and is given a value to own, then the
        start fails (as a real peer does whose wait for world_size times out)."""

        def start(self, name, rank, world_size, options) -> FakeAgent:
            rpc_agent.set_current_agent(super().start(name, rank, world_size, options))
            rpc.RRef("made by a caller before the start failed")
            raise TimeoutError("init_rpc waited 0.1 s for 3 peers")

    failing, working = FailingEngine(), FakeEngine()
    engines = iter([failing, working])
    monkeypatch.setattr(rpc_agent, "find_engine", lambda backend=None: next(engines))
    with pytest.raises(TimeoutError, match="for 3 peers"):
        rpc.init_rpc("me", world_size=3)
    assert rpc_agent._current is None
    assert _rref._owned == {}
    with pytest.raises(RuntimeError, match="init_rpc"):
        rpc.get_worker_info()
    rpc.init_rpc("me")
    try:
        assert rpc_agent.current_agent() is working.agents[0]
    finally:
        rpc.shutdown()


def test_bad_calls_fail_at_the_call(fake):
    with pytest.raises(ValueError, match="the peers are"):
        rpc.rpc_async("nobody", add)
    with pytest.raises(TypeError, match="args=\\(x,\\)"):
        rpc.rpc_async("other", add, args=1)
    with pytest.raises(TypeError, match="kwargs is a dict"):
        rpc.rpc_async("other", add, kwargs=[1])
    with pytest.raises(TypeError, match="func must be a callable"):
        rpc.rpc_async("other", 3)
    with pytest.raises(TypeError, match="peer's name, id or WorkerInfo"):
        rpc.rpc_async(1.5, add)
    with pytest.raises(ValueError, match="timeout"):
        rpc.rpc_async("other", add, timeout=-3)


def test_callee_exceptions_reach_the_caller(fake):
    with pytest.raises(KeyError, match="on purpose"):
        rpc.rpc_sync("other", fail)


def test_a_coroutine_function_is_awaited(fake):
    assert rpc.rpc_sync("other", coroutine_add, args=(1, 2)) == 3


def test_torch_async_execution_examples(fake):
    assert rpc.rpc_sync("other", AsyncExecutionClass.static_async_add, args=("me", 1, 1, 2)) == 4
    assert rpc.rpc_sync("other", AsyncExecutionClass.class_async_add, args=("me", 1, 1, 2)) == 4
    rref = rpc.remote("other", AsyncExecutionClass)
    assert rref.rpc_sync().static_async_add("me", 1, 1, 2) == 4
    assert rref.rpc_async().class_async_add("me", 1, 1, 2).wait() == 4
    assert rref.remote().bound_async_add("me", 1, 1, 2).to_here() == 4


def test_rref_of_a_remote_value(fake):
    rref = rpc.remote("other", Counter, args=(10,))
    assert rref.owner() == WorkerInfo("other", 1)
    assert rref.owner_name() == "other"
    assert not rref.is_owner()
    assert rref.rpc_sync().add(5) == 15
    assert rref.rpc_async().value().wait() == 15
    assert rref.remote().value().to_here() == 15
    assert rref.rpc_sync().later(1) == 16  # an async_execution method
    assert rref.to_here().n == 15
    assert rref.confirmed_by_owner()
    with pytest.raises(RuntimeError, match="call to_here"):
        rref.local_value()
    assert "owner=other" in repr(rref)


def test_rref_creation_failures_surface_at_to_here(fake):
    rref = rpc.remote("other", fail)
    with pytest.raises(KeyError, match="on purpose"):
        rref.to_here()
    with pytest.raises(KeyError, match="on purpose"):
        rref.rpc_sync().anything()


def test_a_value_whose_creation_failed_leaves_no_cycle_on_its_owner(fake, gc_off):
    # The owner's future of the value holds the exception, whose traceback
    # holds the frames that ran the creating call: none of them may hold
    # that future, or it outlives its last RRef until the garbage collector runs.
    from aiopar.rpc import _rref

    box = [rpc.remote("other", fail)]
    created = box[0]._created
    assert created is not None
    created.wait(10)
    value = weakref.ref(_rref._owned[box[0]._id])
    assert isinstance(value().exception(), KeyError)
    box.clear()
    rpc.rpc_sync("other", add, args=(1,))  # tells the owner the RRef is gone
    deadline = time.monotonic() + 5
    while value() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert value() is None


def test_a_local_rref(fake):
    rref = rpc.RRef([1, 2])
    assert rref.is_owner()
    assert rref.local_value() == [1, 2]
    assert rref.to_here() == [1, 2]
    assert rref.rpc_sync().index(2) == 1


def test_an_rref_travels_in_arguments(fake):
    rref = rpc.remote("other", Counter, args=(3,))
    assert rpc.rpc_sync("other", read_rref, args=(rref,)) == 3


def read_rref(rref: rpc.RRef[Counter]) -> int:
    return rref.rpc_sync().value()


def test_shutdown_clears_the_agent_and_owned_values(fake):
    from aiopar.rpc import _rref

    kept = rpc.RRef("kept")
    assert kept._id in _rref._owned
    rpc.shutdown()
    assert fake.agents[0].closed
    assert _rref._owned == {}
    with pytest.raises(RuntimeError, match="init_rpc"):
        rpc.get_worker_info()


def test_a_collected_rref_drops_its_value_on_the_owner(fake):
    from aiopar.rpc import _rref

    rref = rpc.remote("other", Counter, args=(1,))
    assert rref.to_here().n == 1
    rref_id = rref._id
    assert rref_id in _rref._owned  # "other" lives in this process here
    del rref
    rpc.rpc_sync("other", add, args=(1, 1))  # the next call tells the owner
    deadline = time.monotonic() + 5
    while rref_id in _rref._owned and time.monotonic() < deadline:
        time.sleep(0.01)
    assert rref_id not in _rref._owned


def replace_apply(monkeypatch: pytest.MonkeyPatch, apply: Callable[..., None]) -> None:
    """Have owners apply changes with ``apply`` (which the fake agent, as it
    sends functions by name, finds under the name of the one it replaces)."""
    from aiopar.rpc import _rref

    apply.__module__, apply.__qualname__ = _rref._apply.__module__, "_apply"
    monkeypatch.setattr(_rref, "_apply", apply)


def test_changes_reach_an_owner_in_order_one_call_at_a_time(fake, monkeypatch):
    # Calls run concurrently on an owner: a peer sends it the next changes
    # only once the last have been applied, so "gone" never overtakes the
    # announcement of a fork its sender made before.
    from aiopar.rpc import _rref

    applied: list[list[tuple[bool, str, str]]] = []
    first_arrived, release = threading.Event(), threading.Event()
    at_once = []
    running = 0

    def recorder(changes):
        nonlocal running
        running += 1
        at_once.append(running)
        if not applied:
            first_arrived.set()
            release.wait(5)
        applied.append(changes)
        running -= 1

    replace_apply(monkeypatch, recorder)
    other = WorkerInfo("other", 1)
    agent = fake.agents[0]
    _rref._changes.append((other, (True, "v", "f1")))
    _rref.send_changes(agent)
    assert first_arrived.wait(5)
    later = [(True, "v", f"f{i}") for i in range(2, 6)] + [(False, "v", "f1")]
    for change in later:
        _rref._changes.append((other, change))
    senders = [threading.Thread(target=_rref.send_changes, args=(agent,)) for _ in range(4)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(5)
    assert applied == []  # the first call is still on its way: the rest wait
    release.set()

    def changes_of_v() -> list[tuple[bool, str, str]]:
        # (an RRef of an earlier test, collected meanwhile, may add its own)
        return [change for changes in applied for change in changes if change[1] == "v"]

    deadline = time.monotonic() + 5
    while len(changes_of_v()) < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert changes_of_v() == [(True, "v", "f1"), *later]
    assert max(at_once) == 1


def test_a_fork_gone_before_it_is_announced_or_created_leaves_nothing(fake):
    # Calls run concurrently on the owner: a fork's "gone" may come first.
    from aiopar.rpc import _rref

    _rref._apply([(False, "early-1", "fork-a")])
    _rref._create("early-1", "fork-a", add, (1, 2), {})
    _rref._create("later-2", "fork-b", add, (1, 2), {})
    _rref._apply([(False, "later-3", "fork-c"), (True, "later-2", "fork-d")])
    _rref._apply([(False, "later-2", "fork-b"), (True, "later-3", "fork-c")])
    assert list(_rref._owned) == ["later-2"]  # fork-d lives on
    _rref._apply([(False, "later-2", "fork-d")])
    assert _rref._owned == {}
    assert _rref._forks == {}
    assert _rref._gone_early == set()


def test_an_rref_whose_creation_failed_says_so_at_once(fake):
    rref = rpc.remote("other", add, args=(1, 2))
    assert rref.to_here() == 3
    lost: aiopar.Future[None] = aiopar.Future()
    lost.set_exception(aiopar.BrokenWorkerError("rpc peer 'other' is gone"))
    rref._created = lost  # as when the owner dies while it makes the value
    assert not rref.confirmed_by_owner()
    for use in (lambda: rref.to_here(timeout=None), lambda: rref.rpc_sync().bit_length()):
        with pytest.raises(aiopar.BrokenWorkerError, match="'other' is gone"):
            use()


def test_a_value_lost_by_its_owner_is_looked_up_in_vain(fake):
    from aiopar.rpc import _rref

    rref = rpc.remote("other", add, args=(1, 2))
    assert rref.to_here() == 3 and rref.confirmed_by_owner()
    _rref._owned.clear()  # as a restarted owner has it
    with pytest.raises(LookupError, match="'me' no longer has the value"):
        rref.to_here(timeout=None)


kept_rrefs: list[rpc.RRef[Any]] = []


def keep_rref(rref: rpc.RRef[Any]) -> None:
    kept_rrefs.append(rref)


def test_a_shared_rref_lives_until_its_last_copy_is_gone(fake, monkeypatch):
    from aiopar.rpc import _rref

    applied: list[tuple[bool, str, str]] = []
    apply = _rref._apply

    def recorder(changes):
        apply(changes)
        applied.extend(changes)

    replace_apply(monkeypatch, recorder)
    rref = rpc.remote("other", Counter, args=(3,))
    assert rpc.rpc_sync("other", read_rref, args=(rref,)) == 3  # a copy went and went again
    rpc.rpc_sync("other", keep_rref, args=(rref,))  # a copy kept
    rref_id, fork_id = rref._id, rref._fork
    del rref
    gc.collect()
    rpc.rpc_sync("other", add, args=(1, 1))  # the next call tells the owner
    eventually(lambda: (False, rref_id, fork_id) in applied, timeout=10)
    assert rref_id in _rref._owned
    kept_rrefs.clear()
    gc.collect()
    rpc.rpc_sync("other", add, args=(1, 1))
    eventually(lambda: rref_id not in _rref._owned, timeout=10)


def test_an_rref_whose_creation_failed_cannot_be_sent(fake):
    rref = rpc.remote("other", add, args=(1, 2))
    lost: aiopar.Future[None] = aiopar.Future()
    lost.set_exception(TimeoutError("the call of _create() had no reply after 0.01 s"))
    rref._created = lost
    with pytest.raises(RuntimeError, match="cannot be sent: the call that was to create"):
        rpc.rpc_sync("other", keep_rref, args=(rref,))


def test_the_core_imports_no_engine():
    code = (
        "import sys, aiopar.rpc; engines = ('distributed', 'dask', 'aiopar_dask'); "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in engines))"
    )
    done = python("-c", code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_init_rpc_takes_torchs_positional_order_and_backend_type(monkeypatch):
    started = []

    class Engine(FakeEngine):
        def start(self, name, rank, world_size, options) -> FakeAgent:
            started.append((name, rank, world_size, options.rpc_timeout))
            return super().start(name, rank, world_size, options)

    asked = []
    engine = Engine()

    def find_engine(backend=None):
        asked.append(backend)
        return engine

    monkeypatch.setattr(rpc_agent, "find_engine", find_engine)
    # init_rpc(name, backend, rank, world_size, rpc_backend_options), as torch's
    options = rpc.TensorPipeRpcBackendOptions(rpc_timeout=5)
    rpc.init_rpc("w0", rpc.BackendType.TENSORPIPE, 0, 2, options)
    try:
        assert started == [("w0", 0, 2, 5)]
        assert asked[-1] == "dask"  # TENSORPIPE stands for the default engine
        assert rpc.get_rpc_timeout() == 5
    finally:
        rpc.shutdown()
    assert rpc.BackendType.DASK == "dask"
