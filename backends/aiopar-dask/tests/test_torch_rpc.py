"""torch's rpc_test.py (RpcTest, and what applies of FaultyAgentRpcTest and
TensorPipeAgentRpcTest) on aiopar.rpc, numpy arrays for tensors.

As torch's harness has it, the ranks are separate processes on one
scheduler, here four: this test process is worker0, and workers 1 to 3 are
processes started once for the module (the ``world`` fixture) that serve
calls until every peer shuts down. A test whose torch body runs on every
rank sends the body to each rank with ``rpc_async``. The tests whose body
starts and stops rpc itself come first, before the module's world exists
(this process can be one peer at a time): each joins a scheduler of its own
with one more rank process that runs the same body. Where aiopar differs
from torch on purpose (docs/distributed.md, "The mapping: every torch
name"), a test asserts aiopar's behaviour and says so.
"""

from __future__ import annotations

import datetime
import gc
import logging
import pickle
import re
import subprocess
import time
import traceback
from functools import partial

import numpy as np
import pytest
import torch_rpc_helpers as h
from dask_helpers import Leftovers, loopback_cluster, wait_until
from torch_rpc_helpers import (
    MyClass,
    TensorClass,
    expected_err,
    my_function,
    worker_name,
)

import aiopar
from aiopar import rpc

pytestmark = pytest.mark.timeout(60)

WORLD_SIZE = h.WORLD_SIZE
RANKS = [worker_name(rank) for rank in range(WORLD_SIZE)]


