"""Thread counts: set/get_num_threads, the budget seen through threadpoolctl, parallel_info."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
import time
from collections.abc import Iterator

import numpy as np  # noqa: F401 - loads the BLAS threadpoolctl should see
import pytest
from budget_helpers import late, once_alone, settle
from future_helpers import fork_running_until_waited_on
from helpers import eventually, python, run_python
from threadpoolctl import threadpool_info, threadpool_limits

import aiopar
from aiopar import _budget, _budget_slots
from aiopar._budget import budget, cores
from aiopar.backends import Backend
from aiopar.backends.thread import ThreadBackend

pytestmark = [pytest.mark.timeout(30), pytest.mark.usefixtures("automatic_budget")]


def blas_threads() -> list[int]:
    """The thread count of every BLAS library threadpoolctl sees."""
    return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]


def seen() -> tuple[int, list[int]]:
    return aiopar.get_num_threads(), blas_threads()


def run_together(k: int, fn):
    """Fork ``k`` tasks that run ``fn`` at the same moment; their values in order."""
    aiopar.set_num_interop_threads(k)
    barrier = threading.Barrier(k, timeout=10)

    def task():
        barrier.wait()
        value = fn()
        barrier.wait()
        return value

    values = aiopar.wait_all([aiopar.fork(task) for _ in range(k)])
    settle()
    return values


def compute_beside_a_fork() -> None:
    """Show the budget that this thread computes beside its forks rather
    than waiting for them at once, so it counts from its next fork on: it
    blocks in wait for a fork a worker runs, longer than WAITS_AT_ONCE after
    forking it (rule 3). The fork lasts until this thread has blocked."""
    forker = _budget_slots.this_thread()
    started = threading.Event()

    def until_the_forker_blocks():
        started.set()
        eventually(lambda: forker.is_blocked, timeout=10)

    pool = aiopar.get_backend()
    # A worker still awake from the last task would take the fork waking none:
    # a fork that wakes no worker teaches the budget nothing.
    eventually(lambda: len(pool._idle) == len(pool._workers), timeout=10)
    warm_up = aiopar.fork(until_the_forker_blocks)
    assert started.wait(10)
    time.sleep(2 * _budget_slots.WAITS_AT_ONCE)  # this thread computes beside it
    warm_up.wait()
    settle()
    assert forker.anticipates


def test_idle_process_uses_every_core():
    assert blas_threads(), "numpy's BLAS should be visible to threadpoolctl"
    assert seen() == (cores(), [cores()] * len(blas_threads()))


def test_a_single_task_gets_every_core():
    expected = (cores(), [cores()] * len(blas_threads()))
    assert aiopar.fork(once_alone(seen)).wait() == seen() == expected


@pytest.mark.skipif(cores() < 2, reason="a share of one core is the whole core")
@pytest.mark.parametrize("when", ["as soon as it forks", "once the task has started"])
def test_a_thread_that_computes_beside_its_fork_counts(when):
    # A worker was idle, so the fork counts from the fork on: the forking
    # thread's next BLAS call already leaves the worker its share.
    started, release = threading.Event(), threading.Event()

    def task():
        started.set()
        release.wait(5)

    compute_beside_a_fork()
    fut = aiopar.fork(task)
    try:
        if when == "once the task has started":
            assert started.wait(5)
        share = cores() // 2  # the task and this thread, which has not waited yet
        assert seen() == (share, [share] * len(blas_threads()))
    finally:
        release.set()
    fut.wait()
    settle()
    assert seen() == (cores(), [cores()] * len(blas_threads()))


def test_a_fork_its_forker_runs_itself_has_every_core():
    for _ in range(20):  # whoever runs it, it runs alone
        assert aiopar.fork(once_alone(seen)).wait() == (cores(), [cores()] * len(blas_threads()))
    settle()


def test_a_fork_cancelled_before_it_starts_gives_its_share_back():
    futs = [aiopar.fork(time.sleep, 0.01) for _ in range(6)]
    cancelled = [fut for fut in futs if fut.cancel()]
    aiopar.wait_all([fut for fut in futs if fut not in cancelled])
    settle()
    assert seen() == (cores(), [cores()] * len(blas_threads()))


@pytest.mark.parametrize("gone", ["cancelled", "run by its waiter"])
def test_a_worker_late_for_a_fork_that_is_gone_counts_nothing(monkeypatch, gone):
    # On a busy machine, a worker woken for a fork may reach the queue only
    # after the fork was cancelled, or run by the thread that waited for it.
    pool = ThreadBackend(max_workers=2)
    late = threading.Event()
    run_tasks = pool._run_tasks  # a fresh worker's loop: its first look at the queues
    monkeypatch.setattr(pool, "_run_tasks", lambda *args: (late.wait(10), run_tasks(*args))[1])
    spells: list[object] = []
    first_task = _budget_slots.Slot.first_task
    monkeypatch.setattr(
        _budget_slots.Slot, "first_task", lambda slot: (spells.append(slot), first_task(slot))
    )
    try:
        futs = [pool.fork(time.sleep, 0.001) for _ in range(2)]
        if gone == "cancelled":
            assert all(fut.cancel() for fut in futs)
        else:
            for fut in futs:
                fut.wait()  # this thread runs it
        late.set()
        eventually(lambda: len(pool._idle) == len(pool._workers), timeout=10)
        assert spells == [], "a worker counted for a task it did not run"
    finally:
        late.set()
        pool.shutdown()
    settle()


@pytest.mark.parametrize("k", [2, 3])
def test_concurrent_tasks_share_the_cores(k):
    share = max(1, cores() // k)
    values = run_together(k, seen)
    assert values == [(share, [share] * len(blas_threads()))] * k
    assert seen() == (cores(), [cores()] * len(blas_threads())), "restored once idle"


def test_a_task_that_waits_for_its_own_fork_counts_once():
    def outer():
        return aiopar.fork(once_alone(seen)).wait()  # runs in this thread: one task still

    assert aiopar.fork(outer).wait() == (cores(), [cores()] * len(blas_threads()))


def test_a_worker_blocked_in_wait_gives_its_share_back():
    aiopar.set_num_interop_threads(2)
    inner_started = threading.Event()

    def inner():
        inner_started.set()
        deadline = time.monotonic() + 5
        # Until the outer task blocks in wait, and rule 4's timer (started
        # when both counted) has given the libraries their threads back.
        while (budget.running > 1 or late()) and time.monotonic() < deadline:
            time.sleep(0.001)
        return seen()

    def outer():
        fut = aiopar.fork(inner)
        assert inner_started.wait(5)
        return fut.wait()

    assert aiopar.fork(outer).wait() == (cores(), [cores()] * len(blas_threads()))
    settle()


@pytest.mark.skipif(cores() < 2, reason="a share of one core is the whole core")
def test_a_thread_that_computed_beside_its_fork_gives_its_cores_back_once_it_waits_long(
    monkeypatch,
):
    # The tail of a fork its forker waits for keeps its share for a while:
    # more BLAS threads for a short spell leave spinning threads behind.
    from aiopar import _waiter

    long_wait = 0.5
    monkeypatch.setattr(_waiter, "BLOCKED_LONG", long_wait)
    share = cores() // 2

    def tail():
        deadline = time.monotonic() + 5
        while budget.running > 1 and time.monotonic() < deadline:
            time.sleep(0.001)  # until the forker blocks in wait
        blocked_at = time.monotonic()
        first = blas_threads()
        while blas_threads() != [cores()] * len(first) and time.monotonic() < deadline:
            time.sleep(0.005)
        return first, blas_threads(), time.monotonic() - blocked_at

    compute_beside_a_fork()
    fut = aiopar.fork(tail)
    time.sleep(long_wait + 0.1)  # this thread "computes" beside its fork
    first, last, waited = fut.wait()
    assert first == [share] * len(first)
    assert last == [cores()] * len(last)
    assert waited >= long_wait / 2
    settle()


def test_budget_is_restored_after_tasks_raise():
    def fail():
        raise ValueError("task failed")

    with pytest.raises(ValueError, match="task failed"):
        run_together(2, fail)
    settle()
    assert seen() == (cores(), [cores()] * len(blas_threads()))


def test_explicit_count_is_kept_exactly_inside_and_outside_forks():
    aiopar.set_num_threads(1)
    assert seen() == (1, [1] * len(blas_threads()))
    assert aiopar.fork(seen).wait() == (1, [1] * len(blas_threads()))

    aiopar.set_num_threads(3)  # more than a share, even more than the cores: as asked
    assert run_together(2, seen) == [(3, [3] * len(blas_threads()))] * 2
    assert seen() == (3, [3] * len(blas_threads()))


def test_set_num_threads_none_returns_to_the_budget():
    aiopar.set_num_threads(1)
    aiopar.set_num_threads(None)
    assert seen() == (cores(), [cores()] * len(blas_threads()))
    share = max(1, cores() // 2)
    assert run_together(2, seen) == [(share, [share] * len(blas_threads()))] * 2


def test_threadpoolctl_still_works_for_the_user_after_the_budget_changed():
    # threadpoolctl lets one "controlling" thread limit OpenBLAS; the budget
    # changes from worker threads must not keep that role.
    run_together(2, seen)
    with threadpool_limits(limits=1, user_api="blas"):
        assert blas_threads() == [1] * len(blas_threads())
    assert blas_threads() == [cores()] * len(blas_threads())


def test_interop_setting_is_followed_by_a_running_backend():
    backend = aiopar.get_backend()
    aiopar.set_num_interop_threads(3)
    assert aiopar.get_num_interop_threads() == backend.max_workers == 3


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_thread_counts_are_refused(bad):
    with pytest.raises(ValueError, match=r"set_num_threads\(n\): n .*whole number >= 1"):
        aiopar.set_num_threads(bad)
    with pytest.raises(ValueError, match=r"set_num_interop_threads\(n\): n must be"):
        aiopar.set_num_interop_threads(bad)
    assert seen()[0] == cores()


def test_parallel_info_reports_the_settings():
    info = aiopar.parallel_info()
    assert "openmp" in info.split("backends:")[1].splitlines()[0]
    assert f"intra-op threads: {cores()} (budget" in info
    assert "openblas" in info  # numpy's BLAS, found by threadpoolctl
    openblas = next(lib for lib in threadpool_info() if lib["internal_api"] == "openblas")
    assert f"{openblas['architecture']} kernels" in info  # which kernels it runs
    assert "OMP_NUM_THREADS=" in info and "OPENBLAS_NUM_THREADS=" in info
    assert "WARNING" not in info


@pytest.mark.parametrize(
    ("architecture", "flags", "coretype", "noted"),
    [
        ("Haswell", "avx2 avx512f avx512cd avx512bw avx512dq avx512vl", None, True),
        ("SkylakeX", "avx2 avx512f avx512cd avx512bw avx512dq avx512vl", None, False),
        ("Haswell", "avx2 fma", None, False),  # no AVX-512: Haswell is the best it has
        ("Haswell", "avx2 avx512f avx512cd avx512bw avx512dq avx512vl", "Haswell", True),
    ],
)
def test_parallel_info_notes_openblas_kernels_without_avx512_on_an_avx512_cpu(
    monkeypatch, architecture, flags, coretype, noted
):
    from aiopar import _info

    if coretype is None:
        monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    else:
        monkeypatch.setenv("OPENBLAS_CORETYPE", coretype)
    library = {"internal_api": "openblas", "architecture": architecture}
    notes = _info._older_kernels([library], frozenset(flags.split()))
    assert bool(notes) is noted
    if noted and coretype is None:
        assert "OPENBLAS_CORETYPE=SkylakeX, set before numpy is imported" in notes[0]
    elif noted:
        assert f"OPENBLAS_CORETYPE={coretype} chose them; unset, OpenBLAS picks" in notes[0]


def test_cpu_flags_are_read_on_linux():
    from aiopar import _info

    if not os.path.exists("/proc/cpuinfo"):
        pytest.skip("no /proc/cpuinfo")
    with open("/proc/cpuinfo") as cpuinfo:
        has_flags = any(line.startswith("flags") for line in cpuinfo)
    assert bool(_info._cpu_flags()) is has_flags


def test_parallel_info_warns_when_settings_oversubscribe():
    aiopar.set_num_interop_threads(cores() + 1)
    aiopar.set_num_threads(2)
    info = aiopar.parallel_info()
    assert "intra-op threads: 2 (set by set_num_threads" in info
    assert f"WARNING: {cores() + 1} interop workers x 2 intra-op threads" in info


def test_omp_num_threads_at_import_is_an_explicit_setting():
    code = "import aiopar; print(aiopar.get_num_threads()); print(aiopar.parallel_info())"
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    out = python("-c", code, env=env, check=True).stdout
    assert out.splitlines()[0] == "3"
    assert "set by OMP_NUM_THREADS" in out


def test_tasks_that_end_beside_a_running_one_do_not_flip_blas(monkeypatch):
    # Changing BLAS threads costs about a microsecond: tasks that end give
    # their threads back only once nothing runs, not each time one finishes.
    changes = []
    apply = budget._apply
    monkeypatch.setattr(budget, "_apply", lambda n: (changes.append(n), apply(n)))
    budget.take()  # a long task
    try:
        for _ in range(1_000):
            budget.take()
            budget.give_back()
    finally:
        budget.give_back()
    settle()  # the threads come back up to 0.1 s late (rule 4)
    assert changes == ([max(1, cores() // 2), cores()] if cores() > 1 else [])
    assert seen() == (cores(), [cores()] * len(blas_threads()))


def run_in_new_thread(fn):
    """``fn()`` in a thread of its own, which has no budget history yet."""
    results = []
    thread = threading.Thread(target=lambda: results.append(fn()))
    thread.start()
    thread.join(timeout=10)
    return results[0]


@pytest.fixture
def come_back_after_a_second(monkeypatch):
    """Rule 4's wait made a second long, so that "in quick succession" holds
    on a loaded machine; whatever the timer has yet to do is done after."""
    monkeypatch.setattr(_budget, "COME_BACK_AFTER", 1.0)
    yield
    with budget.lock:
        if budget.come_back_timer is not None:
            budget.come_back_timer.cancel()
            budget.come_back_timer = None
        budget._follow_budget(now=True)


def share_for_a_moment(k: int = 2, seconds: float = 0.01) -> None:
    """``k`` threads count for ``seconds``, as ``k`` tasks side by side do."""
    for _ in range(k):
        budget.take()
    time.sleep(seconds)
    for _ in range(k):
        budget.give_back()


@pytest.mark.skipif(cores() < 2, reason="needs two cores for a budget to share")
@pytest.mark.usefixtures("come_back_after_a_second")
def test_rounds_of_tasks_in_quick_succession_keep_blas_shared_in_between(monkeypatch):
    # OpenBLAS's threads spin for about 0.1 s after a call: threads given
    # back between two rounds would spin beside the next one (rule 4).
    changes = count_blas_changes(monkeypatch)
    share = max(1, cores() // 2)
    for _ in range(5):
        share_for_a_moment()
    assert changes == [share]
    assert blas_threads() == [share] * len(blas_threads())
    settle()  # the timer gives every core back, with no further call into aiopar
    assert changes == [share, cores()]
    for timer in [t for t in threading.enumerate() if t.name == "aiopar-budget"]:
        timer.join(timeout=5)  # it ends once it has given them back
        assert not timer.is_alive()


@pytest.mark.skipif(cores() < 2, reason="needs two cores for a budget to share")
@pytest.mark.usefixtures("come_back_after_a_second")
def test_threads_come_back_when_the_clock_says_rule_4s_wait_is_over(monkeypatch):
    # The budget's clock, stepped by hand: no real time passes for rule 4.
    now = [_budget.clock()]
    monkeypatch.setattr(_budget, "clock", lambda: now[0])
    share = [max(1, cores() // 2)] * len(blas_threads())
    share_for_a_moment(seconds=0)
    assert blas_threads() == share
    now[0] += _budget.COME_BACK_AFTER / 2
    budget.follow()
    assert blas_threads() == share, "back before rule 4's wait was over"
    now[0] += _budget.COME_BACK_AFTER
    budget.follow()
    assert blas_threads() == [cores()] * len(share)


@pytest.mark.skipif(cores() < 2, reason="needs two cores for a budget to share")
@pytest.mark.usefixtures("come_back_after_a_second")
def test_a_forker_that_waits_at_once_gives_its_share_back_at_once(monkeypatch):
    # Its first fork counts it beside the fork (rule 3) for the moment until
    # it waits: that share was never used, and the fork gets every core.
    monkeypatch.setattr(
        _budget_slots, "WAITS_AT_ONCE", 1.0
    )  # "at once", however loaded the machine
    assert run_in_new_thread(lambda: aiopar.fork(once_alone(seen)).wait()) == (
        cores(),
        [cores()] * len(blas_threads()),
    )


@pytest.mark.skipif(cores() < 2, reason="needs two cores for a budget to share")
@pytest.mark.usefixtures("come_back_after_a_second")
def test_a_worker_that_waits_keeps_the_libraries_shared_for_the_next_task(monkeypatch):
    # A task that forks several and waits for the first: the worker it frees
    # takes the next one at once, so its cores are not the waited-for fork's
    # for the moment between (they would leave a spinning BLAS thread behind).
    changes = count_blas_changes(monkeypatch)
    share = max(1, cores() // 2)
    both = threading.Barrier(2, timeout=10)

    def forks_and_waits():
        futs = [aiopar.fork(both.wait) for _ in range(2)]
        return [fut.wait() for fut in futs]

    _budget_slots.this_thread().anticipates = False  # this thread only waits (rule 3)
    aiopar.fork(forks_and_waits).wait(timeout=10)  # a timeout: a worker runs it
    assert changes == [share]
    settle()
    assert changes == [share, cores()]


@pytest.mark.skipif(cores() < 2, reason="needs two cores for a budget to share")
@pytest.mark.usefixtures("come_back_after_a_second")
def test_set_num_threads_none_gives_the_budget_count_at_once():
    share_for_a_moment()
    assert blas_threads() == [max(1, cores() // 2)] * len(blas_threads())
    aiopar.set_num_threads(None)
    assert seen() == (cores(), [cores()] * len(blas_threads()))


@pytest.mark.skipif(cores() < 2, reason="needs two cores for a budget to share")
def test_a_child_forked_while_threads_come_back_late_has_every_core_at_once():
    code = """
        import os, threading, time
        import numpy
        import aiopar
        from aiopar import _budget
        from threadpoolctl import threadpool_info

        def blas():
            return [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]

        _budget.COME_BACK_AFTER = 60.0
        both = threading.Barrier(2)
        aiopar.wait_all([aiopar.fork(lambda: (both.wait(), time.sleep(0.01))) for _ in range(2)])
        while _budget.budget.running:
            time.sleep(0.001)
        pid = os.fork()
        if pid == 0:
            print("child", blas(), flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        print("parent", blas(), flush=True)
    """
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr
    share, all_cores = max(1, cores() // 2), cores()
    n = len(blas_threads())
    assert done.stdout.splitlines() == [f"child {[all_cores] * n}", f"parent {[share] * n}"]


def count_blas_changes(monkeypatch) -> list[int]:
    changes: list[int] = []
    apply = budget._apply
    monkeypatch.setattr(budget, "_apply", lambda n: (changes.append(n), apply(n)))
    return changes


@contextlib.contextmanager
def forking_and_waiting_at_once(monkeypatch) -> Iterator[tuple[Backend, list[float]]]:
    """A one-worker pool, and the budget's time standing still until the test
    moves it (``now[0] += s``), once this thread has shown the budget that it
    forks and waits at once: every wait is "at once" (rule 3's window),
    however loaded the machine. One worker: a second one, woken while the
    first was still in its spell of work (likely on a busy machine), would
    count beside it for a moment."""
    clock = _budget.clock
    pool = aiopar.get_backend("thread", max_workers=1)
    now = [clock()]
    monkeypatch.setattr(_budget, "clock", lambda: now[0])
    try:
        pool.fork(int).wait()  # the worker started, and the budget learned
        now[0] += 1.0  # rule 4's come-back is due
        settle()
        yield pool, now
    finally:
        monkeypatch.setattr(_budget, "clock", clock)


def test_a_fork_its_forker_waits_for_at_once_changes_blas_at_most_twice_in_100(monkeypatch):
    def work():
        return sum(range(100))

    with forking_and_waiting_at_once(monkeypatch) as (pool, now):
        changes = count_blas_changes(monkeypatch)
        for _ in range(100):
            pool.fork(work).wait()
        now[0] += 1.0
        settle()
    assert len(changes) <= 2, changes


def test_a_fork_run_by_its_forker_changes_no_blas_setting(monkeypatch):
    aiopar.fork(int).wait()
    changes = count_blas_changes(monkeypatch)
    backend = aiopar.get_backend("inline")
    assert backend.fork(seen).wait() == (cores(), [cores()] * len(blas_threads()))
    assert changes == []


def test_a_worker_running_queued_tasks_back_to_back_counts_once(monkeypatch):
    # A worker that goes on to a queued task keeps its share between tasks
    # rather than giving it back and taking it again for each task, and
    # gives it back once it finds no task.
    taken_in_workers = []
    take = budget.take

    def counted_take(*args, **kwargs):
        if threading.current_thread().name.startswith("aiopar-"):
            taken_in_workers.append(threading.current_thread().name)
        take(*args, **kwargs)

    backend = aiopar.get_backend("thread", max_workers=1)
    gate = threading.Event()
    try:
        first = backend.fork(gate.wait, 10)
        queued = [backend.fork(int, "1") for _ in range(100)]
        monkeypatch.setattr(budget, "take", counted_take)
        gate.set()
        for fut in [first, *queued]:
            fut.wait(timeout=10)  # with a timeout a waiter never runs a task itself
        settle()
    finally:
        backend.shutdown()
    assert len(taken_in_workers) <= 1, taken_in_workers


def test_a_thread_outside_the_pools_stops_counting_when_the_task_it_ran_ends():
    # Only a pool's worker keeps its share between queued tasks; a thread
    # that ran a queued task while waiting for it gives its share back at
    # once, however many tasks are still queued.
    backend = aiopar.get_backend("thread", max_workers=1)
    gate = threading.Event()
    try:
        busy = backend.fork(gate.wait, 10)
        queued = [backend.fork(int, "1") for _ in range(3)]
        other = threading.Thread(target=queued[0].wait)  # it runs queued[0] itself
        other.start()
        other.join(timeout=10)
        gate.set()
        assert [busy.wait(), *aiopar.wait_all(queued)] == [True, 1, 1, 1]
        settle()
    finally:
        backend.shutdown()


def test_a_worker_of_another_pool_that_forks_here_does_not_count_beside_its_fork():
    # Rule 3 counts a thread outside every pool beside the forks it wakes a
    # worker for; a worker of another pool is counted by its own pool.
    outer, inner = ThreadBackend(max_workers=1), ThreadBackend(max_workers=1)

    def fork_on_inner() -> bool:
        fut = inner.fork(int, "1")  # wakes inner's first worker
        counted = threading.get_ident() in inner._sharers
        return fut.wait(10) == 1 and not counted

    try:
        assert outer.fork(fork_on_inner).wait(10)
        settle()
    finally:
        outer.shutdown()
        inner.shutdown()


BUDGET_STRESS = """
    import collections, random, sys, threading, time
    import numpy as np
    import aiopar
    from aiopar._budget import budget, cores
    from threadpoolctl import threadpool_info

    rng_seed = int(sys.argv[1])
    pool = aiopar.get_backend("thread", max_workers=2)

    def compute():
        np.dot(np.ones(64), np.ones(64))

    def nested(depth):
        if depth == 0:
            return compute()
        return pool.fork(nested, depth - 1).wait()

    shared = collections.deque()  # futures any thread may wait for

    def program(seed):
        rng = random.Random(seed)
        for _ in range(300):
            op = rng.randrange(9)
            if op == 0:
                pool.fork(compute).wait()
            elif op == 1:
                aiopar.wait_all([pool.fork(compute) for _ in range(rng.randrange(1, 20))])
            elif op == 2:
                fut = pool.fork(compute)
                fut.cancel()
                aiopar.collect_all([fut]).wait()
            elif op == 3:
                fut = pool.fork(time.sleep, 0.0005)
                compute()
                fut.wait()
            elif op == 4:
                pool.fork(nested, rng.randrange(1, 4)).wait()
            elif op == 5:
                pool.fork(compute).wait(timeout=5)  # never run by this thread
            elif op == 6:
                shared.extend(pool.fork(compute) for _ in range(rng.randrange(1, 5)))
            elif op == 7:
                try:
                    shared.popleft().wait()  # maybe another thread's fork, run here
                except IndexError:
                    pass
            else:
                futs = [pool.fork(compute) for _ in range(rng.randrange(1, 5))]
                for fut in reversed(futs):
                    fut.wait()

    threads = [
        threading.Thread(target=program, args=(rng_seed * 10 + i,)) for i in range(3)
    ]
    for thread in threads:
        thread.start()
    program(rng_seed * 10 + 3)
    for thread in threads:
        thread.join()
    aiopar.wait_all(shared)
    deadline = time.monotonic() + 5
    while (budget.running or budget.applied not in (None, budget.target())) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.001)
    blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    print(budget.running, aiopar.get_num_threads() == cores(), set(blas) <= {cores()})
"""


@pytest.mark.parametrize("seed", range(3))
def test_the_budget_is_whole_again_after_random_forks_from_several_threads(seed):
    # Forks, waits, cancels, nested forks and batches from four threads at
    # once, most slot transitions taking no lock: once everything is done,
    # nothing counts and every library has all the cores again.
    done = run_python(BUDGET_STRESS, str(seed), timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "True", "True"], done.stdout + done.stderr


def test_a_callback_that_blocks_in_a_worker_after_its_task_leaves_the_budget_whole():
    # A done-callback runs in the worker that settled the future, after its
    # task has stopped counting: blocking there must not give back a share
    # the worker no longer holds.
    slow = fork_running_until_waited_on()
    gate = threading.Event()
    quick = aiopar.fork(gate.wait, 10)
    blocks = quick.then(lambda _: slow.wait())  # attached before a worker settles quick
    gate.set()
    assert blocks.wait(timeout=10) is None
    settle()
    assert seen() == (cores(), [cores()] * len(blas_threads()))


def test_openblas_setter_is_found_on_the_pinned_threadpoolctl():
    # The budget calls OpenBLAS's own setter through threadpoolctl's private
    # handle on the library; a threadpoolctl that moves it must fail here,
    # loudly, not make the budget fall back silently.
    import threadpoolctl

    from aiopar._budget import process_wide_setter

    controller = threadpoolctl.ThreadpoolController()
    openblas = [lib for lib in controller.lib_controllers if lib.internal_api == "openblas"]
    if not openblas:
        pytest.skip("numpy here does not use OpenBLAS")
    for lib in openblas:
        assert hasattr(lib, "dynlib") and hasattr(type(lib), "check_symbols"), (
            f"threadpoolctl {threadpoolctl.__version__} changed its OpenBLAS controller"
        )
        setter = process_wide_setter(lib)
        assert setter is not lib.set_num_threads, "OpenBLAS's own setter was not found"
        setter(1)
        assert lib.num_threads == 1
        setter(cores())


# -- limits set by someone else (threadpoolctl, a library) ---------------------

two_cores = pytest.mark.skipif(cores() < 2, reason="a share of one core is the whole core")


def share_of(k: int) -> tuple[int, list[int]]:
    share = max(1, cores() // k)
    return share, [share] * len(blas_threads())


@two_cores
def test_a_threadpool_limit_is_kept_while_tasks_start_and_end():
    run_together(2, seen)  # the budget has set BLAS at least once
    with threadpool_limits(limits=1, user_api="blas"):
        assert run_together(2, blas_threads) == [[1] * len(blas_threads())] * 2
        # Nothing runs: the budget would give BLAS every core again.
        assert blas_threads() == [1] * len(blas_threads())
        assert aiopar.get_num_threads() == cores()  # the budget's count, for parallel_for
    assert blas_threads() == [cores()] * len(blas_threads())
    assert run_together(2, seen) == [share_of(2)] * 2, "the budget is in charge again"
    assert seen() == (cores(), [cores()] * len(blas_threads()))


@two_cores
def test_a_threadpool_limit_in_another_thread_is_kept_and_reported():
    # scikit-learn and others limit BLAS in whichever thread calls them; the
    # pools are process-wide, so the budget sees it from every thread.
    entered, leave = threading.Event(), threading.Event()
    inside: list[list[int]] = []

    def limited() -> None:
        with threadpool_limits(limits=1, user_api="blas"):
            entered.set()
            leave.wait(10)
            inside.append(blas_threads())

    run_together(2, seen)
    user = threading.Thread(target=limited, name="limits-blas")
    user.start()
    try:
        assert entered.wait(10)
        assert blas_threads() == [1] * len(blas_threads())
        run_together(2, seen)
        aiopar.fork(once_alone(seen)).wait()
        info = aiopar.parallel_info()
        assert "1 thread, set outside aiopar by threadpoolctl in thread 'limits-blas'" in info
        assert "aiopar leaves it alone until that threadpool_limits block ends" in info
    finally:
        leave.set()
        user.join(10)
    assert inside == [[1] * len(blas_threads())]
    assert blas_threads() == [cores()] * len(blas_threads())
    assert "set outside aiopar" not in aiopar.parallel_info()
    assert run_together(2, seen) == [share_of(2)] * 2


@two_cores
def test_a_count_set_through_the_librarys_own_api_is_kept_until_it_is_back():
    import threadpoolctl

    from aiopar._budget import process_wide_setter

    run_together(2, seen)
    libs = [
        lib
        for lib in threadpoolctl.ThreadpoolController().lib_controllers
        if lib.user_api == "blas"
    ]
    for lib in libs:
        process_wide_setter(lib)(1)
    try:
        run_together(2, seen)
        assert blas_threads() == [1] * len(libs)
        info = aiopar.parallel_info()
        assert "1 thread, set outside aiopar" in info
        assert "in thread" not in info
    finally:
        for lib in libs:
            process_wide_setter(lib)(cores())
    assert run_together(2, seen) == [share_of(2)] * 2
    assert seen() == (cores(), [cores()] * len(blas_threads()))


@two_cores
def test_a_threadpool_limit_at_the_count_the_budget_gave_is_kept_too():
    # Two tasks run, so BLAS has one thread when the block opens: its count
    # tells nothing, threadpoolctl's open block does.
    entered, release = threading.Event(), threading.Event()

    def task():
        entered.wait(10)
        return blas_threads()

    def limited() -> list[int]:
        with threadpool_limits(limits=1, user_api="blas"):
            entered.set()
            release.wait(10)
            return blas_threads()

    inside: list[list[int]] = []
    user = threading.Thread(target=lambda: inside.append(limited()), name="limits-blas")
    compute_beside_a_fork()
    futs = [aiopar.fork(task) for _ in range(2)]
    # This thread computes beside them: three count once both have started.
    eventually(lambda: budget.running == 3 and not late(), timeout=10)
    assert blas_threads() == share_of(3)[1]
    user.start()
    aiopar.wait_all(futs)
    settle()  # nothing counts: the budget would give BLAS every core
    assert blas_threads() == [1] * len(blas_threads())
    release.set()
    user.join(10)
    assert inside == [[1] * len(blas_threads())]
    assert run_together(2, seen) == [share_of(2)] * 2, "the budget is in charge again"
    assert seen() == (cores(), [cores()] * len(blas_threads()))


@two_cores
def test_a_threadpool_limit_open_when_aiopar_first_looks_at_blas_is_kept():
    code = """
        import threading
        import numpy, aiopar
        from threadpoolctl import threadpool_info, threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"):
            both = threading.Barrier(2)
            aiopar.wait_all([aiopar.fork(both.wait) for _ in range(2)])
            print([lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"])
    """
    done = run_python(code, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[1]"]


def test_threadpoolctl_tells_which_thread_holds_an_openblas_limit():
    # The budget reads threadpoolctl's private record of the thread inside a
    # threadpool_limits block; a threadpoolctl that moves it must fail here.
    import threadpoolctl

    from aiopar._budget import limiting_thread

    controller = threadpoolctl.ThreadpoolController()
    openblas = [lib for lib in controller.lib_controllers if lib.internal_api == "openblas"]
    if not openblas:
        pytest.skip("numpy here does not use OpenBLAS")
    assert all(limiting_thread(lib) is None for lib in openblas)
    with threadpool_limits(limits=1, user_api="blas"):
        assert all(limiting_thread(lib) is threading.current_thread() for lib in openblas), (
            f"threadpoolctl {threadpoolctl.__version__} no longer records the limiting thread"
        )
    assert all(limiting_thread(lib) is None for lib in openblas)


@two_cores
def test_a_held_library_is_looked_at_again_only_now_and_then(monkeypatch):
    from aiopar import _budget

    monkeypatch.setattr(_budget, "HELD_RECHECK", 60.0)
    run_together(2, seen)
    with threadpool_limits(limits=1, user_api="blas"):
        run_together(2, seen)  # the budget finds BLAS held
        assert budget.held
        with forking_and_waiting_at_once(monkeypatch) as (pool, now):
            changes = count_blas_changes(monkeypatch)
            for _ in range(100):
                pool.fork(int, "1").wait()
            now[0] += 1.0  # rule 4's come-back is due, not yet rule 5's next look
            settle()
        assert len(changes) <= 2, changes
    run_together(2, seen)
    assert not budget.held


def test_set_num_threads_overrides_a_limit_set_elsewhere():
    run_together(2, seen)
    with threadpool_limits(limits=1, user_api="blas"):
        run_together(2, seen)
        aiopar.set_num_threads(2)  # the user's own explicit choice wins
        assert blas_threads() == [2] * len(blas_threads())
        aiopar.set_num_threads(None)
    assert seen() == (cores(), [cores()] * len(blas_threads()))


@pytest.mark.skipif(cores() < 2, reason="a share of one core is the whole core")
def test_a_forker_that_never_waits_stops_counting_once_no_worker_is_busy():
    # It counts beside its forks from the fork on (rule 3) and never blocks
    # in wait, which would end that: its pool going quiet ends it.
    compute_beside_a_fork()
    futs = [aiopar.fork(int, "1") for _ in range(2)]
    assert budget.running >= 2  # this thread and a woken worker
    concurrent.futures.wait(futs, timeout=10)  # not aiopar's wait: no slot hears of it
    settle()
    assert seen() == (cores(), [cores()] * len(blas_threads()))


def test_parallel_info_counts_in_good_english():
    aiopar.set_num_threads(1)
    info = aiopar.parallel_info()
    assert "parallel_for: up to 1 thread (the caller + 0 helpers;" in info


def test_a_thread_count_variable_that_is_not_a_count_is_said_to_be_ignored():
    code = "import aiopar; print(aiopar.get_num_threads()); print(aiopar.parallel_info())"
    env = {**os.environ, "OMP_NUM_THREADS": "abc"}
    env.pop("OPENBLAS_NUM_THREADS", None)
    env.pop("MKL_NUM_THREADS", None)
    out = python("-c", code, env=env, check=True).stdout
    assert out.splitlines()[0] == str(cores()), "the budget decides, as if it were unset"
    assert "note: OMP_NUM_THREADS='abc' is ignored: it is not a whole number >= 1" in out


def test_num_threads_sets_the_count_for_a_block_and_restores_what_was_in_force():
    assert aiopar.get_num_threads() == cores()  # the budget, no task running
    with aiopar.num_threads(1):
        assert seen() == (1, [1] * len(blas_threads()))
        aiopar.set_num_threads(2)  # inside the block: the block restores over it
    assert budget.explicit is None and seen() == (cores(), [cores()] * len(blas_threads()))
    aiopar.set_num_threads(1)
    try:
        with aiopar.num_threads(None):  # the budget inside, the explicit count after
            assert budget.explicit is None
        assert budget.explicit == 1 and budget.explicit_from == "set_num_threads"
        with pytest.raises(ValueError, match=r"num_threads\(n\): n must be a whole number >= 1"):
            aiopar.num_threads(0)  # at the call, before any with
        assert budget.explicit == 1
    finally:
        aiopar.set_num_threads(None)
