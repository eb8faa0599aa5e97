"""aiopar.rpc on dask: torch's examples across real processes, one thread per peer."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import threading
import time
import traceback
import weakref

import distributed
import numpy as np
import pytest
from aiopar_dask import DaskBackend
from dask_helpers import (
    Faulty,
    TrackedFailure,
    after_timer,
    descendant_pids,
    fail_deep,
    listening_addresses,
    log_debug_to,
    tracked_failures_alive,
    wait_until,
)
from torch_rpc_helpers import AsyncExecutionClass  # torch's, used here too

import aiopar
from aiopar import rpc

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def peers():
    """This process is worker0; worker1 and worker2 are processes with one thread each."""
    before = descendant_pids()
    rpc.init_rpc(
        "worker0", world_size=3, rpc_backend_options=rpc.RpcBackendOptions(num_worker_threads=1)
    )
    yield descendant_pids() - before
    rpc.shutdown()


# -- what the peers run (imported by name in the worker processes) -------------------------


def whoami() -> tuple[str, int]:
    return rpc.get_worker_info().name, os.getpid()


@rpc.functions.async_execution
def async_add_chained(to, x, y, z):
    # torch's first async_execution example, numpy in place of torch
    return rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_add(to, x, y):
    # torch's TorchScript example, without TorchScript
    return rpc.rpc_async(to, np.add, (x, y))


@rpc.functions.async_execution
def fail_later():
    return aiopar.fork(fail_deep)


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.n = start

    def add(self, k: int) -> int:
        self.n += k
        return self.n

    def value(self) -> int:
        return self.n


def nested_sync(to: str, depth: int) -> int:
    """A chain of blocking rpc_sync calls between one-thread peers."""
    if depth == 0:
        return 0
    back = "worker2" if to == "worker1" else "worker1"
    return rpc.rpc_sync(to, nested_sync, args=(back, depth - 1)) + 1


def fork_on_dask(x: int) -> int:
    with aiopar.use_backend("dask", client=distributed.get_client()):
        return aiopar.fork(np.square, x).wait()


async def coroutine_add(a, b):
    await asyncio.sleep(0.01)
    return a + b


def unpicklable_result():
    return threading.Lock()


# -- calls -----------------------------------------------------------------------------------


def test_peers_are_named_as_torch_names_them(peers):
    assert rpc.get_worker_info() == rpc.WorkerInfo("worker0", 0)
    assert rpc.get_worker_info("worker2") == rpc.WorkerInfo("worker2", 2)
    names = {rpc.rpc_sync(f"worker{r}", whoami)[0] for r in range(3)}
    assert names == {"worker0", "worker1", "worker2"}
    assert rpc.rpc_sync("worker1", whoami)[1] in peers  # a process of its own
    assert rpc.rpc_sync("worker0", whoami)[1] == os.getpid()  # this process is a peer too


def test_rpc_async_is_an_aiopar_future(peers):
    fut = rpc.rpc_async("worker1", np.add, args=(1, 2))
    assert isinstance(fut, aiopar.Future)
    assert fut.then(lambda f: f.value() * 10).wait() == 30

    async def main():
        return await rpc.rpc_async(1, np.multiply, args=(3, 4))

    assert asyncio.run(main()) == 12


def test_arrays_cross_processes(peers):
    a = np.arange(1_000_000, dtype=np.float64)
    b = rpc.rpc_sync("worker1", np.multiply, args=(a, 2))
    np.testing.assert_array_equal(b, 2 * a)
    b[0] = 7.0  # a result is writeable, as a local one would be


def test_torch_async_execution_examples(peers):
    ret = rpc.rpc_sync("worker1", async_add_chained, args=("worker2", np.ones(2), 1, 1))
    np.testing.assert_array_equal(ret, [3.0, 3.0])
    ret = rpc.rpc_sync("worker1", async_add, args=("worker2", np.ones(2), 1))
    np.testing.assert_array_equal(ret, [2.0, 2.0])
    for method in (AsyncExecutionClass.static_async_add, AsyncExecutionClass.class_async_add):
        ret = rpc.rpc_sync("worker1", method, args=("worker2", np.ones(2), 1, 2))
        np.testing.assert_array_equal(ret, [4.0, 4.0])
    rref = rpc.remote("worker1", AsyncExecutionClass)
    ret = rref.rpc_sync().static_async_add("worker2", np.ones(2), 1, 2)
    np.testing.assert_array_equal(ret, [4.0, 4.0])
    rref = rpc.remote("worker1", AsyncExecutionClass)
    ret = rref.rpc_async().static_async_add("worker2", np.ones(2), 1, 2).wait()
    np.testing.assert_array_equal(ret, [4.0, 4.0])
    rref = rpc.remote("worker1", AsyncExecutionClass)
    ret = rref.remote().static_async_add("worker2", np.ones(2), 1, 2).to_here()
    np.testing.assert_array_equal(ret, [4.0, 4.0])
    ret = rref.rpc_sync().bound_async_add("worker2", np.ones(2), 1, 2)
    np.testing.assert_array_equal(ret, [4.0, 4.0])


def test_async_execution_holds_no_callee_thread(peers):
    # worker1 has one thread: 100 calls that each held it for 0.5 s would take 50 s.
    start = time.monotonic()
    futures = [rpc.rpc_async("worker1", after_timer, args=(0.5, i)) for i in range(100)]
    assert aiopar.wait_all(futures) == list(range(100))
    assert time.monotonic() - start < 10


def test_blocking_calls_nested_across_one_thread_peers_finish(peers):
    assert rpc.rpc_sync("worker1", nested_sync, args=("worker2", 6)) == 6


def test_rref(peers):
    rref = rpc.remote("worker1", Counter, args=(1,))
    assert rref.owner() == rpc.WorkerInfo("worker1", 1)
    assert rref.owner_name() == "worker1"
    assert not rref.is_owner()
    assert rref.rpc_sync().add(5) == 6
    assert rref.rpc_async().value().wait() == 6
    assert rref.remote().value().to_here() == 6
    assert rref.to_here(timeout=10).n == 6
    with pytest.raises(RuntimeError, match="to_here"):
        rref.local_value()
    # An RRef passed to its owner is the owner's value itself.
    assert rpc.rpc_sync("worker1", local_n, args=(rref,)) == 6


def local_n(rref: rpc.RRef[Counter]) -> int:
    return rref.local_value().n


def test_a_coroutine_function_is_awaited_on_the_callee(peers):
    assert rpc.rpc_sync("worker2", coroutine_add, args=(2, 3)) == 5


def test_forks_inside_a_peer_run_on_its_cluster(peers):
    assert rpc.rpc_sync("worker1", fork_on_dask, args=(7,)) == 49


# -- failures ----------------------------------------------------------------------------------


def test_an_unknown_peer_raises_at_once_listing_the_peers(peers):
    with pytest.raises(ValueError, match="worker0 \\(id 0\\), worker1 \\(id 1\\), worker2"):
        rpc.rpc_async("worker9", whoami)
    with pytest.raises(ValueError, match="with id 7"):
        rpc.rpc_async(7, whoami)


def test_callee_exception_keeps_type_and_remote_traceback(peers):
    with pytest.raises(ValueError, match="on purpose") as info:
        rpc.rpc_sync("worker2", fail_deep)
    text = "".join(traceback.format_exception(info.value))
    assert "inner_helper" in text
    assert "rpc peer 'worker2'" in text


def test_the_callee_logs_a_failed_call_at_debug_level_naming_the_caller(peers, tmp_path):
    log = tmp_path / "worker2.log"
    rpc.rpc_sync("worker2", log_debug_to, args=(str(log),))
    with pytest.raises(ValueError, match="on purpose"):
        rpc.rpc_sync("worker2", fail_deep)
    with pytest.raises(ValueError, match="on purpose"):  # an async_execution call's future
        rpc.rpc_sync("worker2", fail_later)
    lines = log.read_text().splitlines()
    said = [line for line in lines if line.startswith("DEBUG") and "called by" in line]
    assert said == [
        "DEBUG fail_deep(), called by rpc peer 'worker0', raised ValueError",
        "DEBUG fail_later(), called by rpc peer 'worker0', raised ValueError",
    ], lines
    assert any("inner_helper" in line for line in lines)  # with their tracebacks


def _freed_without_the_garbage_collector(use_and_drop) -> bool:
    """Whether the failed future ``use_and_drop(box)`` takes out of a box goes
    once it returns, the garbage collector off: no reference cycle holds it.
    (The hub's thread may still be on its way out of the frames that settled it.)"""
    box = [rpc.rpc_async("worker2", fail_deep)]
    assert isinstance(box[0].exception(timeout=30), ValueError)
    gone = weakref.ref(box[0])
    use_and_drop(box)
    return wait_until(lambda: gone() is None, timeout=5)


def _wait_and_catch(box) -> None:
    with contextlib.suppress(ValueError):
        box.pop().wait()


def test_a_failed_call_leaves_no_reference_cycle(peers, gc_off):
    # The exception's frames stay only as long as the caller keeps the future.
    assert _freed_without_the_garbage_collector(_wait_and_catch)
    assert _freed_without_the_garbage_collector(lambda box: box.pop().exception())


def test_a_method_that_fails_on_its_rref_owner_leaves_no_cycle_there(peers):
    # The owner runs the method in the frames that settle its call's future:
    # none may hold that future, or the failure stays until the collector runs.
    rref = rpc.remote("worker1", Faulty)
    rpc.rpc_sync("worker1", gc.disable)
    try:
        for call in (lambda: rref.rpc_sync().fail(), lambda: rref.rpc_async().fail().wait()):
            with pytest.raises(TrackedFailure):
                call()
        assert wait_until(lambda: rpc.rpc_sync("worker1", tracked_failures_alive) == 0, 5)
    finally:
        rpc.rpc_sync("worker1", gc.enable)


def test_replying_with_a_failed_future_leaves_no_reference_cycle(gc_off):
    # An async_execution call's future, read on the callee to reply: reading
    # it raised the exception in a frame that held the future.
    from aiopar_dask import _agent

    class Connection:
        peer_name = "worker0"

        def send(self, *frames, wait):
            pass

    def failed() -> aiopar.Future[None]:
        return aiopar.fork(fail_deep)  # (this frame holds no future while it fails)

    box = [failed()]
    assert box[0].exception(timeout=30) is not None
    gone = weakref.ref(box[0])
    _agent._reply_future("fail_deep()", Connection(), 1, box.pop(), False)
    assert wait_until(lambda: gone() is None, timeout=5)


def test_a_call_times_out(peers):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no reply after 0\.3 s"):
        rpc.rpc_sync("worker2", after_timer, args=(5, None), timeout=0.3)
    assert time.monotonic() - start < 3


@pytest.mark.parametrize(
    "timeout",
    [float("inf"), 1e300, 10**400, threading.TIMEOUT_MAX],
    ids=["inf", "1e300", "10**400", "TIMEOUT_MAX"],
)
def test_an_infinite_or_huge_timeout_is_no_limit(peers, timeout):
    assert rpc.rpc_sync("worker1", np.add, args=(1, 2), timeout=timeout) == 3
    rref = rpc.remote("worker1", np.add, args=(2, 2), timeout=timeout)
    assert rref.to_here(timeout=timeout) == 4
    # the engine, called directly, takes such timeouts as no limit too
    agent = rpc.agent.current_agent()
    assert agent.call(agent.peer("worker1"), np.add, (3, 3), {}, timeout).wait(10) == 6
    # and calls with a timeout still time out
    late = rpc.rpc_async("worker2", after_timer, args=(2, None), timeout=0.2)
    with pytest.raises(TimeoutError, match=r"no reply after 0\.2 s"):
        late.wait(timeout=10)


def test_what_does_not_pickle_fails_clearly(peers):
    with pytest.raises(TypeError, match="cannot be sent"):
        rpc.rpc_async("worker1", whoami, args=(threading.Lock(),))
    with pytest.raises(TypeError, match="cannot be sent back"):
        rpc.rpc_sync("worker1", unpicklable_result)


def test_the_embedded_cluster_listens_on_loopback_only(peers):
    assert listening_addresses({os.getpid(), *peers}) == {"127.0.0.1"}


def test_the_dask_backend_and_rpc_coexist(peers):
    with DaskBackend(n_workers=1, threads_per_worker=1, processes=False) as backend:
        assert backend.fork(rpc.rpc_sync, "worker1", np.add, args=(1, 1)).wait() == 2


def echo(value):
    return value


def odd_arrays() -> dict[str, np.ndarray]:
    """Arrays whose buffers are unusual: empty shapes, orders, byte orders, dtypes, flags."""
    read_only = np.arange(4.0)
    read_only.flags.writeable = False
    return {
        "(0, 0)": np.ones((0, 0)),
        "(3, 0)": np.ones((3, 0), dtype=np.float32),
        "(0, 3) Fortran": np.ones((0, 3), order="F"),
        "zero-size": np.array([], dtype=np.int8),
        "0-d": np.array(2.5),
        "Fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "strided view": np.arange(10.0)[::3],
        "big-endian": np.arange(4, dtype=">i4"),
        "object": np.array([1, "a", None], dtype=object),
        "structured": np.array([(1, 2.0)], dtype=[("a", "i4"), ("b", "f8")]),
        "read-only": read_only,
    }


def assert_same_array(got: np.ndarray, sent: np.ndarray, what: str) -> None:
    assert (got.dtype, got.shape) == (sent.dtype, sent.shape), what
    assert got.tolist() == sent.tolist(), what
    assert got.flags.writeable == sent.flags.writeable, what
    if sent.flags.f_contiguous and not sent.flags.c_contiguous:
        assert got.flags.f_contiguous, what


@pytest.mark.parametrize("what", list(odd_arrays()))
def test_an_odd_array_survives_the_wire_framing(what):
    from aiopar_dask import _wire

    sent = odd_arrays()[what]
    frames, writeable = _wire.dumps(sent)
    # as the receiving side gets them: fresh memory, read-only where it was
    copies = [frames[0]] + [
        memoryview(bytearray(f)) if w else memoryview(bytes(f))
        for f, w in zip(frames[1:], writeable[1:], strict=True)
    ]
    assert_same_array(_wire.loads(copies), sent, what)


def test_odd_arrays_travel_as_arguments_and_results(peers):
    # A zero-length dimension once failed the call ("cannot cast view with zeros in shape")
    for what, sent in odd_arrays().items():
        assert_same_array(rpc.rpc_sync("worker1", echo, args=(sent,)), sent, what)


def returns_a_future_undecorated():
    future = aiopar.Future()
    future.set_result(1)
    return future


def test_a_plain_function_that_returns_a_future_fails_at_once(peers):
    # It was taken for an async_execution one (its caller waited for the Future, the
    # whole timeout if it never finished); torch fails the call at once.
    with pytest.raises(TypeError, match=r"@rpc\.functions\.async_execution"):
        rpc.rpc_sync("worker1", returns_a_future_undecorated, timeout=30)


def slow_value(value):
    time.sleep(0.5)
    return value


def values_owned() -> int:
    from aiopar.rpc import _rref

    return len(_rref._owned)


def test_a_remote_whose_creation_times_out_fails_and_its_owner_keeps_nothing(peers):
    # to_here() once returned the value anyway, and the owner kept it, as torch does not.
    before = rpc.rpc_sync("worker1", values_owned)
    rref = rpc.remote("worker1", slow_value, args=(42,), timeout=0.1)
    with pytest.raises(TimeoutError, match=r"no reply after 0\.1 s"):
        rref.to_here(timeout=10)
    assert not rref.confirmed_by_owner()
    assert wait_until(lambda: rpc.rpc_sync("worker1", values_owned) == before, timeout=10)


def fetch_size(rref: rpc.RRef[np.ndarray]) -> int:
    """On a third peer: use the RRef's value (a call to its owner), and drop the copy."""
    return int(rref.to_here().nbytes)


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def still_owned(rref_ids: list[str]) -> int:
    """How many of these values the owner still keeps."""
    from aiopar.rpc import _rref

    return sum(rref_id in _rref._owned for rref_id in rref_ids)


@pytest.mark.timeout(240)  # 20,000 calls: slow on a busy machine
def test_ten_thousand_rrefs_shared_with_a_third_peer_leave_the_owner_flat(peers):
    # Each RRef's value lives on worker1; a copy goes to worker2, which uses
    # it and drops it; then this peer drops its own. The owner counts the
    # copies across peers (torch's fork protocol) and frees every value.
    # (The count is of this test's values: an earlier test's may go meanwhile.)
    def share(count: int) -> list[str]:
        rref_ids = []
        for _ in range(count):
            rref = rpc.remote("worker1", np.ones, args=(1024,))  # 8 KB on the owner
            assert rpc.rpc_sync("worker2", fetch_size, args=(rref,)) == 8192
            rref_ids.append(rref._id)
        return rref_ids

    def kept(rref_ids: list[str]) -> int:
        # the peers tell owners with their next call: one from each
        rpc.rpc_sync("worker2", rpc.rpc_sync, args=("worker1", len, ((),)))
        return rpc.rpc_sync("worker1", still_owned, args=(rref_ids,))

    warm_up = share(500)  # the allocator's pools warm up
    assert wait_until(lambda: kept(warm_up) == 0, timeout=30), f"{kept(warm_up)} of 500 kept"
    start = rpc.rpc_sync("worker1", rss_mb)
    shared = share(10_000)  # 80 MB of values if the owner kept them
    assert wait_until(lambda: kept(shared) == 0, timeout=30), f"{kept(shared)} of 10,000 kept"
    assert rpc.rpc_sync("worker1", rss_mb) - start < 30


kept: list[rpc.RRef[object]] = []


def keep(rref: rpc.RRef[object]) -> None:
    kept.append(rref)


def drop_kept() -> None:
    kept.clear()


def test_a_peer_that_calls_no_more_still_lets_its_rref_copies_go(peers):
    # worker2 holds a copy, drops it, and never calls worker1 (the owner):
    # it tells the owner within half a second all the same.
    before = rpc.rpc_sync("worker1", values_owned)
    rref = rpc.remote("worker1", np.ones, args=(3,))
    rpc.rpc_sync("worker2", keep, args=(rref,))
    del rref
    rpc.rpc_sync("worker1", len, args=((),))  # this peer's own copy is gone
    assert rpc.rpc_sync("worker1", values_owned) == before + 1  # worker2's is not
    rpc.rpc_sync("worker2", drop_kept)
    assert wait_until(lambda: rpc.rpc_sync("worker1", values_owned) == before, timeout=10)


def test_an_rref_sent_with_a_lambda_is_one_copy_to_its_owner(peers):
    # A message that plain pickle cannot take is pickled again by cloudpickle:
    # an RRef in it must not become two copies, one of which never goes away.
    from aiopar_dask import _wire

    from aiopar.rpc import _rref

    rref = rpc.remote("worker1", np.ones, args=(3,))
    rpc.rpc_sync("worker1", len, args=((),))  # what was queued is sent
    _wire.dumps((lambda r: r, (rref,), {}))
    announced = [change for _, change in _rref._changes if change[0] and change[1] == rref._id]
    assert len(announced) == 1


def test_a_then_callback_may_call_the_same_peer_and_callbacks_keep_their_order(peers):
    # then() callbacks once ran on the thread that reads the peer's replies,
    # ahead of the done-callbacks added before them: a blocking call to the same
    # peer there waited for a reply that thread was to read, until its timeout.
    ran: list[str] = []
    call = rpc.rpc_async("worker1", after_timer, args=(0.3, 1))
    call.add_done_callback(lambda _: ran.append("first"))
    chained = call.then(
        lambda done: (ran.append("then"), rpc.rpc_sync("worker1", len, args=((1, 2),)))[1]
    )
    assert chained.wait(timeout=30) == 2
    assert ran == ["first", "then"]


def test_done_callbacks_of_a_call_take_asyncios_context_keyword(peers):
    import contextvars

    var = contextvars.ContextVar("var", default="outside")
    context = contextvars.copy_context()
    context.run(var.set, "inside")
    seen = aiopar.Future()
    call = rpc.rpc_async("worker1", after_timer, args=(0.1, 1))
    call.add_done_callback(lambda _: seen.set_result(var.get()), context=context)
    assert seen.wait(timeout=30) == "inside"