def start_rank(entry: str, *args: object, log) -> subprocess.Popen:
    """A rank process running ``torch_rpc_helpers.<entry>(*args)``, its output to ``log``."""
    return subprocess.Popen(
        h.rank_command(entry, *args),
        env=h.rank_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(procs: list[subprocess.Popen], log, timeout: float = 60) -> None:
    """Wait for the rank processes to end, and fail unless each exited 0 (kill them if not)."""
    try:
        codes = [proc.wait(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    log.seek(0)
    assert codes == [0] * len(procs), log.read()


def assert_equal(actual, expected) -> None:
    np.testing.assert_array_equal(actual, expected)


# == tests whose body starts and stops rpc: two ranks, each with its own scheduler =======
#
# torch runs these bodies on every rank; here rank 0 runs it in this process
# and rank 1 in a process of its own, on a scheduler only they share.


@pytest.fixture(autouse=True)
def leaves_no_process():
    left = Leftovers()
    yield
    assert wait_until(lambda: not left.processes(), timeout=15), left.processes()


def run_two_ranks(entry: str, scheduler: str, tmp_path, *more: object) -> None:
    """torch's body ``entry`` on ranks 0 (here) and 1 (a process) of a world of two."""
    with open(tmp_path / "rank1.log", "w+") as log:
        proc = start_rank(entry, 1, scheduler, 2, *more, log=log)
        try:
            getattr(h, entry)(0, scheduler, 2, *more)
        finally:
            finish([proc], log)


def test_reinit(scheduler, tmp_path):
    run_two_ranks("lifecycle_reinit", scheduler, tmp_path)


def test_init_rpc_twice(scheduler, tmp_path):
    run_two_ranks("lifecycle_init_rpc_twice", scheduler, tmp_path, str(tmp_path))


def test_shutdown_followed_by_rpc(scheduler, tmp_path):
    run_two_ranks("lifecycle_shutdown_followed_by_rpc", scheduler, tmp_path)


def test_local_shutdown(scheduler, tmp_path):
    run_two_ranks("lifecycle_local_shutdown", scheduler, tmp_path)


def test_local_shutdown_with_rpc(scheduler, tmp_path):
    run_two_ranks("lifecycle_local_shutdown_with_rpc", scheduler, tmp_path, str(tmp_path))


def test_use_rref_after_shutdown(scheduler, tmp_path):
    # torch also refuses to pickle the RRef afterwards; an aiopar RRef is a
    # name and an owner, and pickles at any time
    run_two_ranks("lifecycle_use_rref_after_shutdown", scheduler, tmp_path)


def test_duplicate_name_2(scheduler, tmp_path):
    # aiopar: ValueError (torch: RuntimeError "is not unique")
    rpc.init_rpc("worker0", rank=0, rpc_backend_options=h.options(scheduler))
    try:
        with open(tmp_path / "rank1.log", "w+") as log:
            proc = start_rank("lifecycle_duplicate_name", 1, scheduler, log=log)
            finish([proc], log)
            log.seek(0)
            assert "ValueError: an rpc peer called 'worker0' is in the cluster already" in (
                log.read()
            )
    finally:
        rpc.shutdown()


@pytest.mark.xfail(
    # Not strict: which of the two it raises depends on whether this peer
    # listed the other before the scheduler forgot it, a race the test
    # cannot settle; any other outcome fails.
    strict=False,
    raises=ValueError,
    reason="a peer that left before this one ever listed it is not remembered: the call "
    "raises the ValueError of a name no peer had ('there is no rpc peer called'); one "
    "this peer listed raises BrokenWorkerError, as torch's does",
)
def test_handle_send_exceptions(scheduler, tmp_path):
    # A peer that left without waiting for the others: a call to it fails at
    # once, as torch's does, with a RuntimeError (aiopar: BrokenWorkerError)
    # that says so.
    with open(tmp_path / "rank1.log", "w+") as log:
        proc = start_rank("lifecycle_leave_at_once", 1, scheduler, 2, log=log)
        try:
            h.join(0, scheduler, 2)
            rpc._set_rpc_timeout(10)
            finish([proc], log)
            start = time.monotonic()
            # raised by rpc_async at once if this peer has heard that worker1
            # left, else by the future
            with pytest.raises(aiopar.BrokenWorkerError, match=r"'worker1'.* left or died"):
                rpc.rpc_async(worker_name(1), np.add, args=(np.ones(1), 3)).wait()
            assert time.monotonic() - start < 10  # an error, not the timeout
        finally:
            if rpc.agent._current is not None:
                rpc.shutdown(graceful=False)


def test_world_size_one(scheduler):
    rpc.init_rpc(
        name="me",
        backend=rpc.BackendType.TENSORPIPE,
        rank=0,
        world_size=1,
        rpc_backend_options=h.options(scheduler),
    )
    try:
        expect = np.ones((2, 2)) * 2
        result = rpc.rpc_sync("me", h.my_tensor_function, args=(np.ones((2, 2)), np.ones((2, 2))))
        assert_equal(result, expect)

        expect = np.ones((3, 3)) * 2
        result = rpc.rpc_async(
            "me", h.my_tensor_function, args=(np.ones((3, 3)), np.ones((3, 3)))
        ).wait()
        assert_equal(result, expect)

        expect = np.ones((4, 4)) * 2
        result = rpc.remote(
            "me", h.my_tensor_function, args=(np.ones((4, 4)), np.ones((4, 4)))
        ).to_here()
        assert_equal(result, expect)
    finally:
        rpc.shutdown()


def test_set_and_get_default_rpc_timeout(scheduler):
    timeout = 0.5
    rpc.init_rpc(
        name=worker_name(0),
        rank=0,
        world_size=1,
        rpc_backend_options=h.options(scheduler, rpc_timeout=timeout),
    )
    try:
        assert rpc.get_rpc_timeout() == timeout
    finally:
        rpc.shutdown()


def test_tensorpipe_set_default_timeout(scheduler):
    timeout = 0.5
    rpc_backend_options = rpc.TensorPipeRpcBackendOptions(
        init_method=scheduler, num_worker_threads=8, rpc_timeout=timeout
    )
    rpc.init_rpc(
        name=worker_name(0),
        backend=rpc.BackendType.TENSORPIPE,
        rank=0,
        world_size=1,
        rpc_backend_options=rpc_backend_options,
    )
    try:
        assert rpc.get_rpc_timeout() == timeout
    finally:
        rpc.shutdown()


def test_infer_backend_from_options(scheduler):
    rpc_backend_options = rpc.TensorPipeRpcBackendOptions(init_method=scheduler)
    rpc.init_rpc(
        name=worker_name(0),
        rank=0,
        world_size=1,
        # Do _not_ pass backend.
        rpc_backend_options=rpc_backend_options,
    )
    try:
        assert rpc.get_worker_info() == rpc.WorkerInfo(worker_name(0), 0)
        assert rpc.get_rpc_timeout() == rpc.DEFAULT_RPC_TIMEOUT == 60
    finally:
        rpc.shutdown()


def test_invalid_names():
    # aiopar checks a name in init_rpc, before it starts anything, and raises
    # ValueError (torch: RuntimeError from WorkerInfo, which here takes any name)
    for name, message in [
        ("abc*", "A-Z a-z 0-9 _ - :"),
        (" ", "A-Z a-z 0-9 _ - :"),
        ("", "1 to 128"),
        ("a" * 500, "1 to 128"),
    ]:
        with pytest.raises(ValueError, match=message):
            rpc.init_rpc(name, rank=0, world_size=1)
        assert rpc.agent._current is None
    assert rpc.WorkerInfo("abc*", 0).name == "abc*"
    with pytest.raises(TypeError, match="name is the peer's name"):
        rpc.init_rpc(7)


def test_wrong_types(scheduler):
    # backend: torch wants a BackendType member (TypeError); aiopar takes an
    # engine's name, so a string that names none is a ValueError
    with pytest.raises(ValueError, match="no rpc engine called 'TENSORPIPE'"):
        rpc.init_rpc(
            name=worker_name(0),
            rank=0,
            world_size=1,
            backend="TENSORPIPE",
            rpc_backend_options=h.options(scheduler),
        )
    with pytest.raises(TypeError, match="backend"):
        rpc.init_rpc(name=worker_name(0), rank=0, world_size=1, backend=3)
    with pytest.raises(TypeError, match=r"must be aiopar\.rpc\.RpcBackendOptions, got dict"):
        rpc.init_rpc(
            name=worker_name(0),
            rank=0,
            world_size=1,
            backend=rpc.BackendType.TENSORPIPE,
            rpc_backend_options={"init_method": scheduler},
        )
    assert rpc.agent._current is None


def test_tensorpipe_options_throw_on_timedelta_timeout():
    # aiopar: ValueError (torch: TypeError from pybind)
    with pytest.raises(ValueError, match="rpc_timeout is a number of seconds"):
        rpc.TensorPipeRpcBackendOptions(
            init_method="tcp://127.0.0.1:8786", rpc_timeout=datetime.timedelta()
        )


def test_is_available():
    # not in torch's rpc_test (its harness checks it): the engine is installed
    assert rpc.is_available() is True
    assert rpc.BackendType.TENSORPIPE == rpc.BackendType.DASK == "dask"


# == the module's world: ranks 1 to 3 are processes, this one is rank 0 ==============


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Four ranks on one loopback scheduler; this process is worker0."""
    logs = tmp_path_factory.mktemp("ranks")
    left = Leftovers()
    with loopback_cluster(n_workers=0) as cluster, open(logs / "ranks.log", "w+") as log:
        address = cluster.scheduler_address
        procs = [start_rank("serve_rank", rank, address, log=log) for rank in (1, 2, 3)]
        try:
            rpc.init_rpc(
                worker_name(0),
                backend=rpc.BackendType.TENSORPIPE,
                rank=0,
                world_size=WORLD_SIZE,
                rpc_backend_options=h.options(address),
            )
            try:
                yield address
            finally:
                # graceful: waits for the calls still running (the tests'
                # fire-and-forget ones) and for every rank to shut down too
                rpc.shutdown(timeout=60)
            finish(procs, log)
            log.seek(0)
            said = log.read()
            # each rank's last word, and no traceback (no_result prints too)
            # (the ranks share the log, and an unbuffered print writes its
            # line and its newline apart: lines may interleave)
            assert all(f"rank {r} done" in said for r in (1, 2, 3)), said
            assert "Traceback" not in said, said
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
    assert wait_until(lambda: not left.processes(), timeout=15), left.processes()


def on_every_rank(body, *args) -> list:
    """``body(rank, *args)`` on every rank at once, as torch's harness runs a
    test body; their results in rank order (the first failure is raised)."""
    return aiopar.wait_all(
        [rpc.rpc_async(name, body, args=(rank, *args)) for rank, name in enumerate(RANKS)]
    )


def retrieve_failures(futs: list[aiopar.Future]) -> None:
    """Read the failures a test expects but does not look at (aiopar reports
    a failure nobody retrieved when its future is collected)."""
    aiopar.collect_all(futs).wait(timeout=30)
    for fut in futs:
        fut.exception()


class TestRpc:
    """torch's RpcTest, run on rank 0 (``self.rank``) of the module's world."""

    rank = 0
    world_size = WORLD_SIZE

    @pytest.fixture(autouse=True)
    def _in_world(self, world):
        yield
        rpc.set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)  # as torch's tests reset it

    def _run_func_in_mode(self, to, fn, mode, args=None, kwargs=None):
        if mode == "sync":
            return rpc.rpc_sync(to, fn, args=args, kwargs=kwargs)
        if mode == "async":
            return rpc.rpc_async(to, fn, args=args, kwargs=kwargs).wait()
        assert mode == "remote"
        return rpc.remote(to, fn, args=args, kwargs=kwargs).to_here()

    def _next(self, step: int = 1) -> str:
        return worker_name((self.rank + step) % self.world_size)

    # -- peers ----------------------------------------------------------------------------

    def test_worker_id(self):
        on_every_rank(h.worker_id_body)

    def test_get_worker_infos(self):
        worker_infos = rpc.agent.current_agent().peers()
        assert {info.name for info in worker_infos} == {
            worker_name(rank) for rank in range(self.world_size)
        }
        assert {info.id for info in worker_infos} == set(range(self.world_size))
        assert all(isinstance(info, rpc.WorkerInfo) for info in worker_infos)

    def test_self_add(self):
        self_worker_info = rpc.get_worker_info()
        fut = rpc.rpc_async(self_worker_info, np.add, args=(np.ones((2, 2)), 1))
        ret = rpc.rpc_sync(self_worker_info, np.add, args=(np.ones((2, 2)), 1))
        assert_equal(fut.wait(), np.ones((2, 2)) + 1)
        assert_equal(ret, np.ones((2, 2)) + 1)

    def test_send_to_rank(self):
        dst_rank = (self.rank + 1) % self.world_size
        modes = ["sync", "async", "remote"]
        for mode in modes:
            ret = self._run_func_in_mode(dst_rank, np.add, mode, args=(np.ones((2, 2)), 1))
            assert_equal(ret, np.ones((2, 2)) + 1)

        # aiopar: ValueError for a rank no peer has (torch: RuntimeError) ...
        for bad in (self.world_size + 1, -1):
            for mode in modes:
                with pytest.raises(ValueError, match=f"no rpc peer with id {bad}"):
                    self._run_func_in_mode(bad, np.add, mode, args=(np.ones((2, 2)), 1))
        # ... and TypeError for a rank that is not an int (torch: ValueError)
        for bad in (dst_rank + 0.5, dst_rank - 0.5):
            for mode in modes:
                with pytest.raises(TypeError, match="to is a peer's name, id or WorkerInfo"):
                    self._run_func_in_mode(bad, np.add, mode, args=(np.ones((2, 2)), 1))

    def test_int_callee(self):
        dst_rank = (self.rank + 1) % self.world_size
        assert rpc.rpc_sync(dst_rank, h.return_callee_id) == dst_rank

    def test_add_with_id(self):
        n = self.rank + 1
        dst_rank = n % self.world_size
        worker_info = rpc.get_worker_info(worker_name(dst_rank))
        ret = rpc.rpc_sync(worker_info, np.add, args=(np.ones((n, n)), np.ones((n, n))))
        assert_equal(ret, np.ones((n, n)) * 2)

    def test_expected_src(self):
        aiopar.wait_all([rpc.rpc_async(name, h.reset_value) for name in RANKS])
        # each rank tells the next who it is
        callers = on_every_rank(h.expected_src_body)
        assert callers == [(r - 1) % self.world_size for r in range(self.world_size)]

    # -- calls ----------------------------------------------------------------------------

    def test_add(self):
        n = self.rank + 1
        ret = rpc.rpc_sync(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        assert_equal(ret, np.ones((n, n)) * 2)

    def test_scalar_add(self):
        n = self.rank + 1
        ret = rpc.rpc_sync(self._next(), np.add, args=(np.ones((n, n)), n))
        assert_equal(ret, np.ones((n, n)) + n)

    def test_async_add(self):
        n = self.rank + 1
        fut = rpc.rpc_async(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        assert isinstance(fut, aiopar.Future)
        assert_equal(fut.wait(), np.ones((n, n)) * 2)

    def test_nonzero(self):
        x = np.ones((self.world_size, self.world_size))
        x[self.rank][self.rank] = 0
        ret = rpc.rpc_sync(self._next(), np.nonzero, args=(x,))
        assert_equal(ret, x.nonzero())

    def test_multi_rpc(self):
        for i in range(20):
            n = i + self.rank + 1
            ret = rpc.rpc_sync(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
            assert_equal(ret, np.ones((n, n)) * 2)

    def test_graceful_shutdown_with_uneven_workload(self):
        # torch's _run_uneven_workload; the graceful shutdown that must wait
        # for it is the module's, at the end
        for dst in ("worker1", "worker2"):
            futs = [rpc.rpc_async(dst, h.heavy_rpc, args=(np.ones((100, 100)),)) for _ in range(30)]
            for fut in aiopar.collect_all(futs).wait():
                assert fut.wait() == 0

    def test_py_built_in(self):
        n = self.rank + 1
        assert rpc.rpc_sync(self._next(), min, args=(n, n + 1, n + 2)) == min(n, n + 1, n + 2)

    def test_py_user_defined(self):
        n = self.rank + 1
        ret = rpc.rpc_sync(self._next(), my_function, kwargs={"a": n, "b": n + 1, "c": n + 2})
        assert ret == my_function(n, n + 1, n + 2)

    def test_py_class_constructor(self):
        n = self.rank + 1
        assert rpc.rpc_sync(self._next(), MyClass, args=(n,)).a == n

    def test_py_class_instance_method(self):
        n = self.rank + 1
        ret = rpc.rpc_sync(self._next(), MyClass(2).my_instance_method, args=(n,))
        assert ret == MyClass(2).my_instance_method(n)

    def test_py_class_method(self):
        n = self.rank + 1
        ret = rpc.rpc_sync(self._next(), MyClass.my_class_method, args=(n, n + 1))
        assert ret == MyClass.my_class_method(n, n + 1)

    def test_py_class_static_method(self):
        n = self.rank + 1
        ret = rpc.rpc_sync(self._next(), MyClass.my_static_method, args=(n + 10,))
        assert ret == MyClass.my_static_method(n + 10)

    def test_py_multi_async_call(self):
        n = self.rank + 1
        dst_worker_info = rpc.get_worker_info(self._next())
        fut1 = rpc.rpc_async(dst_worker_info, MyClass.my_static_method, args=(n + 10,))
        fut2 = rpc.rpc_async(dst_worker_info, min, args=(n, n + 1, n + 2))
        assert fut1.wait() == MyClass.my_static_method(n + 10)
        assert fut2.wait() == min(n, n + 1, n + 2)

    def test_py_no_return_result(self):
        assert rpc.rpc_sync(self._next(), h.no_result) is None

    def test_py_tensors(self):
        n = self.rank + 1
        ret = rpc.rpc_sync(
            self._next(), h.my_tensor_function, args=(np.ones((n, n)), np.ones((n, n)))
        )
        assert_equal(ret, h.my_tensor_function(np.ones((n, n)), np.ones((n, n))))

    def test_py_tensors_multi_async_call(self):
        futs = [
            rpc.rpc_async(
                self._next(), h.my_tensor_function, args=(np.ones((i, i)), np.ones((i, i)))
            )
            for i in range(100)
        ]
        for j, val in enumerate(aiopar.wait_all(futs)):
            assert_equal(val, h.my_tensor_function(np.ones((j, j)), np.ones((j, j))))

    def test_py_tensors_in_container(self):
        n = self.rank + 1
        a = [np.ones((n, n)), np.ones((n, n))]
        b = TensorClass(h.build_complex_tensors())
        c = {"foo": np.ones((n, n)), "bar": np.ones((n, n))}
        ret = rpc.rpc_sync(self._next(), h.my_complex_tensor_function, args=(a, b, c))
        # computed after the call: the local call adds into a[0] in place
        expected = h.my_complex_tensor_function(a, b, c)
        assert isinstance(ret, tuple) and len(ret) == 4
        assert_equal(ret[0], expected[0])
        assert_equal(ret[1], expected[1])
        assert isinstance(ret[3], list) and len(ret[3]) == 2

    def test_py_nested_pickle(self):
        ret = rpc.rpc_sync(
            self._next(), h.run_nested_pickle, args=(h.MyPickleClass(), np.ones((2, 2)))
        )
        m = h.MyPickleClass()
        m.set(h.my_tensor_function(np.ones((2, 2)), np.ones((2, 2))))
        assert_equal(ret, h.run_nested_pickle(m, np.ones((2, 2))))

    def test_py_function_exception(self):
        with pytest.raises(TypeError, match="no_result"):
            rpc.rpc_sync(self._next(), h.no_result, args=(10,))

    def test_py_raise_in_user_func(self):
        # Each rank calls the next, as in torch, whose callee prints the error
        # on its stderr: aiopar's logs it, with its traceback, at debug level
        # on the "aiopar.rpc" logger, naming the caller. (torch meets at a
        # barrier before it reads what was logged; an aiopar callee logs
        # before it replies.)
        aiopar.wait_all([rpc.rpc_async(name, h.capture_rpc_log) for name in RANKS])
        try:
            on_every_rank(h.raise_in_user_func_body)
        finally:
            logs = aiopar.wait_all([rpc.rpc_async(name, h.captured_rpc_log) for name in RANKS])
        for rank, records in enumerate(logs):
            caller = worker_name((rank - 1) % self.world_size)
            said = f"raise_func(), called by rpc peer '{caller}', raised ValueError"
            found = [(level, text) for level, text in records if text.startswith(said)]
            assert len(found) == 1, (rank, records)
            [(level, text)] = found
            assert level == logging.DEBUG, text
            assert f"ValueError: {expected_err}" in text, text
            assert 'torch_rpc_helpers.py", line' in text and "in raise_func" in text, text

        # and the caller gets the exception with the callee's traceback
        fut = rpc.rpc_async(self._next(), h.raise_func)
        with pytest.raises(ValueError, match=expected_err) as info:
            fut.wait()
        text = "".join(traceback.format_exception(info.value))
        assert "raise_func" in text and "torch_rpc_helpers.py" in text

    def test_py_raise_in_user_func_escaped_str(self):
        fut = rpc.rpc_async(self._next(), h.raise_func_escape)
        with pytest.raises(ValueError) as info:
            fut.wait()
        msg = str(info.value)
        assert msg == msg.encode("utf-8").decode("unicode_escape")
        assert msg == h.expected_err_escape

    def test_nested_rpc(self):
        ret = rpc.rpc_sync(self._next(), h.nested_rpc, args=(worker_name(self.rank),))
        assert_equal(ret, np.ones((2, 2)) + 1)

    def _stress_test_rpc(self, f, repeat=1000, args=()):
        futs = [rpc.rpc_async(self._next(), f, args=args) for _ in range(repeat)]
        for val in aiopar.wait_all(futs):
            assert val == 0

    def test_stress_light_rpc(self):
        self._stress_test_rpc(h.light_rpc)

    def test_stress_heavy_rpc(self):
        self._stress_test_rpc(h.heavy_rpc, repeat=20, args=(np.ones((100, 100)),))

    def test_deadlock(self, tmp_path):
        # aiopar has no process groups: torch.distributed's run beside it. In
        # torch's test every rank joins the group; here the two ranks that
        # the deadlock needs do, since each rank that joins loads torch
        # (about 3 s of CPU), and this process never does.
        ranks = {1: RANKS[1], 2: RANKS[2]}
        if not all(aiopar.wait_all([rpc.rpc_async(name, h.has_gloo) for name in ranks.values()])):
            pytest.skip("torch with gloo process groups is not installed")
        store = str(tmp_path / "store")
        aiopar.wait_all(
            [rpc.rpc_async(name, h.deadlock_body, args=(r, store)) for r, name in ranks.items()]
        )

    def test_op_with_invalid_args(self):
        # aiopar: the callee's TypeError (torch: RuntimeError "failed to match any schema")
        with pytest.raises(TypeError, match="add"):
            rpc.rpc_sync(self._next(), np.add, args=())

    def test_function_not_on_callee(self):
        # the function exists here but not on the callee
        callee = worker_name(1)
        rpc.rpc_sync(callee, h.remove_foo_add)
        try:
            assert hasattr(h, "foo_add")
            with pytest.raises(AttributeError, match="foo_add"):
                rpc.rpc_sync(callee, h.foo_add, args=())
        finally:
            rpc.rpc_sync(callee, h.restore_foo_add)
        assert_equal(rpc.rpc_sync(callee, h.foo_add), np.full(1, 2.0))

    def test_non_cont_tensors(self):
        # aiopar sends arrays as numpy pickles them: the values, and a view
        # arrives as a contiguous array (torch keeps it a view)
        t = np.random.rand(5, 5)
        t_view = t[:, 2:4]
        assert not t_view.flags.c_contiguous
        t_cont = np.ascontiguousarray(t_view)
        contiguous, equal, t_ret = rpc.rpc_sync(
            self._next(), h.non_cont_test, args=(t_view, t_cont)
        )
        assert equal
        assert contiguous
        assert_equal(t_ret, t_view)

    # -- remote and RRefs -------------------------------------------------------------

    def test_self_py_udf_remote(self):
        rref = rpc.remote(rpc.get_worker_info(), my_function, args=(np.ones((2, 2)), 1, 3))
        assert_equal(rref.to_here(), np.ones((2, 2)) + 1 + 3)

    def _test_self_remote_rref_as_rpc_arg(self, dst):
        self_worker_info = rpc.get_worker_info()
        rref = rpc.remote(self_worker_info, my_function, args=(np.ones((2, 2)), 1, 3))
        fut = rpc.rpc_async(dst, h.add_rref_to_value, args=(rref, np.ones((2, 2))))
        ret = rpc.rpc_sync(dst, h.add_rref_to_value, args=(rref, np.ones((2, 2)) + 1))
        assert_equal(ret, np.ones((2, 2)) + 1 + 3 + np.ones((2, 2)) + 1)
        assert_equal(fut.wait(), np.ones((2, 2)) + 1 + 3 + np.ones((2, 2)))

    def test_self_remote_rref_as_rpc_arg(self):
        self._test_self_remote_rref_as_rpc_arg(self._next())

    def test_self_remote_rref_as_self_rpc_arg(self):
        self._test_self_remote_rref_as_rpc_arg(rpc.get_worker_info())

    def _test_self_remote_rref_as_remote_arg(self, dst):
        rref = rpc.remote(rpc.get_worker_info(), my_function, args=(np.ones((2, 2)), 1, 3))
        ret_rref = rpc.remote(dst, h.add_rref_to_value, args=(rref, np.ones((2, 2))))
        assert_equal(ret_rref.to_here(), np.ones((2, 2)) + 1 + 3 + np.ones((2, 2)))

    def test_self_remote_rref_as_remote_arg(self):
        self._test_self_remote_rref_as_remote_arg(self._next())

    def test_self_remote_rref_as_self_remote_arg(self):
        self._test_self_remote_rref_as_remote_arg(rpc.get_worker_info())

    def test_rref_proxy_non_exist(self):
        rref = rpc.remote(self._next(), my_function, args=(np.ones((2, 2)), 1, 3))
        msg = "has no attribute 'non_exist'"
        with pytest.raises(AttributeError, match=msg):
            rref.rpc_sync().non_exist()
        # aiopar: the proxy's future fails, and the RRef's to_here() raises
        # (torch raises at once, from the proxy's call)
        with pytest.raises(AttributeError, match=msg):
            rref.rpc_async().non_exist().wait()
        with pytest.raises(AttributeError, match=msg):
            rref.remote().non_exist().to_here()

    def _test_rref_proxy_tensor(self, dst):
        rref = rpc.remote(dst, my_function, args=(np.ones((2, 2)), 1, 3))
        expected = np.ones((2, 2)) + 1 + 3
        assert expected.shape == rref.rpc_sync().copy().shape
        assert_equal(expected + 1, rref.rpc_async().__add__(1).wait())
        assert_equal(expected.reshape(1, 4), rref.remote().reshape(1, 4).to_here())

    def test_rref_proxy_tensor(self):
        self._test_rref_proxy_tensor(self._next())

    def test_rref_proxy_tensor_self(self):
        self._test_rref_proxy_tensor(rpc.get_worker_info())

    def test_rref_proxy_reuse(self):
        rref = rpc.remote(self._next(), my_function, args=(np.ones((2, 2)), 1, 3))
        expected = np.ones((2, 2)) + 1 + 3

        proxy_rpc_sync = rref.rpc_sync()
        proxy_rpc_async = rref.rpc_async()
        proxy_remote = rref.remote()

        assert expected.shape == proxy_rpc_sync.copy().shape
        assert_equal(expected + 1, proxy_rpc_sync.__add__(1))
        assert_equal(expected.reshape(1, 4), proxy_rpc_sync.reshape(1, 4))

        assert expected.shape == proxy_rpc_async.copy().wait().shape
        assert_equal(expected + 3, proxy_rpc_async.__add__(3).wait())
        assert_equal(expected.reshape(4, 1), proxy_rpc_async.reshape(4, 1).wait())

        assert expected.shape == proxy_remote.copy().to_here().shape
        assert_equal(expected + 5, proxy_remote.__add__(5).to_here())
        assert_equal(expected.reshape(-1), proxy_remote.reshape(-1).to_here())

    def _test_rref_proxy_class(self, dst):
        rref = rpc.remote(dst, MyClass, args=(7,))
        expected = MyClass(7)
        assert expected.get_value() == rref.rpc_sync().get_value()
        assert expected.get_value() == rref.rpc_async().get_value().wait()
        assert expected.get_value() == rref.remote().get_value().to_here()

        expected.increment_value(3)
        assert rref.rpc_sync().increment_value(1) is None
        assert rref.rpc_async().increment_value(1).wait() is None
        assert rref.remote().increment_value(1).to_here() is None

        assert expected.get_value() == rref.rpc_sync().get_value()
        assert expected.get_value() == rref.rpc_async().get_value().wait()
        assert expected.get_value() == rref.remote().get_value().to_here()

        assert expected.my_instance_method(2) == rref.rpc_sync().my_instance_method(2)
        assert expected.my_instance_method(3) == rref.rpc_async().my_instance_method(3).wait()
        assert expected.my_instance_method(4) == rref.remote().my_instance_method(4).to_here()

        assert expected.my_static_method(9) == rref.rpc_sync().my_static_method(9)
        assert expected.my_static_method(10) == rref.rpc_async().my_static_method(10).wait()
        assert expected.my_static_method(11) == rref.remote().my_static_method(11).to_here()

        assert_equal(
            expected.my_class_method(2, np.zeros((2, 2))),
            rref.rpc_sync().my_class_method(2, np.zeros((2, 2))),
        )
        assert_equal(
            expected.my_class_method(2, np.ones((3, 3))),
            rref.rpc_async().my_class_method(2, np.ones((3, 3))).wait(),
        )
        assert_equal(
            expected.my_class_method(2, np.ones((4, 4))),
            rref.remote().my_class_method(2, np.ones((4, 4))).to_here(),
        )

    def test_rref_proxy_class(self):
        self._test_rref_proxy_class(self._next())

    def test_rref_proxy_class_self(self):
        self._test_rref_proxy_class(rpc.get_worker_info())

    def test_builtin_remote_ret(self):
        n = self.rank + 1
        rref = rpc.remote(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        assert_equal(rref.to_here(), np.ones((n, n)) * 2)

    def test_builtin_remote_self(self):
        rref = rpc.remote(worker_name(self.rank), np.add, args=(np.ones((2, 2)), np.ones((2, 2))))
        assert_equal(rref.local_value(), np.ones((2, 2)) * 2)

    def _test_multi_remote_call(self, fn, args_fn=lambda x: (), kwargs_fn=lambda x: {}):
        m = 10
        n = self.rank + 1
        rrefs = []
        expected = []
        for i in range(m):
            n = n + i
            rrefs.append(rpc.remote(self._next(), fn, args=args_fn(n), kwargs=kwargs_fn(n)))
            expected.append(fn(*args_fn(n), **kwargs_fn(n)))
        for i in range(m):
            assert_equal(rrefs[i].to_here(), expected[i])

    def test_multi_builtin_remote_ret(self):
        self._test_multi_remote_call(np.add, args_fn=lambda n: (np.ones((n, n)), np.ones((n, n))))

    def test_py_udf_remote(self):
        n = self.rank + 1
        rref = rpc.remote(self._next(), my_function, kwargs={"a": n, "b": n + 1, "c": n + 2})
        assert rref.to_here() == my_function(n, n + 1, n + 2)

    def test_multi_py_udf_remote(self):
        def kwargs_fn(n):
            return {"a": np.ones((n, n)), "b": np.ones((n, n)), "c": np.ones((n, n))}

        self._test_multi_remote_call(my_function, kwargs_fn=kwargs_fn)

    def test_py_rref_args(self):
        n = self.rank + 1
        rref_a = rpc.remote(self._next(), np.add, args=(np.ones((n, n)), 2))
        rref_b = rpc.remote(self._next(), np.add, args=(np.ones((n, n)), 1))
        rref_c = rpc.remote(self._next(), h.my_rref_function, args=(rref_a, rref_b))
        assert_equal(rref_c.to_here(), np.ones((n, n)) + 4)

    def test_py_rref_args_user_share(self):
        n = self.rank + 1
        owner, user = self._next(1), self._next(2)
        rref_a = rpc.remote(owner, my_function, args=(np.ones((n, n)), 2, 0))
        rref_b = rpc.remote(owner, my_function, args=(np.ones((n, n)), 1, 0))
        rref_c = rpc.remote(user, h.my_rref_function, args=(rref_a, rref_b))
        assert_equal(rref_c.to_here(), np.ones((n, n)) + 4)

    def test_py_rpc_rref_args(self):
        n = self.rank + 1
        rref_a = rpc.remote(self._next(), my_function, args=(np.ones((n, n)), 2, 0))
        rref_b = rpc.remote(self._next(), my_function, args=(np.ones((n, n)), 1, 0))
        c = rpc.rpc_sync(self._next(), h.my_rref_function, args=(rref_a, rref_b))
        assert_equal(c, np.ones((n, n)) + 4)

    def test_nested_remote(self):
        rref = rpc.remote(self._next(1), h.nested_remote, args=(self._next(2),))
        assert_equal(rref.to_here(), np.ones((2, 2)) + 3)

    def test_nested_rref(self):
        rref_of_rrefs = rpc.remote(self._next(1), h.nested_rref, args=(self._next(2),))
        rrefs = rref_of_rrefs.to_here()
        assert len(rrefs) == 2
        assert all(rref.owner_name() == self._next(2) for rref in rrefs)
        assert_equal(rrefs[0].to_here(), np.ones((2, 2)) + 1)
        assert_equal(rrefs[1].to_here(), np.ones((2, 2)) + 2)

    def test_nested_rref_stress(self):
        all_rrefs = [
            rpc.remote(self._next(1), h.nested_rref, args=(self._next(2),)) for _ in range(20)
        ]
        for rref_of_rrefs in all_rrefs:
            rrefs = rref_of_rrefs.to_here()
            assert len(rrefs) == 2
            assert_equal(rrefs[0].to_here(), np.ones((2, 2)) + 1)
            assert_equal(rrefs[1].to_here(), np.ones((2, 2)) + 2)

    def test_multi_layer_nested_async_rpc(self):
        # torch's test returns at once and relies on shutdown to drain the
        # chain; here each hop is also counted, so the chain is seen to finish
        for name in RANKS:
            rpc.rpc_sync(name, h.nested_hops, args=(True,))
        ttl = 20
        h.multi_layer_nested_async_rpc((self.rank + 1) % self.world_size, self.world_size, ttl)

        def hops():
            return sum(rpc.rpc_sync(name, h.nested_hops) for name in RANKS)

        assert wait_until(lambda: hops() == ttl, timeout=20), hops()

    def test_remote_with_exception(self):
        rref = rpc.remote(self._next(), h.raise_func)
        with pytest.raises(ValueError):
            rref.to_here()
        rref = rpc.remote(worker_name(self.rank), h.no_result, args=(10,))
        with pytest.raises(TypeError):
            rref.to_here()

    def test_remote_throw(self):
        rref = rpc.remote(self._next(), h.raise_or_inc, args=(np.ones(2),))
        with pytest.raises(Exception, match=r".*Expected error.*"):
            rref.to_here()

    def test_rpc_return_rref(self):
        rref = rpc.rpc_sync(self._next(1), h.rpc_return_rref, args=(self._next(2),))
        assert isinstance(rref, rpc.RRef)
        assert_equal(rref.to_here(), np.ones((2, 2)) + 1)

    def test_rref_forward_chain(self):
        ttl = 8
        n = self.rank + 1
        dst_rank = n % self.world_size
        rref = rpc.remote(worker_name(dst_rank), np.add, args=(np.ones((n, n)), 1))
        ret_rref = h.rref_forward_chain(dst_rank, self.world_size, rref, ttl)
        for _ in range(ttl):
            assert len(ret_rref) == 1
            ret_rref = ret_rref[0].to_here()
        assert_equal(ret_rref, np.add(np.ones((n, n)), 1))

    def test_local_rref_no_fork(self):
        local_rref = rpc.RRef(35)
        assert local_rref.local_value() == 35
        assert local_rref.to_here() == 35
        assert local_rref.is_owner()
        assert local_rref.confirmed_by_owner()

    def test_local_value_not_on_owner(self):
        on_every_rank(h.local_value_not_on_owner_body)

    def test_return_local_rrefs(self):
        rref_list = rpc.rpc_sync(self._next(), h.get_rref_list, args=([1, 2, 3],))
        for rref in rref_list:
            rpc.rpc_sync(
                rref.owner(), h._call_method_on_rref, args=(MyClass.increment_value, rref, 10)
            )
        rets = [
            rpc.rpc_sync(rref.owner(), h._call_method_on_rref, args=(MyClass.get_value, rref))
            for rref in rref_list
        ]
        assert rets == [11, 12, 13]

    def test_owner_equality(self):
        on_every_rank(h.owner_equality_body)

    def test_pass_local_rrefs(self):
        rref = rpc.RRef(40)
        dst = self._next()
        assert rpc.rpc_sync(dst, h.add_rref_to_value, args=(rref, 50)) == 90
        assert rpc.rpc_async(dst, h.add_rref_to_value, args=(rref, 50)).wait() == 90
        assert rpc.remote(dst, h.add_rref_to_value, args=(rref, 50)).to_here() == 90

    def test_remote_same_worker(self):
        n = self.rank + 1
        rref_a = rpc.remote(self._next(), np.add, args=(np.ones((n, n)), 2))
        rref_b = rpc.remote(self._next(), np.add, args=(np.ones((n, n)), 1))
        rref_c = rpc.remote(self._next(), h.my_rref_function, args=(rref_a, rref_b))
        assert_equal(rref_c.to_here(), np.ones((n, n)) + 4)

    def test_call_method_on_rref(self):
        vals = [10, 2, 5, 7]
        dst_worker = self._next()
        rref = rpc.remote(dst_worker, MyClass, args=(vals[0],))
        rpc.rpc_sync(
            rref.owner(), h._call_method_on_rref, args=(MyClass.increment_value, rref, vals[1])
        )
        rpc.rpc_async(
            rref.owner(), h._call_method_on_rref, args=(MyClass.increment_value, rref, vals[2])
        ).wait()
        rpc.remote(
            rref.owner(), h._call_method_on_rref, args=(MyClass.increment_value, rref, vals[3])
        ).to_here()
        result = rpc.rpc_sync(dst_worker, h._call_method_on_rref, args=(MyClass.get_value, rref))
        assert result == sum(vals)

    def test_rref_str(self):
        on_every_rank(h.rref_str_body)

    def test_rref_py_pickle_not_supported(self):
        # aiopar: an RRef pickles, which is how it travels in calls (torch
        # refuses torch.save of one); the copy refers to the same value
        local_rref = rpc.RRef(35)
        copy = pickle.loads(pickle.dumps(local_rref))
        assert copy.owner() == local_rref.owner()
        assert copy.local_value() == 35

    def test_user_rrefs_confirmed(self):
        rref = rpc.remote(self._next(2), np.add, args=(np.zeros((2, 2)), 1))
        assert rpc.rpc_sync(self._next(1), h.check_rref_confirmed, args=(rref,)) is True

    def test_user_rrefs_confirmed_remote(self):
        rref = rpc.remote(self._next(2), np.add, args=(np.zeros((2, 2)), 1))
        ret_rref = rpc.remote(self._next(1), h.check_rref_confirmed, args=(rref,))
        assert ret_rref.to_here() is True

    def test_rref_confirmed_by_owner_on_creator(self):
        # not in torch's test: the creator's RRef is confirmed once the
        # owner has made the value, and not while it is being made
        rref = rpc.remote(self._next(), MyClass, args=(1, True))
        assert rref.confirmed_by_owner() is False
        assert rref.to_here().a == 1
        assert rref.confirmed_by_owner() is True

    def test_non_garbage_collected_user_rref_due_to_local_circular_dependency(self):
        # torch checks that shutdown does not hang on it: the module's
        # graceful shutdown, at the end, does that here
        a = MyClass(1)
        b = MyClass(2)
        a.other = b
        b.other = a
        n = self.rank
        a.rref = rpc.remote(self._next(), np.add, args=(np.ones((n, n)), 2))
        assert a.rref.to_here().shape == (n, n)

    def test_rref_drops_value_when_collected(self):
        # not in torch's test (torch checks its owner's debug counters): the
        # owner drops a value once the RRef that remote returned is collected
        rref = rpc.remote(self._next(), MyClass, args=(1,))
        rref.to_here()
        rref_id = rref._id
        owned = partial(rpc.rpc_sync, self._next(), h.owns, args=(rref_id,))
        assert owned() is True
        del rref
        gc.collect()
        assert wait_until(lambda: owned() is False, timeout=10)

    # -- timeouts --------------------------------------------------------------------------

    def test_rref_timeout(self):
        # aiopar: to_here() raises the TimeoutError of the creation call
        # (torch: RuntimeError "RRef creation")
        rref = rpc.remote(self._next(), h.my_sleep_func, args=(0.5,), timeout=0.01)
        with pytest.raises(TimeoutError):
            rref.to_here()
        assert rref.confirmed_by_owner() is False
        with pytest.raises(TimeoutError):
            rref.rpc_sync().bit_length()

    def test_default_timeout_used(self):
        dst = self._next()
        rpc._set_rpc_timeout(0.001)  # 1 ms
        futs = [rpc.rpc_async(dst, h.my_sleep_func, args=(0.1,)) for _ in range(10)]
        # aiopar: TimeoutError (torch: RuntimeError), naming the timeout, so
        # the default is seen to be the one used
        expected_error = rf"my_sleep_func\(\) to rpc peer '{dst}' had no reply after 0\.001 s"
        for fut in futs:
            with pytest.raises(TimeoutError, match=expected_error):
                fut.wait()

        # a new default applies to later calls only
        rpc._set_rpc_timeout(200)
        fut1 = rpc.rpc_async(dst, h.my_sleep_func, args=(0.05,))
        rpc._set_rpc_timeout(0.001)
        fut2 = rpc.rpc_async(dst, h.my_sleep_func, args=(0.5,))
        with pytest.raises(TimeoutError, match=expected_error):
            fut2.wait()
        fut1.wait()

        # Zero timeout means infinity, so future should run to completion.
        rpc._set_rpc_timeout(0)
        assert rpc.get_rpc_timeout() == 0
        rpc.rpc_async(dst, h.my_sleep_func, args=(0.05,)).wait()

        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)
        assert rpc.get_rpc_timeout() == rpc.DEFAULT_RPC_TIMEOUT

    def test_rpc_timeouts(self):
        dst_worker = self._next()
        timeout = 0.1  # 100 ms
        fut = rpc.rpc_async(dst_worker, h.my_sleep_func, args=(0.5,), timeout=timeout)
        with pytest.raises(TimeoutError, match=r"after 0\.1 s"):
            fut.wait()
        rpc.rpc_async(dst_worker, h.my_sleep_func, args=(0.2,)).wait()

        with pytest.raises(TimeoutError):
            rpc.rpc_sync(dst_worker, h.my_sleep_func, args=(0.5,), timeout=timeout)
        rpc.rpc_sync(dst_worker, h.my_sleep_func, args=(0.2,))

        # the default, overridden per call
        rpc.set_rpc_timeout(0.001)
        fut = rpc.rpc_async(dst_worker, h.my_sleep_func, args=(0.5,))
        with pytest.raises(TimeoutError):
            fut.wait()
        with pytest.raises(TimeoutError):
            rpc.rpc_sync(dst_worker, h.my_sleep_func, args=(0.5,))
        rpc.rpc_async(dst_worker, h.my_sleep_func, args=(0.05,), timeout=5).wait()
        rpc.rpc_sync(dst_worker, h.my_sleep_func, args=(0.05,), timeout=5)
        # a zero timeout is none
        rpc.rpc_async(dst_worker, h.my_sleep_func, args=(0.05,), timeout=0).wait()
        rpc.rpc_sync(dst_worker, h.my_sleep_func, args=(0.05,), timeout=0)
        rpc._set_rpc_timeout(rpc.DEFAULT_RPC_TIMEOUT)

    def _test_remote_message_delay_timeout(self, func, args, dst):
        # FaultyAgentRpcTest's, with a slow function for the faulty agent's delay
        rref = rpc.remote(dst, func, args=args, timeout=0.001)
        with pytest.raises(TimeoutError):
            rref.to_here()
        if dst != worker_name(self.rank):
            slow_rref = rpc.remote(dst, func, args=args, timeout=2)
            with pytest.raises(TimeoutError):
                slow_rref.to_here(0.001)
            slow_rref.to_here()  # and the value comes

    def test_udf_remote_message_delay_timeout(self):
        self._test_remote_message_delay_timeout(h.my_sleep_func, (0.5,), self._next())

    def test_udf_remote_message_delay_timeout_to_self(self):
        self._test_remote_message_delay_timeout(h.my_sleep_func, (0.5,), worker_name(self.rank))

    def test_remote_message_dropped_pickle(self):
        # FaultyAgentRpcTest's, with a creation call that times out for the
        # faulty agent's dropped message
        rref = rpc.remote(self._next(), h.my_sleep_func, args=(0.5,), timeout=0.01)
        with pytest.raises(TimeoutError):
            rref.to_here()
        assert rref.confirmed_by_owner() is False
        # using it as an argument (a fork in torch's words) fails at once
        with pytest.raises(RuntimeError, match="cannot be sent"):
            rpc.rpc_async(self._next(2), h.check_rref_confirmed, args=(rref,), timeout=5)
        with pytest.raises(RuntimeError, match="cannot be sent"):
            pickle.dumps(rref)

    def test_rref_to_here_timeout(self):
        rref = rpc.remote(self._next(), h.delayed_add, args=(1, 1, 0.5))
        with pytest.raises(TimeoutError):
            rref.to_here(0.01)
        assert rref.to_here() == 2

    def test_rref_proxy_timeout(self):
        for rpc_api in ["rpc_sync", "rpc_async", "remote"]:
            self._test_rref_proxy_timeout(rpc_api)

    def _test_rref_proxy_timeout(self, rref_proxy_api):
        dst = self._next()
        rref = rpc.remote(dst, MyClass, args=(np.ones((2, 2)),))
        rref.to_here()
        rref_api = getattr(rref, rref_proxy_api)
        with pytest.raises(TimeoutError):
            result = rref_api(timeout=0.2).my_slow_method(np.ones((2, 2)))
            if rref_proxy_api == "rpc_async":
                result.wait()
            elif rref_proxy_api == "remote":
                result.to_here()

        # The value is still being made when the timeout passes. torch's proxy
        # call raises at once (it fetches the value's type first); aiopar's
        # returns at once, and its result fails. For remote(), the timeout
        # bounds the call that starts the method, which waits on the owner
        # for the value, as remote() of an async_execution function does:
        # the result RRef's use times out instead.
        slow_rref = rpc.remote(dst, MyClass, args=(np.ones((2, 2)), True))
        rref_api = getattr(slow_rref, rref_proxy_api)
        with pytest.raises(TimeoutError):
            result = rref_api(timeout=0.01).my_instance_method(np.ones((2, 2)))
            if rref_proxy_api == "rpc_async":
                result.wait()
            elif rref_proxy_api == "remote":
                result.to_here(timeout=0.01)
        slow_rref.to_here()

    # -- futures and callbacks ---------------------------------------------------------

    def test_wait_all_exit_early_python(self):
        rpc.rpc_sync(self._next(), h.reset_timed_out_rpc)
        fut1 = rpc.rpc_async(self._next(), h.timed_out_rpc)
        fut2 = rpc.rpc_async(self._next(), h.raise_func)
        fut3 = rpc.rpc_async(self._next(), h.raise_func)
        try:
            with pytest.raises(ValueError, match=expected_err):
                aiopar.wait_all([fut1, fut2, fut3])
            assert not fut1.done()
        finally:
            rpc.rpc_sync(self._next(), h.release_timed_out_rpc)
        fut1.wait()
        retrieve_failures([fut2, fut3])

    def test_wait_all_exit_early_builtin(self):
        rpc.rpc_sync(self._next(), h.reset_timed_out_rpc)
        fut1 = rpc.rpc_async(self._next(), h.timed_out_rpc)
        fut2 = rpc.rpc_async(self._next(), np.add, args=(np.ones(10), np.ones(5)))
        fut3 = rpc.rpc_async(self._next(), np.add, args=(np.ones(10), np.ones(5)))
        try:
            # numpy's ValueError (torch: RuntimeError "size of tensor")
            with pytest.raises(ValueError, match="could not be broadcast"):
                aiopar.wait_all([fut1, fut2, fut3])
            assert not fut1.done()
        finally:
            rpc.rpc_sync(self._next(), h.release_timed_out_rpc)
        fut1.wait()
        retrieve_failures([fut2, fut3])

    def test_wait_all_with_exception(self):
        futs = [rpc.rpc_async(self._next(), h.raise_func) for _ in range(10)]
        with pytest.raises(ValueError, match="Expected error"):
            aiopar.wait_all(futs)
        retrieve_failures(futs)

    def test_wait_all_with_partial_exception(self):
        futs = [rpc.rpc_async(self._next(), np.add, args=(np.ones(2), 1)) for _ in range(10)]
        futs.append(rpc.rpc_async(self._next(), h.raise_func))
        with pytest.raises(ValueError, match="Expected error"):
            aiopar.wait_all(futs)
        retrieve_failures(futs)

    def test_callback_simple(self):
        set_by_cb = aiopar.Future()
        n = self.rank + 1

        def callback(fut):
            ret = fut.wait()
            assert_equal(ret, np.ones((n, n)) * 2)
            set_by_cb.set_result(ret.copy() + 1)

        fut = rpc.rpc_async(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        fut.then(callback)
        assert_equal(fut.wait(), np.ones((n, n)) * 2)
        assert_equal(set_by_cb.wait(timeout=10), np.ones((n, n)) * 2 + 1)
        assert_equal(fut.wait(), np.ones((n, n)) * 2)

    def test_callback_wrong_arg_num(self):
        n = self.rank + 1
        fut = rpc.rpc_async(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        cb_fut = fut.then(my_function)
        assert_equal(fut.wait(), np.ones((n, n)) * 2)
        # aiopar: the callback's own TypeError (torch: RuntimeError)
        with pytest.raises(TypeError, match=r"my_function\(\) missing 2 required positional"):
            cb_fut.wait()

    def test_callback_wrong_arg_type(self):
        fut0 = rpc.rpc_async(self._next(), np.add, args=(np.ones((2, 2)), 1))
        fut1 = fut0.then(lambda x: x + 1)
        with pytest.raises(TypeError, match=r"unsupported operand type\(s\) for \+"):
            fut1.wait()

    def test_callback_multi(self):
        num_cbs = 10
        n = self.rank + 1

        def callback(idx, fut):
            ret = fut.wait()
            assert_equal(ret, np.ones((n, n)) * 2)
            return ret + idx

        fut = rpc.rpc_async(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        cb_futs = [fut.then(partial(callback, idx)) for idx in range(num_cbs)]
        assert_equal(fut.wait(), np.ones((n, n)) * 2)
        for idx in range(num_cbs):
            assert_equal(cb_futs[idx].wait(), np.ones((n, n)) * 2 + idx)
        assert_equal(fut.wait(), np.ones((n, n)) * 2)

    def test_callback_chain(self):
        n = self.rank + 1
        fut = rpc.rpc_async(self._next(), np.add, args=(np.ones((n, n)), 1))
        num_cbs = 20
        for _ in range(num_cbs):
            fut = fut.then(lambda fut: fut.wait() + 1)
        assert_equal(fut.wait(), np.ones((n, n)) + 1 + num_cbs)

    def test_callback_in_rpc(self):
        ret = rpc.rpc_sync(
            self._next(1), h.add_use_future_cb, args=(self._next(2), np.ones((2, 2)), 1, 2)
        )
        assert_equal(ret, np.ones((2, 2)) + 1 + 2)

    def test_callback_with_ret(self):
        dst = self._next()

        def callback(fut0):
            fut2 = rpc.rpc_async(dst, np.add, args=(fut0.wait(), 1)).then(
                lambda fut1: fut1.wait() + 1
            )
            return fut2.wait()

        fut3 = rpc.rpc_async(dst, np.add, args=(np.ones((2, 2)), 1)).then(callback)
        assert_equal(fut3.wait(), np.ones((2, 2)) + 3)

    def test_callback_with_error(self):
        seen = []

        def callback(fut0):
            try:
                fut0.wait()
            except ValueError as exc:
                seen.append(str(exc))
            raise RuntimeError("Another expected error")

        fut1 = rpc.rpc_async(self._next(), h.raise_func).then(callback)
        with pytest.raises(RuntimeError, match="Another expected error"):
            fut1.wait()
        assert seen == ["Expected error"]

    def test_callback_none(self):
        fut = rpc.rpc_async(self._next(), h.raise_func)
        with pytest.raises(TypeError, match="then"):
            fut.then(None)
        retrieve_failures([fut])

    def test_add_done_callback(self):
        set_by_cb = False
        n = self.rank + 1

        def callback(fut):
            nonlocal set_by_cb
            fut.wait()
            set_by_cb = True

        fut = rpc.rpc_async(self._next(), np.add, args=(np.ones((n, n)), np.ones((n, n))))
        fut.add_done_callback(callback)
        fut_then = fut.then(lambda _: True)
        assert_equal(fut.wait(), np.ones((n, n)) * 2)
        fut_then.wait()
        assert set_by_cb
        assert_equal(fut.wait(), np.ones((n, n)) * 2)

    def test_mark_future_twice(self):
        fut = rpc.rpc_async(self._next(), np.add, args=(np.zeros((2, 2)), 1))
        assert_equal(fut.wait(), np.zeros((2, 2)) + 1)
        # aiopar: InvalidStateError, a RuntimeError
        with pytest.raises(RuntimeError, match="settled only once"):
            fut.set_result(1)

    def test_pickle_future(self):
        # aiopar: TypeError, raised at once by each call (torch: RuntimeError)
        fut = aiopar.Future()
        err = "an aiopar.Future cannot be pickled"
        dst = self._next()
        with pytest.raises(TypeError, match=re.escape(err)):
            rpc.rpc_sync(dst, h.fail_on_fut, args=(fut,))
        with pytest.raises(TypeError, match=re.escape(err)):
            rpc.rpc_async(dst, h.fail_on_fut, args=(fut,))
        with pytest.raises(TypeError, match=re.escape(err)):
            rpc.remote(dst, h.fail_on_fut, args=(fut,))

    def test_future_done(self):
        fut = rpc.rpc_async(self._next(), np.add, args=(np.zeros(2), 1))
        fut.wait()
        assert fut.done()

    def test_future_done_exception(self):
        fut = rpc.rpc_async(self._next(), h.raise_func)
        with pytest.raises(ValueError, match="Expected error"):
            fut.wait()
        assert fut.done()

    def _test_future_cb(self, func):
        ret = rpc.rpc_sync(self._next(1), func, args=(self._next(2), np.ones((2, 2)), 1, 2))
        assert_equal(ret, np.ones((2, 2)) + 1 + 2)

    def test_future_in_rpc(self):
        self._test_future_cb(h.add_use_future_set_result)

    def test_future_nested_callback(self):
        self._test_future_cb(h.add_use_future_nested_cb)

    # -- async_execution -----------------------------------------------------------------

    @pytest.mark.parametrize("mode", ["sync", "async", "remote"])
    def test_async_function_raise(self, mode):
        with pytest.raises(RuntimeError, match="Expected error"):
            self._run_func_in_mode(self._next(), h.async_raise_func, mode)

    @pytest.mark.parametrize("mode", ["sync", "async", "remote"])
    def test_async_function_wrong_return_type(self, mode):
        # aiopar: TypeError (torch: RuntimeError)
        with pytest.raises(TypeError, match=r"must return an aiopar\.Future, but it returned"):
            self._run_func_in_mode(self._next(), h.async_wrong_type, mode)

    def test_async_function_simple(self):
        ret = rpc.rpc_sync(self._next(1), h.async_add, args=(self._next(2), np.ones((2, 2)), 1))
        assert_equal(ret, np.ones((2, 2)) + 1)

    def _test_async_function(self, fn, mode="sync"):
        args = (self._next(2), np.ones((2, 2)), 1, 2)
        ret = self._run_func_in_mode(self._next(1), fn, mode, args=args)
        assert_equal(ret, np.ones((2, 2)) + 3)

    @pytest.mark.parametrize("mode", ["sync", "remote"])
    def test_async_function_with_future_ctor(self, mode):
        self._test_async_function(h.async_add_with_future_ctor, mode)

    @pytest.mark.parametrize("mode", ["sync", "remote"])
    def test_async_function_chained(self, mode):
        self._test_async_function(h.async_add_chained, mode)

    @pytest.mark.parametrize("mode", ["sync", "remote"])
    def test_async_function_nested(self, mode):
        self._test_async_function(h.async_add_nested, mode)

    @pytest.mark.parametrize("mode", ["sync", "remote"])
    def test_async_static_method(self, mode):
        self._test_async_function(h.AsyncExecutionClass.static_async_add, mode)

    @pytest.mark.parametrize("mode", ["sync", "remote"])
    def test_async_class_method(self, mode):
        self._test_async_function(h.AsyncExecutionClass.class_async_add, mode)

    @pytest.mark.parametrize("mode", ["sync", "async", "remote"])
    def test_async_class_rref_proxy(self, mode):
        rref = rpc.remote(self._next(1), h.AsyncExecutionClass)
        dst2 = self._next(2)
        x = np.ones((2, 2))
        y = np.ones((2, 2)) + 1
        if mode == "sync":
            ret = rref.rpc_sync().static_async_add(dst2, x, x, y)
            ret += rref.rpc_sync().class_async_add(dst2, x, x, y)
            ret += rref.rpc_sync().bound_async_add(dst2, x, x, y)
        elif mode == "async":
            ret = rref.rpc_async().static_async_add(dst2, x, x, y).wait()
            ret += rref.rpc_async().class_async_add(dst2, x, x, y).wait()
            ret += rref.rpc_async().bound_async_add(dst2, x, x, y).wait()
        else:
            ret = rref.remote().static_async_add(dst2, x, x, y).to_here()
            ret += rref.remote().class_async_add(dst2, x, x, y).to_here()
            ret += rref.remote().bound_async_add(dst2, x, x, y).to_here()
        assert_equal(ret, 3 * 4 * x)

    def _test_async_function_multi(self, fn, mode="sync"):
        num, step = 20, 3
        args = (self._next(2), np.ones((2, 2)), num, step)
        ret = self._run_func_in_mode(self._next(1), fn, mode, args=args)
        assert_equal(ret, np.ones((2, 2)) + num * step)

    @pytest.mark.parametrize("mode", ["sync", "async", "remote"])
    def test_async_function_multi_chained(self, mode):
        self._test_async_function_multi(h.async_add_chained_multi, mode)

    @pytest.mark.parametrize("mode", ["sync", "async", "remote"])
    def test_async_function_multi_fanout(self, mode):
        self._test_async_function_multi(h.async_add_multi_fanout, mode)

    @pytest.mark.parametrize("mode", ["sync", "async", "remote"])
    def test_return_future(self, mode):
        # aiopar: TypeError from the callee (torch: RuntimeError "Can not pickle")
        with pytest.raises(TypeError, match=r"returned an aiopar\.Future"):
            self._run_func_in_mode(self._next(), h.return_future, mode)
