"""aiopar.profiler: records, parent links, blocked time, Chrome trace, table."""

from __future__ import annotations

import asyncio
import gzip
import itertools
import json
import os
import sys
import threading
import time
import types
from collections import defaultdict

import anyio
import pytest
from future_helpers import fork_running_until_waited_on
from helpers import run_python
from process_helpers import FileGate, until_opened

import aiopar
from aiopar import _trace
from aiopar.profiler import Profile, profile


def leaf(x: int = 0) -> int:
    time.sleep(0.002)
    return x


def node(n: int) -> int:
    futures = [aiopar.fork(leaf, i) for i in range(n)]
    return sum(aiopar.wait(f) for f in futures)


def by_name(prof: Profile, name: str):
    return [r for r in prof.records if r.name == name]


@pytest.fixture
def thread_backend():
    with aiopar.get_backend("thread", max_workers=2) as backend, aiopar.use_backend(backend):
        yield backend


def test_off_means_no_recorder_and_no_records(thread_backend):
    assert _trace.active is None
    fut = aiopar.fork(leaf, 1)
    assert fut._task.record is None
    fut.wait()
    with profile():
        assert _trace.active is not None
    assert _trace.active is None


def test_records_a_task_on_the_thread_backend(thread_backend):
    with profile() as prof:
        fut = aiopar.fork(leaf, 7)
        assert fut.wait() == 7
    [record] = prof.records
    assert record.name == "leaf"
    assert record.backend == "thread"
    assert record.finished
    assert record.fork_ns <= record.start_ns <= record.end_ns
    assert record.duration_ns >= 1_000_000  # it slept 2 ms
    assert 0 < record.queue_delay_ns == record.start_ns - record.fork_ns
    assert record.worker.pid == os.getpid()
    assert record.forker.name == threading.current_thread().name
    assert record.parent is None


def test_records_inline_tasks_in_the_caller():
    with aiopar.use_backend("inline"), profile() as prof:
        aiopar.fork(leaf, 1).wait()
    [record] = prof.records
    assert record.backend == "inline"
    assert record.worker.tid == threading.get_native_id()
    assert record.worker == record.forker


@pytest.mark.parametrize("backend", ["openmp", "process"])
def test_records_tasks_on_other_backends(backend):
    with aiopar.use_backend(backend), profile() as prof:
        assert aiopar.wait_all([aiopar.fork(leaf, i) for i in range(3)]) == [0, 1, 2]
    records = by_name(prof, "leaf")
    assert len(records) == 3
    for record in records:
        assert record.backend == backend
        assert record.finished, record
        assert record.fork_ns <= record.start_ns <= record.end_ns
        if backend == "process":
            assert record.worker.pid != os.getpid()
    trace = prof.chrome_trace()
    assert sum(e["ph"] == "X" and e["name"] == "leaf" for e in trace["traceEvents"]) == 3


def test_parent_is_the_task_that_forked(thread_backend):
    with profile() as prof:
        assert aiopar.fork(node, 3).wait() == 3
    [parent] = by_name(prof, "node")
    children = by_name(prof, "leaf")
    assert len(children) == 3
    assert parent.parent is None
    assert all(child.parent is parent for child in children)
    assert all(child.forker == parent.worker for child in children)


def test_parent_survives_a_stolen_child(thread_backend):
    # node waits on a leaf that has not started, so it runs the leaf itself:
    # while it does, the leaf is the current task, then node is again.
    def forks_after_stealing() -> None:
        aiopar.fork(leaf).wait()
        aiopar.fork(leaf).wait()

    with profile() as prof:
        aiopar.fork(forks_after_stealing).wait()
    [parent] = by_name(prof, "test_parent_survives_a_stolen_child.<locals>.forks_after_stealing")
    assert [r.parent for r in by_name(prof, "leaf")] == [parent, parent]


