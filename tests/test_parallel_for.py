"""parallel_for: chunking, the caller's part, nesting, exceptions, bad input."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np
import pytest
from budget_helpers import settle
from threadpoolctl import threadpool_info

import aiopar
from aiopar._budget import budget, cores
from aiopar._parallel import CHUNKS_PER_THREAD

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def two_threads():
    """Two intra-op threads, so chunks really run in parallel (even on one core)."""
    explicit, source = budget.explicit, budget.explicit_from
    aiopar.set_num_threads(2)
    yield
    budget.set_explicit(explicit, source)


def chunks_of(begin, end, grain):
    seen = []
    lock = threading.Lock()

    def fn(b, e):
        with lock:
            seen.append((b, e))

    aiopar.parallel_for(begin, end, grain, fn)
    return sorted(seen)


@pytest.mark.parametrize(
    ("begin", "end", "grain"),
    [(0, 10, 3), (5, 1006, 7), (-50, 51, 1), (0, 1, 1), (3, 10, 1), (0, 1001, 500)],
)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_chunks_cover_the_range_once_and_respect_the_grain(begin, end, grain, threads):
    aiopar.set_num_threads(threads)
    chunks = chunks_of(begin, end, grain)
    assert chunks[0][0] == begin and chunks[-1][1] == end
    assert all(a[1] == b[0] for a, b in itertools.pairwise(chunks)), "contiguous"
    assert all(e - b >= grain for b, e in chunks)
    expected = 1 if threads == 1 else min(CHUNKS_PER_THREAD * threads, (end - begin) // grain)
    assert len(chunks) == max(1, expected)
    assert max(e - b for b, e in chunks) - min(e - b for b, e in chunks) <= 1, "equal chunks"


def test_grain_larger_than_the_range_is_one_call():
    assert chunks_of(10, 15, 100) == [(10, 15)]


def test_empty_range_calls_nothing():
    assert chunks_of(7, 7, 1) == []


def test_numpy_integers_are_accepted():
    assert chunks_of(np.int64(0), np.int32(8), np.int64(4)) == [(0, 4), (4, 8)]


def test_elementwise_numpy_matches_a_single_call():
    x = np.random.default_rng(0).standard_normal(100_003)
    y = np.empty_like(x)
    aiopar.parallel_for(0, x.size, 1000, lambda b, e: np.tanh(x[b:e], out=y[b:e]))
    np.testing.assert_array_equal(y, np.tanh(x))


def test_the_caller_runs_chunks_beside_the_helpers():
    threads = set()
    both = threading.Barrier(2, timeout=10)  # the two chunks run at once

    def fn(b, e):
        threads.add(threading.get_ident())
        both.wait()

    aiopar.parallel_for(0, 2, 1, fn)
    assert threading.get_ident() in threads
    assert len(threads) == 2


def test_nested_call_runs_serially_in_the_chunk_thread():
    assert not aiopar.in_parallel_region()
    inner = []
    lock = threading.Lock()

    def outer(b, e):
        assert aiopar.in_parallel_region()
        me = threading.get_ident()

        def record(ib, ie):
            with lock:
                inner.append((ib, ie, threading.get_ident() == me))

        aiopar.parallel_for(b, e, 1, record)

    aiopar.parallel_for(0, 10, 1, outer)
    assert not aiopar.in_parallel_region()
    assert sorted(inner) == [(b, e, True) for b, e in chunks_of(0, 10, 1)]


def test_a_slow_thread_delays_only_its_own_share():
    # Every other thread is stuck in its first chunk until the caller has done
    # more than half of the range: threads that take chunks as they finish let
    # it; one fixed share per thread would not (the caller's share is half).
    n = 64
    caller = threading.get_ident()
    done_by_caller = []
    caller_took_over = threading.Event()
    helper_timed_out = []

    def fn(b: int, e: int) -> None:
        if threading.get_ident() != caller:
            if not caller_took_over.wait(timeout=10):
                helper_timed_out.append((b, e))
            return
        done_by_caller.append(e - b)
        if sum(done_by_caller) > n // 2:
            caller_took_over.set()

    aiopar.parallel_for(0, n, 1, fn)  # on two threads (the fixture's setting)
    assert not helper_timed_out, "the caller never got past its own half"
    assert sum(done_by_caller) > n // 2


def test_grain_size_bounds_the_number_of_chunks():
    # The grain wins over CHUNKS_PER_THREAD: a range of two grains is two chunks.
    assert chunks_of(0, 200, 100) == [(0, 100), (100, 200)]
    assert len(chunks_of(0, 1000, 1)) == CHUNKS_PER_THREAD * 2


def test_the_first_exception_is_raised_after_every_chunk_stopped():
    finished = []
    started = threading.Event()

    def fn(b, e):
        if b == 0:
            assert started.wait(5)
            raise ValueError("first")
        started.set()
        time.sleep(0.1)
        finished.append(b)
        raise KeyError("second")

    with pytest.raises(ValueError, match="first") as info:
        aiopar.parallel_for(0, 2, 1, fn)
    assert finished == [1], "the slow chunk finished before parallel_for raised"
    assert any("fn(0, 1)" in note for note in info.value.__notes__)
    assert not aiopar.in_parallel_region()


def test_chunks_not_started_after_a_failure_are_skipped():
    # A single thread working through a job's chunks claims them in order.
    from aiopar._parallel import _Job

    calls = []

    def fn(b, e):
        calls.append(b)
        raise ValueError("stop")

    job = _Job(fn, [(0, 1), (1, 2), (2, 3)])
    job.work()
    assert calls == [0] and isinstance(job.error, ValueError)
    assert job.finished.acquire(timeout=0), "every chunk accounted for"


def test_the_pool_still_works_after_an_exception():
    with pytest.raises(ZeroDivisionError):
        aiopar.parallel_for(0, 4, 1, lambda b, e: 1 / 0)
    assert chunks_of(0, 4, 2) == [(0, 2), (2, 4)]


@pytest.mark.skipif(cores() < 2, reason="needs two cores for a budget to share")
def test_chunks_count_against_the_thread_budget():
    aiopar.set_num_threads(None)
    inside = []

    both = threading.Barrier(2, timeout=10)  # the two chunks count at once

    def fn(b, e):
        both.wait()
        inside.append([lib["num_threads"] for lib in threadpool_info()])
        both.wait()

    aiopar.parallel_for(0, 2, 1, fn)
    share = max(1, cores() // 2)
    assert inside and all(counts == [share] * len(counts) for counts in inside)
    assert budget.running == 0
    settle()  # the libraries get every core back up to 0.1 s later (rule 4)
    assert all(lib["num_threads"] == cores() for lib in threadpool_info())


def noop(b, e):
    pass


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((0, 10, 0, noop), ValueError, r"grain_size must be >= 1 .* got 0"),
        ((0, 10, -3, noop), ValueError, r"grain_size must be >= 1 .* got -3"),
        ((10, 0, 1, noop), ValueError, r"begin \(10\) is greater than end \(0\)"),
        ((0.0, 10, 1, noop), TypeError, r"begin must be an integer, got float"),
        ((0, "10", 1, noop), TypeError, r"end must be an integer, got str"),
        ((0, 10, 1.5, noop), TypeError, r"grain_size must be an integer, got float"),
        ((0, True, 1, noop), TypeError, r"end must be an integer, got bool"),
        ((0, 10, 1, None), TypeError, r"fn must be a callable taking \(begin, end\)"),
    ],
)
def test_bad_input_gets_a_clear_error(args, error, message):
    with pytest.raises(error, match=message):
        aiopar.parallel_for(*args)
