"""aiopar.map and Backend.map: one future per item, items run in chunks."""

from __future__ import annotations

import contextvars
import threading
import traceback

import pytest

import aiopar
import aiopar.profiler
from aiopar.backends._base import chunk_size

BACKENDS = ["inline", "thread", "openmp", "process"]


def square(x: int) -> int:
    return x * x


def add(x: int, y: int) -> int:
    return x + y


def fail_on_three(x: int) -> int:
    if x == 3:
        raise ValueError(f"item {x} failed on purpose")
    return x


async def square_async(x: int) -> int:
    return x * x


@pytest.mark.parametrize("backend", BACKENDS)
def test_map_gives_one_future_per_item_in_order(backend):
    with aiopar.use_backend(backend):
        futures = aiopar.map(square, range(50))
    assert all(isinstance(f, aiopar.Future) for f in futures)
    assert aiopar.wait_all(futures) == [x * x for x in range(50)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_named_backend_maps_on_itself(backend):
    futures = aiopar.get_backend(backend).map(add, [1, 2, 3], [10, 20, 30], chunksize=2)
    assert aiopar.wait_all(futures) == [11, 22, 33]


def test_map_stops_at_the_shortest_iterable_as_the_builtin_does():
    assert aiopar.wait_all(aiopar.map(add, range(10), range(3))) == [0, 2, 4]
    assert aiopar.map(square, []) == []


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunksize", [1, 2, 100])
def test_an_item_s_failure_fails_its_future_only(backend, chunksize):
    futures = aiopar.get_backend(backend).map(fail_on_three, range(6), chunksize=chunksize)
    assert [f.exception(timeout=30) is None for f in futures] == [True] * 3 + [False] + [True] * 2
    with pytest.raises(ValueError, match="item 3 failed on purpose") as info:
        futures[3].wait()
    text = "".join(traceback.format_exception(info.value))
    assert "fail_on_three" in text  # the failing call's frame, in this process or another
    assert [f.wait() for f in futures if f is not futures[3]] == [0, 1, 2, 4, 5]


def test_a_coroutine_function_is_mapped_too():
    assert aiopar.wait_all(aiopar.map(square_async, range(5))) == [0, 1, 4, 9, 16]


def test_items_of_a_chunk_share_one_context_copied_from_the_caller():
    var: contextvars.ContextVar[int] = contextvars.ContextVar("var", default=0)
    var.set(7)

    def bump(_: object) -> int:
        var.set(var.get() + 1)
        return var.get()

    futures = aiopar.get_backend("thread").map(bump, range(4), chunksize=4)
    assert aiopar.wait_all(futures) == [8, 9, 10, 11]  # one chunk, one context
    assert var.get() == 7  # the caller's own is untouched


def test_a_future_cancelled_before_its_chunk_reaches_it_is_skipped():
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []

    def item(x: int) -> int:
        if x == 0:
            started.set()
            release.wait(30)
        ran.append(x)
        return x

    futures = aiopar.get_backend("thread").map(item, range(4), chunksize=4)
    assert started.wait(30)
    assert futures[2].cancel()
    assert not futures[0].cancel()  # it runs: never interrupted
    release.set()
    assert [futures[i].wait(30) for i in (0, 1, 3)] == [0, 1, 3]
    assert futures[2].cancelled()
    assert ran == [0, 1, 3]


def test_a_waiter_on_an_item_of_a_chunk_not_started_runs_the_chunk_itself():
    release = threading.Event()
    with aiopar.get_backend("thread", max_workers=1) as pool:
        busy = pool.fork(release.wait, 30)  # the only worker is taken
        futures = pool.map(lambda x: threading.current_thread(), range(3), chunksize=3)
        assert futures[1].wait() is threading.current_thread()
        assert all(f.done() for f in futures)
        release.set()
        busy.wait()


def test_shutdown_that_cancels_queued_work_cancels_every_item_of_a_queued_chunk():
    started, release = threading.Event(), threading.Event()
    pool = aiopar.get_backend("thread", max_workers=1)

    def block() -> None:
        started.set()
        release.wait(30)

    busy = pool.fork(block)
    assert started.wait(30)
    futures = pool.map(square, range(6), chunksize=3)
    pool.shutdown(wait=False, cancel_pending=True)
    release.set()
    busy.wait(30)
    pool.shutdown(wait=True)
    assert all(f.cancelled() for f in futures)


def test_a_keyboard_interrupt_in_the_waiter_s_own_chunk_settles_every_item():
    # The main thread runs the chunk itself (its only worker is busy); a
    # Ctrl-C from an item goes on up, and no item's future is left pending.
    release = threading.Event()

    def interrupt(x: int) -> int:
        if x == 1:
            raise KeyboardInterrupt
        return x

    with aiopar.get_backend("thread", max_workers=1) as pool:
        busy = pool.fork(release.wait, 30)
        futures = pool.map(interrupt, range(4), chunksize=4)
        with pytest.raises(KeyboardInterrupt):
            futures[0].wait()
        release.set()
        busy.wait()
    assert futures[0].wait() == 0
    assert isinstance(futures[1].exception(), aiopar.CancelledError)  # interrupted
    assert futures[2].cancelled() and futures[3].cancelled()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: aiopar.map(3, [1]), "needs a callable"),
        (lambda: aiopar.map(square), "needs an iterable of arguments"),
        (lambda: aiopar.map(square, [1], chunksize=0), r"chunksize=\.\.\.\) must be a whole"),
        (lambda: aiopar.map(square, [1], chunksize=1.5), "must be a whole number"),
    ],
)
def test_bad_arguments_fail_at_the_call(call, message):
    with pytest.raises((TypeError, ValueError), match=message):
        call()


def test_the_default_chunk_size_gives_each_worker_four_chunks():
    assert chunk_size(10_000, 2) == 1250
    assert chunk_size(9, 2) == 2
    assert chunk_size(1, 8) == 1


def test_the_profiler_names_a_chunk_after_the_mapped_function():
    with aiopar.profiler.profile() as prof:
        aiopar.wait_all(aiopar.get_backend("thread").map(square, range(8), chunksize=4))
    assert "square" in prof.table()
