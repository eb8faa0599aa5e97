"""The "openmp" backend: one task at a time, in fork order, with every intra-op thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from budget_helpers import once_alone
from threadpoolctl import threadpool_info

import aiopar
from aiopar import _budget_slots
from aiopar._budget import budget, cores
from aiopar.backends.openmp import OpenMPBackend
from aiopar.nn import LSTMEnsemble

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("automatic_budget")]


@pytest.fixture
def lane():
    """A fresh openmp backend, whose lane threads must be gone after shutdown."""
    backend = OpenMPBackend()
    yield backend
    backend.shutdown(wait=True)
    names = backend._thread_names + "-"
    assert not [t for t in threading.enumerate() if t.name.startswith(names)]


def test_it_is_a_builtin():
    assert "openmp" in aiopar.available_backends()
    assert isinstance(aiopar.get_backend("openmp"), OpenMPBackend)


def test_tasks_run_one_at_a_time_in_fork_order_on_the_lane(lane):
    order, running, overlaps = [], [0], []
    lock = threading.Lock()

    def task(i):
        with lock:
            running[0] += 1
            overlaps.append(running[0])
        time.sleep(0.002)
        with lock:
            order.append(i)
            running[0] -= 1
        return threading.current_thread().name

    futures = [lane.fork(task, i) for i in range(20)]
    names = aiopar.wait_all(futures)  # the waiter never runs a lane task itself
    assert order == list(range(20))
    assert max(overlaps) == 1
    assert {name.rsplit("-", 1)[0] for name in names} == {lane._thread_names}
    assert names[0].startswith("aiopar-openmp-")


def test_each_task_gets_every_intra_op_thread(lane):
    def counts():
        blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
        return aiopar.get_num_threads(), blas

    n, blas = lane.fork(once_alone(counts)).wait()
    assert n == cores() and blas == [cores()] * len(blas)


def test_a_task_gets_every_intra_op_thread_while_its_forker_goes_on(lane):
    # The forker computed beside its fork (it slept, then waited), and the
    # task got a share as on the thread backend: 1 of 2 threads.
    seen = []
    checked = threading.Event()

    def counts():
        blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
        seen.append((aiopar.get_num_threads(), blas))
        checked.set()

    # As a thread that slept after its fork: rule 3 takes it to compute beside it.
    _budget_slots.this_thread().anticipates = True
    fut = lane.fork(counts)
    assert checked.wait(10)  # not aiopar's wait: this thread is busy meanwhile
    fut.wait(timeout=10)
    assert seen == [(cores(), [cores()] * len(seen[0][1]))]


def test_parallel_for_inside_a_task_uses_the_helpers(lane):
    threads = set()
    both = threading.Barrier(2, timeout=10)  # the two chunks run at once

    def fn(b, e):
        threads.add(threading.get_ident())
        both.wait()

    aiopar.set_num_threads(2)
    lane.fork(aiopar.parallel_for, 0, 2, 1, fn).wait()
    assert len(threads) == 2


def test_results_match_the_thread_backend(lane):
    rng = np.random.default_rng(0)
    mats = [rng.standard_normal((64, 64)) for _ in range(6)]

    def work(a):
        return np.tanh(a @ a.T).sum(axis=0)

    on_lane = aiopar.wait_all([lane.fork(work, m) for m in mats])
    on_threads = aiopar.wait_all([aiopar.get_backend("thread").fork(work, m) for m in mats])
    for a, b in zip(on_lane, on_threads, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_lstm_ensemble_gives_the_same_output():
    ens = LSTMEnsemble(3, 16, 16, seed=0)
    x = np.random.default_rng(1).standard_normal((5, 2, 16), dtype=np.float32)
    with aiopar.use_backend("thread"):
        expected = ens(x)
    with aiopar.use_backend("openmp"):
        np.testing.assert_allclose(ens(x), expected, rtol=1e-6, atol=1e-6)


def test_fork_and_wait_inside_a_lane_task_does_not_deadlock(lane):
    def depth(n):
        if n == 0:
            return 0
        return lane.fork(depth, n - 1).wait() + 1  # the lane runs the inner task itself

    assert lane.fork(depth, 30).wait(timeout=20) == 30


def test_a_lane_task_blocked_in_wait_hands_the_queue_to_a_stand_in(lane):
    def outer():
        inner = lane.fork(lambda: "inner")
        return inner.wait(timeout=10)  # with a timeout the lane does not run it itself

    assert lane.fork(outer).wait(timeout=20) == "inner"


def test_errors_reach_the_waiter_and_the_budget_recovers(lane):
    def fail():
        raise ValueError("lane task failed")

    with pytest.raises(ValueError, match="lane task failed"):
        lane.fork(fail).wait()
    assert lane.fork(aiopar.get_num_threads).wait() == cores()
    deadline = time.monotonic() + 5
    while budget.running and time.monotonic() < deadline:
        time.sleep(0.001)
    assert budget.running == 0