def test_blocked_time_is_counted_when_a_wait_blocks(thread_backend):
    def waits_for_slow() -> None:
        fork_running_until_waited_on(then_sleep=0.03).wait()  # it blocks 30 ms at least

    with profile() as prof:
        aiopar.fork(waits_for_slow).wait()
    [waiter] = by_name(
        prof, "test_blocked_time_is_counted_when_a_wait_blocks.<locals>.waits_for_slow"
    )
    assert waiter.blocked_ns >= 30_000_000
    [stats] = [s for s in prof.stats() if s.name == waiter.name]
    assert stats.blocked >= 0.03
    waits = [e for e in prof.chrome_trace()["traceEvents"] if e["name"] == "wait"]
    assert any("lasts_until_waited_on" in e["args"].get("waiting_for", "") for e in waits)


def test_nested_profiles_each_record_what_was_forked_while_open(thread_backend):
    with profile() as outer:
        aiopar.fork(leaf, 1).wait()
        with profile() as inner:
            aiopar.fork(leaf, 2).wait()
        aiopar.fork(leaf, 3).wait()
    assert len(outer.records) == 3
    assert len(inner.records) == 1
    assert inner.records[0] is outer.records[1]
    assert _trace.active is None


def test_reentering_an_open_profile_is_an_error():
    with profile() as prof, pytest.raises(RuntimeError, match="already recording"), prof:
        pass


def test_records_forks_from_other_threads(thread_backend):
    def user_thread() -> None:
        aiopar.fork(leaf, 5).wait()

    with profile() as prof:
        thread = threading.Thread(target=user_thread, name="user-thread")
        thread.start()
        thread.join()
    [record] = prof.records
    assert record.forker.name == "user-thread"


def test_a_task_that_ends_after_the_profile_closes_is_completed(thread_backend):
    gate = threading.Event()
    with profile() as prof:
        fut = aiopar.fork(gate.wait, 5)
    gate.set()
    fut.wait()
    [record] = prof.records
    assert record.finished


def test_cancelled_tasks_are_unfinished_and_left_out_of_the_trace():
    gate = threading.Event()
    with aiopar.get_backend("thread", max_workers=1) as backend, profile() as prof:
        blocker = backend.fork(gate.wait, 5)
        queued = backend.fork(leaf, 1)
        assert queued.cancel()
        gate.set()
        blocker.wait()
    [leaf_stats] = [s for s in prof.stats() if s.name == "leaf"]
    assert (leaf_stats.count, leaf_stats.unfinished) == (0, 1)
    assert "unfinished" in prof.table()
    names = {e["name"] for e in prof.chrome_trace()["traceEvents"] if e["ph"] == "X"}
    assert "leaf" not in names


