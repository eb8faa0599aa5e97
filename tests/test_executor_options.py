"""aiopar.Executor with concurrent.futures' constructor arguments, and what
code written for ProcessPoolExecutor brings with it: a failing initializer
breaks the pool, multiprocessing's objects reach the workers, a dead worker
is a BrokenProcessPool, and dask takes the Executor as its pool.

The functions the process workers run are this module's, imported there by
name."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import logging.handlers
import multiprocessing
import os
import pickle
import queue
import sys
import threading
import weakref
from concurrent.futures.process import BrokenProcessPool
from concurrent.futures.thread import BrokenThreadPool

import pytest

import aiopar

pytestmark = pytest.mark.timeout(120)

LIMIT = 60  # every wait is bounded: a regression fails, it never hangs

STATUS = "uninitialized"


def init(status: str) -> None:
    global STATUS
    STATUS = status


def status() -> tuple[str, int]:
    return STATUS, os.getpid()


def init_fail(log_queue: multiprocessing.Queue | None = None) -> None:  # type: ignore[type-arg]
    if log_queue is not None:  # the worker's records go to the test
        logger = logging.getLogger("concurrent.futures")
        logger.addHandler(logging.handlers.QueueHandler(log_queue))
        logger.propagate = False
    raise ValueError("error in initializer")


def put(q: queue.Queue[int], lock: threading.Lock, value: int) -> None:
    with lock:
        q.put(value)


def put_item(shared: dict[str, int], key: str) -> int:
    shared[key] = len(key)
    return len(shared)


def die() -> None:
    os._exit(3)


class ExitsWhenUnpickled:
    def __reduce__(self) -> tuple[object, tuple[int]]:
        return sys.exit, (1,)


# -- threads ---------------------------------------------------------------


def test_thread_name_prefix_initializer_and_initargs_set_each_worker_up():
    started: list[tuple[str, str]] = []

    def record(word: str) -> None:
        started.append((word, threading.current_thread().name))

    release = threading.Barrier(3, timeout=LIMIT)
    with aiopar.Executor(
        "thread", 2, thread_name_prefix="crunch", initializer=record, initargs=("hello",)
    ) as executor:
        futures = [executor.submit(release.wait) for _ in range(2)]
        release.wait()  # two calls run at once: on two workers
        for future in futures:
            future.result(LIMIT)
        assert executor._max_workers == 2
    assert sorted(started) == [("hello", "crunch_0"), ("hello", "crunch_1")]


def test_a_failing_initializer_breaks_the_thread_pool():
    def boom() -> None:
        raise ValueError("error in initializer")

    executor = aiopar.Executor("thread", 2, initializer=boom)
    pending = executor.submit(pow, 2, 3)
    with pytest.raises(BrokenThreadPool, match="error in initializer"):
        pending.result(LIMIT)
    with pytest.raises(BrokenThreadPool):
        executor.submit(pow, 2, 3)
    executor.shutdown()


def test_an_executor_with_worker_options_has_a_pool_of_its_own_that_shutdown_stops():
    shared = aiopar.Executor("thread", 2)
    own = aiopar.Executor("thread", 2, thread_name_prefix="own")
    assert shared.backend is aiopar.get_backend("thread", max_workers=2)
    assert own.backend is not shared.backend
    shared.shutdown()
    own.shutdown()
    assert not shared.backend.closed and own.backend.closed


def test_options_a_backend_lacks_are_refused_naming_them():
    with pytest.raises(TypeError, match=r"'thread' backend does not take it.*max_tasks_per_child"):
        aiopar.Executor("thread", max_tasks_per_child=3)
    with pytest.raises(TypeError, match=r"'process' backend does not take it.*thread_name_prefix"):
        aiopar.Executor("process", thread_name_prefix="x")
    with pytest.raises(TypeError, match=r"initializer=...\): initializer go with a backend name"):
        aiopar.Executor(aiopar.get_backend("thread"), initializer=print)
    with pytest.raises(ValueError, match="mp_context must be None or a multiprocessing context"):
        aiopar.Executor("process", mp_context="spawn")


# -- processes -------------------------------------------------------------


@pytest.mark.parametrize("method", ["spawn", "forkserver", "fork"])
def test_the_initializer_runs_in_each_worker_process_under_any_start_method(method):
    with aiopar.Executor(
        "process",
        2,
        mp_context=multiprocessing.get_context(method),
        initializer=init,
        initargs=("initialized",),
    ) as executor:
        outcomes = [executor.submit(status).result(LIMIT) for _ in range(4)]
        assert executor._max_workers == 2
    assert {word for word, _ in outcomes} == {"initialized"}
    assert os.getpid() not in {pid for _, pid in outcomes}  # fresh interpreters, as spawn


def test_a_failing_initializer_fails_the_calls_with_a_broken_process_pool_and_logs_why():
    context = multiprocessing.get_context("spawn")
    log_queue = context.Queue()  # multiprocessing's queue reaches the worker, as initargs
    executor = aiopar.Executor(
        "process", 2, mp_context=context, initializer=init_fail, initargs=(log_queue,)
    )
    with pytest.raises(BrokenProcessPool, match="as a worker does whose initializer raised"):
        executor.submit(status).result(LIMIT)
    record = log_queue.get(timeout=LIMIT)
    assert "ValueError: error in initializer" in record.getMessage() + str(record.exc_text)
    executor.shutdown()


def test_the_first_failing_initializer_breaks_the_process_pool():
    # Calls failed only once three workers in a row had died at start, and
    # later calls started new workers.
    executor = aiopar.Executor("process", 2, initializer=init_fail)
    futures = [executor.submit(status) for _ in range(4)]
    for fut in futures:
        with pytest.raises(BrokenProcessPool, match="initializer of a worker process raised"):
            fut.result(LIMIT)
    with pytest.raises(BrokenProcessPool, match=r"is broken: the initializer .* raised"):
        executor.submit(status)
    assert next(executor.backend._pool._worker_index) <= 2  # none started after the break
    executor.shutdown()


def test_a_shut_down_process_pool_lets_go_of_its_initargs():
    # The pool kept them for its life: a multiprocessing queue's semaphores
    # outlived the shutdown (CPython's FailingInitializerResourcesTest saw
    # them leaked). Without the collector, which a cycle would need.
    context = multiprocessing.get_context("spawn")
    log_queue = context.Queue()
    gone = weakref.ref(log_queue)
    executor = aiopar.Executor(
        "process", 2, mp_context=context, initializer=init_fail, initargs=(log_queue,)
    )
    del log_queue
    gc.disable()
    try:
        with pytest.raises(BrokenProcessPool):
            executor.submit(status).result(LIMIT)
        with pytest.raises(BrokenProcessPool):
            executor.submit(status)  # a task made and refused: it refers to the pool
        executor.shutdown()
        assert gone() is None
    finally:
        gc.enable()


def test_initargs_carry_multiprocessing_locks_and_queues_to_the_workers():
    context = multiprocessing.get_context("spawn")
    results, lock = context.Queue(), context.Lock()
    with aiopar.Executor(
        "process", 1, mp_context=context, initializer=put, initargs=(results, lock, 7)
    ) as executor:
        executor.submit(status).result(LIMIT)
    assert results.get(timeout=LIMIT) == 7


@pytest.mark.parametrize(
    "initargs",
    [(threading.Lock(),), (multiprocessing.get_context("fork").Lock(),)],
    ids=["a thread lock", "a lock of the fork context"],
)
def test_initargs_that_cannot_reach_a_worker_are_refused_at_once(initargs):
    # They failed every task of the pool, in its manager thread, instead.
    with pytest.raises(TypeError, match=r"cannot send the initializer .* to a worker process"):
        aiopar.Executor("process", 1, initializer=print, initargs=initargs)


def test_a_manager_s_proxies_work_in_process_tasks():
    # The workers share this process's authkey, as multiprocessing's children
    # do: without it the manager refused them ("digest sent was rejected").
    with multiprocessing.Manager() as manager, aiopar.Executor("process", 1) as executor:
        shared = manager.dict()
        assert executor.submit(put_item, shared, "abc").result(LIMIT) == 1
        assert dict(shared) == {"abc": 3}


def test_a_dead_worker_is_a_broken_process_pool_and_an_aiopar_error():
    with aiopar.Executor("process", 1) as executor:
        with pytest.raises(BrokenProcessPool) as caught:
            executor.submit(die).result(LIMIT)
        assert isinstance(caught.value, aiopar.BrokenWorkerError)
        assert isinstance(caught.value, concurrent.futures.BrokenExecutor)
        assert executor.submit(pow, 2, 3).result(LIMIT) == 8  # a new worker replaced it


def test_an_argument_that_exits_as_it_is_unpickled_fails_its_call_and_never_exits_the_caller():
    # The SystemExit raised in the worker was raised again by result().
    with aiopar.Executor("process", 1) as executor:
        with pytest.raises(pickle.UnpicklingError, match="unpickling the task raised SystemExit"):
            executor.submit(id, ExitsWhenUnpickled()).result(LIMIT)
        assert executor.submit(pow, 2, 3).result(LIMIT) == 8


def test_max_tasks_per_child_replaces_a_worker_after_that_many_calls():
    with aiopar.Executor("process", 1, max_tasks_per_child=2) as executor:
        pids = [executor.submit(os.getpid).result(LIMIT) for _ in range(4)]
    assert pids[0] == pids[1] != pids[2] == pids[3]


# -- dask ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "scheduler"), [("thread", "threads"), ("process", "processes")]
)
def test_dask_takes_an_executor_as_its_pool(backend, scheduler):
    bag = pytest.importorskip("dask.bag")
    import dask

    with aiopar.Executor(backend, 2) as executor, dask.config.set(pool=executor):
        total = bag.from_sequence(range(10), npartitions=4).map(abs).sum()
        assert total.compute(scheduler=scheduler) == 45
