"""fork/wait on the thread and inline backends, and the functions that combine futures."""

from __future__ import annotations

import contextvars
import functools
import threading
import time

import pytest
from future_helpers import fork_running_until_waited_on

import aiopar
from aiopar import CancelledError, Future


def double(x: int) -> int:
    return 2 * x


class Scaler:
    def __init__(self, k: int) -> None:
        self.k = k

    def __call__(self, x: int) -> int:
        return self.k * x

    def scale(self, x: int) -> int:
        return self.k * x


@pytest.fixture(params=["thread", "inline"])
def backend(request):
    with aiopar.use_backend(request.param) as b:
        yield b


def test_fork_runs_any_callable(backend):
    assert aiopar.wait(aiopar.fork(double, 4)) == 8
    assert aiopar.fork(lambda: "lam").wait() == "lam"
    assert aiopar.fork(Scaler(3), 2).wait() == 6
    assert aiopar.fork(Scaler(5).scale, 2).wait() == 10
    assert aiopar.fork(functools.partial(double, 7)).wait() == 14


def test_every_keyword_goes_to_the_function(backend):
    def kw(*, backend: str, timeout: int, fn: str) -> tuple[str, int, str]:
        return backend, timeout, fn

    assert aiopar.fork(kw, backend="b", timeout=3, fn="f").wait() == ("b", 3, "f")


def test_fork_returns_at_once():
    gate = threading.Event()
    start = time.monotonic()
    fut = aiopar.fork(gate.wait, 5)
    assert time.monotonic() - start < 1
    gate.set()
    assert fut.wait() is True


def test_fork_of_non_callable_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"callable.*fork\(f, x\), not fork\(f\(x\)\)"):
        aiopar.fork(3)  # type: ignore[arg-type]


def test_wait_of_non_future_is_a_clear_type_error():
    with pytest.raises(TypeError, match=r"aiopar Future.*wrap"):
        aiopar.wait(3)  # type: ignore[arg-type]


def test_worker_exception_keeps_type_and_message(backend):
    def fail():
        raise ValueError("bad value in worker")

    with pytest.raises(ValueError, match="bad value in worker"):
        aiopar.fork(fail).wait()


def test_recursion_64_deep_on_two_workers():
    def depth(n: int) -> int:
        return 0 if n == 0 else 1 + aiopar.fork(depth, n - 1).wait()

    with aiopar.use_backend("thread", max_workers=2):
        assert aiopar.fork(depth, 64).wait(timeout=60) == 64


def test_fork_tree_depth_8_on_two_workers():
    def tree(depth: int) -> int:
        if depth == 0:
            return 1
        left = aiopar.fork(tree, depth - 1)
        right = aiopar.fork(tree, depth - 1)
        return left.wait() + right.wait()

    with aiopar.use_backend("thread", max_workers=2):
        assert aiopar.fork(tree, 8).wait(timeout=60) == 256


def test_blocked_worker_is_compensated_and_pool_shrinks_back():
    backend = aiopar.get_backend("thread", max_workers=2)
    release = threading.Event()
    started = threading.Barrier(3)

    def blocker():
        started.wait()
        release.wait()
        return "done"

    def waiter_on_running(fut):
        started.wait()
        return fut.wait()  # fut is running elsewhere: this worker blocks

    running = backend.fork(blocker)
    waiting = backend.fork(waiter_on_running, running)
    started.wait(timeout=5)
    # Both workers are busy, one of them blocked in wait: new work still runs.
    assert backend.fork(lambda: "extra").wait(timeout=5) == "extra"
    release.set()
    assert waiting.wait(timeout=5) == "done"


def test_cancel_before_start_means_never_runs():
    ran = []
    gate = threading.Event()
    with aiopar.use_backend("thread", max_workers=1):
        busy = aiopar.fork(gate.wait, 5)
        queued = aiopar.fork(ran.append, "ran")
        assert queued.cancel() is True
        assert queued.cancelled()
        gate.set()
        busy.wait()
        aiopar.fork(lambda: None).wait()  # the worker has gone past the cancelled task
    assert ran == []
    with pytest.raises(CancelledError):
        queued.wait()


def test_cancel_running_or_finished_is_false():
    started = threading.Event()
    gate = threading.Event()

    def task():
        started.set()
        gate.wait(5)
        return 1

    fut = aiopar.fork(task)
    assert started.wait(5)
    assert fut.cancel() is False
    gate.set()
    assert fut.wait() == 1
    assert fut.cancel() is False