def check_trace_schema(trace: dict) -> None:
    """What chrome://tracing and Perfetto need from a Trace Event JSON file."""
    events = trace["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert slices
    for e in slices:
        assert isinstance(e["name"], str)
        for key in ("ts", "dur", "pid", "tid"):
            assert isinstance(e[key], int | float), (key, e)
        assert e["dur"] > 0, e  # every slice is something that took time
    flows = [e for e in events if e["ph"] in ("s", "f")]
    starts = {e["id"]: e for e in flows if e["ph"] == "s"}
    finishes = {e["id"]: e for e in flows if e["ph"] == "f"}
    assert len(starts) == len(finishes) == len(flows) / 2
    assert starts.keys() == finishes.keys()
    for flow in flows:
        # each end binds to a slice enclosing it on its own thread
        assert any(
            s["pid"] == flow["pid"]
            and s["tid"] == flow["tid"]
            and s["ts"] <= flow["ts"] <= s["ts"] + s["dur"]
            for s in slices
        ), flow
    for fid, start in starts.items():
        assert start["ts"] <= finishes[fid]["ts"]
        assert finishes[fid]["bp"] == "e"
    named_threads = {(e["pid"], e["tid"]) for e in events if e["name"] == "thread_name"}
    named_processes = {e["pid"] for e in events if e["name"] == "process_name"}
    for e in slices + flows:
        assert (e["pid"], e["tid"]) in named_threads, e
        assert e["pid"] in named_processes, e
    # Slices of one row nest or follow each other: viewers drop the others.
    rows = defaultdict(list)
    for e in slices:
        rows[e["pid"], e["tid"]].append(e)
    for row in rows.values():
        open_ends: list[float] = []
        for e in sorted(row, key=lambda e: (e["ts"], -e["dur"])):
            while open_ends and open_ends[-1] <= e["ts"]:
                open_ends.pop()
            assert not open_ends or e["ts"] + e["dur"] <= open_ends[-1], ("overlap", e)
            open_ends.append(e["ts"] + e["dur"])


def test_chrome_trace_schema_and_export(thread_backend, tmp_path):
    with profile() as prof:
        futures = [aiopar.fork(node, 2) for _ in range(3)]
        aiopar.wait_all(futures)
        with aiopar.use_backend("inline"):
            aiopar.fork(leaf).wait()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(path)
    trace = json.loads(path.read_text())
    check_trace_schema(trace)
    task_slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "profile"]
    assert sum(e["name"] == "node" for e in task_slices) == 3
    assert sum(e["name"] == "leaf" for e in task_slices) == 7
    assert len([e for e in trace["traceEvents"] if e["ph"] == "s"]) == 10
    leaf_args = [e["args"] for e in task_slices if e["name"] == "leaf"]
    node_ids = {e["args"]["task"] for e in task_slices if e["name"] == "node"}
    assert sum(args["parent"] in node_ids for args in leaf_args) == 6


def test_export_gzip(thread_backend, tmp_path):
    with profile() as prof:
        aiopar.fork(leaf).wait()
    path = tmp_path / "trace.json.gz"
    prof.export_chrome_trace(path)
    check_trace_schema(json.loads(gzip.decompress(path.read_bytes())))


def test_export_to_an_unwritable_path_raises_oserror(tmp_path):
    with profile() as prof:
        pass
    with pytest.raises(OSError):
        prof.export_chrome_trace(tmp_path / "missing-dir" / "trace.json")


def test_worker_process_times_land_in_their_own_row():
    # What the process backend reports for a task that ran in a worker process.
    with aiopar.use_backend("inline"), profile() as prof:
        fut = aiopar.fork(leaf)
    record = prof.records[0]
    fut.wait()
    now = time.perf_counter_ns()
    record.on_remote_run(now - 2000, now - 1000, pid=424242)
    assert record.worker.pid == 424242
    assert record.duration_ns == 1000
    trace = prof.chrome_trace()
    check_trace_schema(trace)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert "aiopar worker process (pid 424242)" in names


def test_table_and_stats(thread_backend):
    with profile() as prof:
        aiopar.fork(node, 4).wait()
    stats = {s.name: s for s in prof.stats()}
    assert stats["leaf"].count == 4
    assert stats["node"].count == 1
    assert stats["leaf"].backends == ("thread",)
    assert stats["leaf"].max >= stats["leaf"].mean >= 0.001
    assert stats["leaf"].total == pytest.approx(stats["leaf"].mean * 4)
    assert stats["node"].total >= stats["leaf"].max
    assert [s.name for s in prof.stats("name")] == ["leaf", "node"]
    text = prof.table()
    for word in ("task", "count", "total", "mean", "max", "queue", "blocked", "leaf", "node"):
        assert word in text
    assert "5 tasks" in text
    assert prof.table(row_limit=1).count("leaf") + prof.table(row_limit=1).count("node") == 1
    with pytest.raises(ValueError, match="sort_by"):
        prof.stats("fastest")


# -- coroutine forks ------------------------------------------------------------


async def pause_twice(x: int) -> int:
    """Two awaits of the event loop and one of a thread task in between."""
    await anyio.sleep(0.02)
    value = await aiopar.fork(leaf, x)
    await anyio.sleep(0.02)
    return value


def check_coroutine_record(record, name: str = "pause_twice") -> None:
    assert record.name == name and record.is_coroutine and record.finished
    steps = record.steps
    assert len(steps) >= 3, steps  # split by at least the two sleeps and the fork
    assert steps[0][0] == record.start_ns and steps[-1][1] == record.end_ns
    assert all(b <= e for b, e in steps)
    assert all(e1 <= b2 for (_, e1), (b2, _) in itertools.pairwise(steps))
    assert record.awaiting_ns >= 30_000_000, "the 40 ms of sleeps are awaits, not steps"
    assert record.duration_ns == record.awaiting_ns + sum(e - b for b, e in steps)


def coroutine_slices(trace: dict, record) -> list[dict]:
    return [
        e
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["cat"] == "coroutine" and e["args"]["task"] == record.id
    ]


@pytest.mark.anyio
async def test_records_a_coroutine_fork_on_the_callers_loop(anyio_backend):
    library = "uvloop" if anyio_backend[1].get("use_uvloop") else anyio_backend[0]
    with profile() as prof:
        assert await aiopar.fork(pause_twice, 3) == 3
    [record] = by_name(prof, "pause_twice")
    check_coroutine_record(record)
    assert record.backend == library
    assert record.worker.tid == threading.get_native_id(), "ran on this loop's thread"
    assert record.forker == record.worker and record.parent is None
    [child] = by_name(prof, "leaf")
    assert child.parent is record and child.forker == record.worker

    trace = prof.chrome_trace()
    check_trace_schema(trace)
    slices = coroutine_slices(trace, record)
    assert len(slices) == len(record.steps)
    assert {(e["pid"], e["tid"]) for e in slices} == {(os.getpid(), record.worker.tid)}
    [row] = [
        e["args"]["name"]
        for e in trace["traceEvents"]
        if e["name"] == "thread_name" and e["tid"] == record.worker.tid
    ]
    assert f"{library} event loop" in row
    stats = {s.name: s for s in prof.stats()}
    assert stats["pause_twice"].awaiting >= 0.03
    assert "awaiting" in prof.table()


def test_records_coroutine_forks_on_aiopars_loop_and_their_parent_task(thread_backend):
    def forks_a_coroutine() -> int:
        return aiopar.fork(pause_twice, 5).wait()

    with profile() as prof:
        assert aiopar.fork(forks_a_coroutine).wait() == 5
    [task] = by_name(
        prof,
        "test_records_coroutine_forks_on_aiopars_loop_and_their_parent_task."
        "<locals>.forks_a_coroutine",
    )
    [record] = by_name(prof, "pause_twice")
    check_coroutine_record(record)
    assert record.worker.name == "aiopar-loop"
    assert record.parent is task and record.forker == task.worker
    trace = prof.chrome_trace()
    check_trace_schema(trace)  # the fork's arrow leads from the task to the first step
    [flow_end] = [e for e in trace["traceEvents"] if e["ph"] == "f" and e["id"] == record.id]
    assert flow_end["tid"] == record.worker.tid


@pytest.mark.anyio
async def test_a_failing_coroutine_ends_its_record_and_leaves_the_thread_as_it_was():
    async def fails() -> None:
        await anyio.sleep(0)
        raise ValueError("in the coroutine")

    with profile() as prof:
        with pytest.raises(ValueError, match="in the coroutine"):
            await aiopar.fork(fails)
        assert await aiopar.fork(leaf, 1) == 1
    [record] = [r for r in prof.records if r.is_coroutine]
    assert record.finished and len(record.steps) == 2
    [after] = by_name(prof, "leaf")
    assert after.parent is None, "the failed coroutine is no longer this thread's task"