def test_wait_on_started_task_blocks_until_done():
    fut = fork_running_until_waited_on(then_sleep=0.01)
    assert fut.wait() is None
    assert fut.done()


def test_then_on_forked_future(backend):
    assert aiopar.fork(double, 5).then(lambda f: f.value() + 1).wait() == 11


def test_collect_all_never_fails():
    def fail():
        raise KeyError("x")

    futs = [aiopar.fork(double, 1), aiopar.fork(fail)]
    collected = aiopar.collect_all(futs).wait()
    assert collected == futs
    assert collected[0].value() == 2
    assert isinstance(collected[1].exception(), KeyError)
    assert aiopar.collect_all([]).wait() == []


def test_wait_all_values_in_order():
    futs = [aiopar.fork(double, i) for i in range(50)]
    assert aiopar.wait_all(futs) == [2 * i for i in range(50)]
    assert aiopar.wait_all([]) == []


def test_wait_all_raises_first_failure_without_waiting_for_running_ones():
    gate = threading.Event()
    running = threading.Event()

    def fail():
        raise RuntimeError("early failure")

    def slow_task():
        running.set()
        gate.wait(30)

    with aiopar.use_backend("thread", max_workers=2):
        slow = aiopar.fork(slow_task)
        assert running.wait(5)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="early failure"):
            aiopar.wait_all([slow, aiopar.fork(fail)])
        assert time.monotonic() - started < 10
        gate.set()


def test_combinators_reject_non_futures():
    for combine in (aiopar.collect_all, aiopar.wait_all, aiopar.as_completed):
        with pytest.raises(TypeError, match="aiopar Future"):
            combine([1, 2])
        with pytest.raises(TypeError, match="iterable"):
            combine(Future())


def test_as_completed_yields_in_completion_order():
    gates = [threading.Event() for _ in range(3)]
    with aiopar.use_backend("thread", max_workers=3):
        futs = [aiopar.fork(lambda g=g, i=i: (g.wait(5), i)[1]) for i, g in enumerate(gates)]
        order = []
        iterator = aiopar.as_completed([*futs, futs[0]])  # duplicates come once
        for i in (2, 0, 1):
            gates[i].set()
            fut = next(iterator)
            assert fut.done()
            order.append(fut.value())
        assert order == [2, 0, 1]
        with pytest.raises(StopIteration):
            next(iterator)


def test_as_completed_timeout():
    fut: Future[int] = Future()
    with pytest.raises(TimeoutError, match="1 of 1 futures"):
        list(aiopar.as_completed([fut], timeout=0.05))
    with pytest.raises(ValueError, match="timeout"):
        aiopar.as_completed([fut], timeout=-1)


def test_task_group_waits_for_all():
    results = []
    with aiopar.task_group() as tg:
        for i in range(10):
            tg.fork(lambda i=i: (time.sleep(0.001), results.append(i)))
    assert sorted(results) == list(range(10))


def test_task_group_first_failure_cancels_unstarted_and_is_raised():
    ran = []
    started, gate = threading.Event(), threading.Event()

    def fail():
        started.set()
        gate.wait(5)
        raise ValueError("first")

    with (
        aiopar.use_backend("thread", max_workers=1),
        pytest.raises(ValueError, match="first"),
        aiopar.task_group() as tg,
    ):
        tg.fork(fail)
        later = [tg.fork(ran.append, i) for i in range(5)]
        # The pool's one worker runs it: this thread, which would otherwise run
        # it itself as it waits, leaves the others queued behind it.
        assert started.wait(5)
        gate.set()
    assert ran == []
    assert all(f.cancelled() for f in later)


def test_task_group_exit_runs_no_task_a_failure_cancels(monkeypatch):
    # A future's waiters wake before its callbacks run: the group's waiting
    # thread must not run the next unstarted task before the worker that
    # settled the failure has cancelled it.
    on_done = aiopar.TaskGroup._on_done

    def late_on_done(self, fut):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.2)
        on_done(self, fut)

    monkeypatch.setattr(aiopar.TaskGroup, "_on_done", late_on_done)
    test_task_group_first_failure_cancels_unstarted_and_is_raised()


def test_task_group_several_failures_make_an_exception_group():
    def fail(i):
        raise KeyError(i)

    barrier = threading.Barrier(2)
    with (
        aiopar.use_backend("thread", max_workers=2),
        pytest.raises(ExceptionGroup) as info,
        aiopar.task_group() as tg,
    ):
        for i in range(2):
            tg.fork(lambda i=i: (barrier.wait(5), fail(i)))
    assert sorted(e.args[0] for e in info.value.exceptions) == [0, 1]