@pytest.mark.anyio
async def test_off_a_coroutine_fork_is_awaited_as_it_is():
    # No profile open: nothing stands between the runner and the coroutine.
    async def caller_name() -> str:
        return sys._getframe(1).f_code.co_name

    assert await aiopar.fork(caller_name) == "run"
    with profile():
        assert await aiopar.fork(caller_name) == "_run_in_steps"


@types.coroutine
def suspend_once():
    yield "suspended"


@pytest.mark.parametrize("how", ["close", "throw"])
def test_a_coroutine_closed_or_thrown_into_while_suspended(how):
    # What a loop does to a task it cancels (throw) or drops unfinished (close).
    left = []

    async def suspends() -> None:
        try:
            await suspend_once()
        finally:
            left.append(sys.exc_info()[0])

    with profile():
        record = _trace.active.on_fork_coroutine(suspends)
    steps = record.run_in_steps(suspends, (), {})
    assert steps.send(None) == "suspended"
    if how == "close":
        steps.close()
        assert left == [GeneratorExit]
    else:
        with pytest.raises(KeyError):
            steps.throw(KeyError("thrown in"))
        assert left == [KeyError]
    assert record.finished and len(record.steps) == 2


# -- forks inside worker processes ------------------------------------------------


@pytest.fixture(scope="module")
def process_pool():
    from aiopar.backends.process import ProcessBackend

    with ProcessBackend(max_workers=1) as pool:
        yield pool


def forks_leaves(n: int) -> int:
    """Run in a worker process: fork ``n`` leaves there and wait for them."""
    return sum(aiopar.wait_all([aiopar.fork(leaf, i) for i in range(n)]))


def forks_everything() -> tuple[int, int]:
    """Run in a worker process: a nested thread fork, a coroutine forked onto
    aiopar's loop there, and a coroutine on a loop of its own."""

    async def on_its_own_loop() -> int:
        return await aiopar.fork(pause_twice, 2)

    nested = aiopar.fork(node, 2).wait()
    coroutine = aiopar.fork(pause_twice, 1).wait()
    return nested + coroutine, asyncio.run(on_its_own_loop())


def waits_for_a_running_fork() -> None:
    """Run in a worker process: block in wait there for 10 ms at least."""
    fork_running_until_waited_on(then_sleep=0.01).wait()


def test_forks_inside_a_worker_process_land_on_its_rows(process_pool):
    with profile() as prof:
        before = time.perf_counter_ns()
        assert process_pool.fork(forks_leaves, 3).wait() == 3
        after = time.perf_counter_ns()
    [task] = by_name(prof, "forks_leaves")
    leaves = by_name(prof, "leaf")
    assert len(leaves) == 3
    worker_pid = task.worker.pid
    assert worker_pid != os.getpid()
    for record in leaves:
        assert record.parent is task and record.forker == task.worker
        assert record.backend == "thread" and record.finished
        assert record.worker.pid == worker_pid
        # One clock in both processes: the worker's times nest in this one's.
        assert before <= task.start_ns <= record.fork_ns <= record.start_ns
        assert record.start_ns <= record.end_ns <= task.end_ns <= after
    assert [r.name for r in prof.records] == ["forks_leaves", "leaf", "leaf", "leaf"]
    assert {s.name: s.count for s in prof.stats()} == {"forks_leaves": 1, "leaf": 3}

    trace = prof.chrome_trace()
    check_trace_schema(trace)
    events = trace["traceEvents"]
    flows = {e["id"]: e for e in events if e["ph"] == "s"}
    for record in leaves:
        # The arrow leaves the task's row in the worker, at the fork.
        assert (flows[record.id]["pid"], flows[record.id]["tid"]) == (worker_pid, worker_pid)
    rows = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert rows[worker_pid, worker_pid] == task.worker.name == "process worker 0"
    assert {pid for pid, _ in rows} == {os.getpid(), worker_pid}