def test_task_group_failures_that_are_not_all_exceptions_make_a_base_exception_group():
    # ExceptionGroup refuses a SystemExit: the group says what failed instead
    # of raising TypeError.
    barrier = threading.Barrier(2)

    def fail(error):
        barrier.wait(5)
        raise error

    with (
        aiopar.use_backend("thread", max_workers=2),
        pytest.raises(BaseExceptionGroup) as info,
        aiopar.task_group() as tg,
    ):
        tg.fork(fail, ValueError("a"))
        tg.fork(fail, SystemExit(3))
    assert not isinstance(info.value, ExceptionGroup)
    assert sorted(type(e).__name__ for e in info.value.exceptions) == ["SystemExit", "ValueError"]


def test_task_group_body_error_cancels_pending_and_propagates():
    gate = threading.Event()
    with (
        aiopar.use_backend("thread", max_workers=1),
        pytest.raises(RuntimeError, match="body"),
        aiopar.task_group() as tg,
    ):
        running = tg.fork(gate.wait, 5)
        queued = tg.fork(lambda: "never")
        gate.set()
        raise RuntimeError("body")
    assert running.done()
    assert queued.cancelled() or queued.value() == "never"


def test_task_group_rejects_fork_after_exit():
    with aiopar.task_group() as tg:
        pass
    with pytest.raises(RuntimeError, match="exited"):
        tg.fork(double, 1)


def test_wrap_concurrent_future():
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert aiopar.wrap(pool.submit(double, 21)).wait(timeout=5) == 42
        source = concurrent.futures.Future()
        adopted = aiopar.wrap(source)
        adopted.cancel()
        assert source.cancelled()


def test_wrap_returns_aiopar_future_itself_and_rejects_others():
    fut: Future[int] = Future()
    assert aiopar.wrap(fut) is fut
    with pytest.raises(TypeError, match="awaitable"):
        aiopar.wrap(42)


def test_wrap_coroutine_outside_a_loop_runs_on_owned_loop():
    async def coro():
        return "from the loop thread"

    assert aiopar.wrap(coro()).wait(timeout=5) == "from the loop thread"


def test_fork_coroutine_function_outside_a_loop():
    async def triple(x):
        return 3 * x

    assert aiopar.fork(triple, 3).wait(timeout=5) == 9
    futs = [aiopar.fork(triple, i) for i in range(20)]
    assert aiopar.wait_all(futs) == [3 * i for i in range(20)]


def test_fork_async_callable_object():
    class AsyncModel:
        async def __call__(self, x):
            return x + 1

    assert aiopar.fork(AsyncModel(), 1).wait(timeout=5) == 2


def test_a_dropped_future_frees_its_result_without_the_garbage_collector():
    import gc
    import weakref

    class Big:
        pass

    gc.disable()
    try:
        for backend in ("thread", "inline"):
            fut = aiopar.get_backend(backend).fork(Big)
            result = weakref.ref(fut.wait())
            del fut
            assert result() is None, f"a reference cycle keeps the result alive on {backend}"
    finally:
        gc.enable()


VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def set_var(value: str) -> str:
    VAR.set(value)
    return VAR.get()


@pytest.mark.parametrize("backend", ["thread", "inline"])
@pytest.mark.parametrize("forker_sets", [True, False], ids=["forker sets a variable", "none set"])
def test_a_fork_runs_in_a_copy_of_the_forkers_context_that_no_other_call_sees(backend, forker_sets):
    # In a thread of its own, whose context starts empty: a forker that sets
    # no variable is the case where no copy is kept, and each task gets a
    # fresh context as it runs.
    seen: list[object] = []

    def forker() -> None:
        pool = aiopar.get_backend(backend, **({"max_workers": 1} if backend == "thread" else {}))
        if forker_sets:
            VAR.set("forker's")
        at_fork = VAR.get()
        first = pool.fork(VAR.get)
        if forker_sets:
            VAR.set("changed after the fork")
        now = VAR.get()
        # With a timeout, the waiter runs no task itself: the worker does.
        seen.append(first.wait(30) == at_fork)
        # A task that sets the variable changes it for neither the forker
        # nor the next task on the same worker.
        seen.append(pool.fork(set_var, "a task's").wait(30) == "a task's")
        seen.append(pool.fork(VAR.get).wait(30) == now)
        seen.append(VAR.get() == now)
        pool.shutdown()

    thread = threading.Thread(target=forker)
    thread.start()
    thread.join(30)
    assert seen == [True] * 4