def test_waits_inside_a_worker_process_count_for_its_task(process_pool):
    with profile() as prof:
        process_pool.fork(waits_for_a_running_fork).wait()
    [task, slow] = prof.records
    assert slow.parent is task
    assert task.blocked_ns >= 10_000_000
    waits = [e for e in prof.chrome_trace()["traceEvents"] if e["name"] == "wait"]
    [in_worker] = [e for e in waits if e["pid"] == task.worker.pid]
    assert in_worker["tid"] == task.worker.tid
    assert in_worker["args"]["waiting_for"] == f"#{slow.id} {slow.name}"
    assert in_worker["dur"] * 1000 <= task.blocked_ns + 1000


def test_coroutines_and_nested_forks_inside_a_worker_process(process_pool):
    with profile() as prof:
        assert process_pool.fork(forks_everything).wait() == (2, 2)
    [task] = by_name(prof, "forks_everything")
    [nested] = by_name(prof, "node")
    assert nested.parent is task
    assert sorted(r.parent.name for r in by_name(prof, "leaf")) == [
        "node",
        "node",
        "pause_twice",
        "pause_twice",
    ]
    coroutines = by_name(prof, "pause_twice")
    assert len(coroutines) == 2
    for record in coroutines:
        check_coroutine_record(record)
        assert record.worker.pid == task.worker.pid and record.parent is task
    by_row = {r.worker.name: r.backend for r in coroutines}
    assert by_row.keys() == {"aiopar-loop", "process worker 0"}
    assert by_row["process worker 0"] == "asyncio"  # asyncio.run in the task
    check_trace_schema(prof.chrome_trace())


def test_a_worker_records_nothing_unless_its_parent_profiles():
    from aiopar.backends.process import ProcessBackend

    def forks_two() -> int:
        return sum(aiopar.wait_all([aiopar.fork(abs, -i) for i in range(2)]))

    def recording() -> bool:
        from aiopar import _trace

        return _trace.active is not None

    with ProcessBackend(max_workers=1) as fresh:
        assert fresh.fork(forks_two).wait() == 1
        assert fresh.fork(recording).wait() is False
        with profile() as prof:
            assert fresh.fork(forks_two).wait() == 1
            assert fresh.fork(recording).wait() is True  # while its own task runs
        assert [r.name for r in prof.records].count("abs") == 2
        assert fresh.fork(recording).wait() is False  # and only then
        with profile() as prof:
            assert fresh.fork(int, "7").wait() == 7  # forks nothing: no report
        assert [r.name for r in prof.records] == ["int"]


def test_the_recorder_registers_with_the_seam_when_aiopar_loads():
    # A worker process imports aiopar, never the profiler: that is how its
    # capture_forks() finds the recorder (the seam imports nothing).
    done = run_python(
        """
        from aiopar import _trace

        capture = _trace.capture_forks()
        print(type(capture).__module__, capture.report())
        """
    )
    assert done.stdout.split() == ["aiopar.profiler._recorder", "None"], done.stderr


def test_a_fork_still_running_when_its_process_task_returns_is_unfinished(process_pool, tmp_path):
    gate = FileGate(tmp_path / "gate")

    def leaves_one_running() -> None:
        aiopar.fork(until_opened, gate.path)

    with profile() as prof:
        process_pool.fork(leaves_one_running).wait()
    gate.open()
    [task, running] = prof.records
    assert running.parent is task and not running.finished
    [stats] = [s for s in prof.stats() if s.name == "until_opened"]
    assert (stats.count, stats.unfinished) == (0, 1)
    check_trace_schema(prof.chrome_trace())


def test_a_worker_report_that_cannot_be_read_is_logged_not_raised(caplog):
    # It is read in the thread that reads the workers' results: raising there
    # would fail the whole pool.
    with aiopar.use_backend("inline"), profile() as prof:
        aiopar.fork(leaf).wait()
    [record] = prof.records
    record.on_remote_forks(("not", "a report"))
    assert prof.records == [record]
    assert "could not read what" in caplog.text
