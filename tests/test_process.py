"""The "process" backend: any callable, zero-copy numpy, errors, the core's
guarantees on it, callbacks, import paths and payloads.

Whatever could hang (exit, shutdown, signals, fork) runs in a subprocess with
a timeout, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import functools
import gc
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import weakref

import numpy as np
import process_helpers
import pytest
from helpers import eventually
from process_helpers import (
    FileGate,
    Scaler,
    add,
    die_once_opened,
    double,
    echo,
    explicit_process_fork,
    fail_deep,
    nested_fork,
    raise_unpicklable,
    return_lock,
    run_script,
    sleep_then,
    until_opened,
)

import aiopar
from aiopar import _trace
from aiopar.backends.process import ProcessBackend, RemoteError, RemoteTraceback

# The shared fixtures; nothing_left_behind checks every test (autouse).
nothing_left_behind = process_helpers.nothing_left_behind
pool = process_helpers.pool
own_pool = process_helpers.own_pool


# -- registry and basic forks ----------------------------------------------------


def test_registered_and_forks_run_in_other_processes():
    assert "process" in aiopar.available_backends()
    backend = aiopar.get_backend("process")
    assert isinstance(backend, ProcessBackend)
    assert backend.max_workers == len(os.sched_getaffinity(0))
    with aiopar.use_backend("process"):
        pid = aiopar.fork(os.getpid).wait()
    assert pid != os.getpid()
    backend.shutdown()


def test_any_callable(pool):
    factor = 3
    assert pool.fork(lambda x: x + 1, 1).wait() == 2
    assert pool.fork(lambda x: x * factor, 2).wait() == 6  # a closure
    assert pool.fork(add, 1, b=2).wait() == 3
    assert pool.fork(Scaler(4).scale, 2).wait() == 8  # a bound method
    assert pool.fork(Scaler(5), 2).wait() == 10  # a callable object
    assert pool.fork(functools.partial(add, 10), 5).wait() == 15
    assert pool.fork(sorted, [3, 1, 2]).wait() == [1, 2, 3]


def test_function_defined_in_main_travels_by_value(pool):
    namespace = {"__name__": "__main__"}
    exec("K = 7\ndef main_fn(x):\n    return x * K\n", namespace)
    fn = namespace["main_fn"]
    assert fn.__module__ == "__main__"
    assert pool.fork(fn, 6).wait() == 42
    namespace["K"] = 8  # a rebound global is seen by the next fork
    assert pool.fork(fn, 6).wait() == 48


def test_workers_start_lazily_and_are_reused(own_pool):
    backend = own_pool(2)
    assert backend._pool.workers == []
    pids = {backend.fork(os.getpid).wait() for _ in range(20)}
    assert len(pids) <= 2
    assert os.getpid() not in pids


def test_nested_fork_runs_in_the_worker_on_threads(pool):
    outer_pid, (inner_pid, backend_name) = pool.fork(nested_fork).wait()
    assert outer_pid == inner_pid != os.getpid()
    assert backend_name == "thread"
    assert pool.fork(explicit_process_fork).wait() != os.getpid()


# -- numpy -------------------------------------------------------------------------


def test_large_arrays_round_trip_through_shared_memory(pool):
    a = np.arange(2_000_000, dtype=np.float64)  # 16 MB
    b = pool.fork(double, a).wait()
    np.testing.assert_array_equal(b, a * 2)
    assert b.flags.writeable
    b[0] = 1.0  # our own memory now
    # Segments are reused, not piled up.
    for _ in range(5):
        pool.fork(echo, a).wait()
    segments = pool._pool.segments
    assert len(segments._free) + len(segments._busy) <= 2


def test_small_and_odd_arrays(pool):
    small = np.arange(10, dtype=np.int32)
    np.testing.assert_array_equal(pool.fork(echo, small).wait(), small)
    strided = np.arange(200_000, dtype=np.float64)[::3]  # not contiguous: pickled in-band
    np.testing.assert_array_equal(pool.fork(echo, strided).wait(), strided)
    fortran = np.asfortranarray(np.arange(120_000, dtype=np.float32).reshape(300, 400))
    out = pool.fork(echo, fortran).wait()
    np.testing.assert_array_equal(out, fortran)
    several = [np.full(100_000, i, dtype=np.uint8) for i in range(3)]
    for i, arr in enumerate(pool.fork(echo, several).wait()):
        assert arr.shape == (100_000,) and (arr == i).all()
    assert pool.fork(bytes, bytearray(b"x" * 200_000)).wait() == b"x" * 200_000


# -- errors ----------------------------------------------------------------------


def test_unpicklable_argument_raises_at_fork(pool):
    with pytest.raises(TypeError, match=r"argument 1 \(a _thread\.lock\)"):
        pool.fork(add, 1, threading.Lock())
    with pytest.raises(TypeError, match=r"keyword argument 'b' \(a _thread\.lock\)"):
        pool.fork(add, 1, b=threading.Lock())
    assert pool.fork(add, 1, 2).wait() == 3


def test_unpicklable_result_raises_at_wait(pool):
    with pytest.raises(TypeError, match=r"return_lock returned a _thread\.lock"):
        pool.fork(return_lock).wait()
    assert pool.fork(add, 1, 2).wait() == 3


def test_remote_exception_keeps_type_and_traceback(pool):
    with pytest.raises(ValueError, match="on purpose") as info:
        pool.fork(fail_deep).wait()
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback)
    assert "inner_helper" in cause.tb and "fail_deep" in cause.tb
    assert "_process_worker" not in cause.tb  # starts at the user's code


def test_unpicklable_exception_has_a_stand_in(pool):
    with pytest.raises(RemoteError, match="Unpicklable: carries a lock") as info:
        pool.fork(raise_unpicklable).wait()
    assert "raise_unpicklable" in info.value.__cause__.tb


def test_task_that_cannot_be_unpickled_in_the_worker(pool):
    namespace = {"__name__": "not_importable_anywhere"}
    exec("def f():\n    return 1\n", namespace)
    sys.modules["not_importable_anywhere"] = type(sys)("not_importable_anywhere")
    try:
        sys.modules["not_importable_anywhere"].f = namespace["f"]
        with pytest.raises(ModuleNotFoundError) as info:
            pool.fork(namespace["f"]).wait()
        assert "unpickling the task in a worker" in "".join(info.value.__notes__)
    finally:
        del sys.modules["not_importable_anywhere"]


# -- the rest of the core works unchanged ------------------------------------------


def test_then_task_group_and_as_completed(pool):
    assert pool.fork(add, 1, 2).then(lambda f: f.value() * 10).wait() == 30
    with aiopar.use_backend(pool), aiopar.task_group() as tg:
        futures = [tg.fork(add, i, i) for i in range(5)]
    assert [f.value() for f in futures] == [0, 2, 4, 6, 8]
    done = list(aiopar.as_completed([pool.fork(sleep_then, 0.05 * i, i) for i in (3, 1, 2)]))
    assert sorted(f.value() for f in done) == [1, 2, 3]
    assert aiopar.wait_all([pool.fork(add, 1), pool.fork(add, 2)]) == [1, 2]


@pytest.mark.anyio
async def test_await_on_every_loop(pool):
    assert await pool.fork(add, 20, 22) == 42
    big = np.ones(100_000)
    assert (await pool.fork(double, big)).sum() == 200_000
    with pytest.raises(ValueError, match="on purpose"):
        await pool.fork(fail_deep)
    with aiopar.use_backend(pool):
        assert await aiopar.fork(os.getpid) != os.getpid()


def test_profiler_gets_the_worker_times(pool, monkeypatch):
    class Record:
        remote = None

        def on_remote_run(self, start_ns, end_ns, pid, tid=None, thread_name=None):
            self.remote = (start_ns, end_ns, pid, tid, thread_name)

    records = []

    class Recorder:
        def on_fork(self, task):
            records.append(Record())
            return records[-1]

        def on_blocked(self, *args):
            pass

    monkeypatch.setattr(_trace, "active", Recorder())
    before = _trace.clock()
    pool.fork(sleep_then, 0.01, None).wait()
    after = _trace.clock()
    monkeypatch.setattr(_trace, "active", None)
    start, end, pid, tid, thread_name = records[0].remote
    assert pid != os.getpid() and tid == pid
    assert "worker" in thread_name
    assert before <= start < end <= after
    assert end - start >= 10_000_000


def test_aiopar_profiler_shows_the_worker(pool):
    from aiopar import profiler

    with profiler.profile() as prof:
        pool.fork(sleep_then, 0.01, None).wait()
    assert "sleep_then" in str(prof.table())


def test_a_done_callback_may_wait_on_another_process_task(own_pool):
    # Callbacks run in the thread that reads results; one that blocks there
    # must not stop the result it waits for from arriving.
    pool = own_pool(2)
    chained = pool.fork(add, 1, 1).then(lambda f: pool.fork(add, f.value(), 1).wait())
    assert chained.wait(timeout=30) == 3
    assert pool.fork(add, 2, 2).wait(timeout=30) == 4


def test_a_callback_may_block_several_times(own_pool):
    pool = own_pool(2)

    def chain(fut):
        first = pool.fork(add, fut.value(), 1).wait()
        return pool.fork(add, first, 1).wait()

    assert pool.fork(add, 1, 0).then(chain).wait(timeout=30) == 3
    assert pool.fork(add, 5, 5).wait(timeout=30) == 10


def test_many_threads_fork_at_once(pool):
    results = {}

    def client(k):
        results[k] = [pool.fork(add, k, i).wait() for i in range(30)]

    threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == {k: [k + i for i in range(30)] for k in range(6)}


def test_no_descriptor_outlives_the_backend():
    before = set(os.listdir("/proc/self/fd"))
    backend = ProcessBackend(2)
    a = np.ones(1_000_000)
    results = [backend.fork(double, a) for _ in range(4)]
    assert all((f.wait() == 2).all() for f in results)
    backend.shutdown()
    del results
    gc.collect()  # a future and its task refer to each other
    assert set(os.listdir("/proc/self/fd")) - before == set()


def test_received_arrays_hold_no_descriptors(pool):
    before = len(os.listdir("/proc/self/fd"))
    kept = [pool.fork(double, np.ones(20_000)).wait() for _ in range(40)]  # 160 kB each
    assert len(os.listdir("/proc/self/fd")) - before < 5
    assert all((k == 2).all() for k in kept)


def test_a_kept_future_does_not_keep_the_arguments(pool):
    a = np.ones(100_000)
    ref = weakref.ref(a)
    fut = pool.fork(double, a)
    del a
    fut.wait()
    assert ref() is None


def test_classes_from_main_come_back_as_themselves(pool):
    namespace = {"__name__": "__main__"}
    exec(
        textwrap.dedent(
            """
            class MainError(Exception):
                pass

            class Point:
                def __init__(self, x):
                    self.x = x

            def boom(p):
                raise MainError(f"bad point {p.x}")

            def make(x):
                return Point(x)
            """
        ),
        namespace,
    )
    with pytest.raises(namespace["MainError"], match="bad point 3"):
        pool.fork(namespace["boom"], namespace["Point"](3)).wait()
    point = pool.fork(namespace["make"], 5).wait()
    assert type(point) is namespace["Point"] and point.x == 5


@pytest.mark.parametrize("how", ["file", "stdin"])
def test_an_unguarded_script_starts_its_workers_once(how, tmp_path):
    # Workers are fresh interpreters: multiprocessing's spawn would run the
    # script again in each, and cannot start any for a script read from stdin.
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import os, aiopar\n"
        'print("the script starts", flush=True)\n'
        'with aiopar.use_backend("process", max_workers=2):\n'
        "    pids = aiopar.wait_all([aiopar.fork(os.getpid) for _ in range(4)])\n"
        'print("elsewhere:", os.getpid() not in pids)\n'
    )
    with script.open() as source:
        done = subprocess.run(
            [sys.executable, script.name if how == "file" else "-"],
            stdin=subprocess.DEVNULL if how == "file" else source,
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=60,
        )
    assert (done.returncode, done.stdout) == (0, "the script starts\nelsewhere: True\n"), done


def test_prefetch_adapts_to_task_length(own_pool):
    backend = own_pool(1)
    aiopar.wait_all([backend.fork(add, i) for i in range(200)])
    assert backend._pool.prefetch_depth() > 4  # tiny tasks: several queued per worker
    aiopar.wait_all([backend.fork(sleep_then, 0.01, i) for i in range(30)])
    assert backend._pool.prefetch_depth() == 1  # 10 ms tasks: one


def test_deeply_prefetched_tasks_survive_a_crash(own_pool, tmp_path):
    backend = own_pool(1)
    aiopar.wait_all([backend.fork(add, i) for i in range(200)])
    gate = FileGate(tmp_path / "gate")
    doomed = backend.fork(die_once_opened, gate.path)
    queued = [backend.fork(add, i, 1) for i in range(40)]
    assert len(backend._pool.workers[0].inflight) > 2  # prefetched behind the doomed task
    gate.open()
    with pytest.raises(aiopar.BrokenWorkerError, match="SIGKILL"):
        doomed.wait(timeout=30)
    assert [f.wait(timeout=30) for f in queued] == [i + 1 for i in range(40)]


def test_big_values_without_buffers_take_the_socket(pool):
    words = [f"word {i}" for i in range(300_000)]  # a few MB of pickle, no buffers
    assert pool.fork(list, words).wait() == words
    futures = [pool.fork(sorted, words[i::7]) for i in range(7)]
    assert [f.wait() for f in futures] == [sorted(words[i::7]) for i in range(7)]


# -- callbacks ---------------------------------------------------------------------


@pytest.mark.parametrize("exc_type", [SystemExit, KeyboardInterrupt, asyncio.CancelledError])
def test_any_exception_from_a_callback_is_logged_and_the_pool_lives_on(
    own_pool, caplog, tmp_path, exc_type
):
    backend = own_pool(1)
    gate = FileGate(tmp_path / "gate")
    fut = backend.fork(until_opened, gate.path, "value")
    ran = []

    def callback(f):
        ran.append(f.value())
        raise exc_type("raised by a done-callback")

    fut.add_done_callback(callback)  # before the task ends: it runs in the manager thread
    gate.open()
    with caplog.at_level(logging.ERROR, logger="aiopar"):
        assert fut.wait(timeout=30) == "value"
        eventually(lambda: ran == ["value"] and exc_type.__name__ in caplog.text)
    assert "done-callback" in caplog.text
    assert not backend.closed
    assert [backend.fork(add, i, 1).wait(timeout=30) for i in range(3)] == [1, 2, 3]


# -- import paths ------------------------------------------------------------------------


def test_a_shadowing_module_in_the_working_directory_never_runs_in_a_worker(
    own_pool, tmp_path, monkeypatch
):
    (tmp_path / "json.py").write_text(
        "import pathlib\npathlib.Path('shadow-ran').touch()\nraise ImportError('json.py ran')\n"
    )
    monkeypatch.chdir(tmp_path)
    backend = own_pool(1)
    assert backend.fork(abs, -2).wait(timeout=30) == 2
    assert not (tmp_path / "shadow-ran").exists()


def test_a_path_added_after_the_workers_started_reaches_them(pool, tmp_path, monkeypatch):
    assert pool.fork(add, 1).wait() == 1  # the workers run with the old path
    name = "aiopar_late_path_module"
    (tmp_path / f"{name}.py").write_text("def triple(x):\n    return 3 * x\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = __import__(name)
    try:
        assert pool.fork(module.triple, 5).wait(timeout=30) == 15
        assert pool.fork(module.triple, 6).wait(timeout=30) == 18  # sent once, kept
    finally:
        del sys.modules[name]


# -- payloads -----------------------------------------------------------------------------


class Holder:
    def __init__(self, array):
        self.array = array


def in_place(a):
    a[:] = 0


def fill(n, value):
    return np.full(n, value)[::2]  # a strided result


def test_every_kind_of_payload_round_trips(pool):
    mib = 1 << 20
    blob = os.urandom(8 * mib)
    assert pool.fork(bytes, blob).wait() == blob  # bytes argument and result
    text = "na\u00efve " * mib
    assert pool.fork(str.upper, text).wait() == text.upper()
    numbers = list(range(500_000))
    assert pool.fork(list, numbers).wait() == numbers
    base = np.arange(4_000_000, dtype=np.float64)
    captured = base[:1_000_000] * 2

    def closure():
        return captured.sum()

    assert pool.fork(closure).wait() == captured.sum()
    strided = base[::3]
    np.testing.assert_array_equal(pool.fork(np.negative, strided).wait(), -strided)
    grid = base.reshape(2000, 2000)[::2, 1::3]  # strided both ways
    np.testing.assert_array_equal(pool.fork(np.negative, grid).wait(), -grid)
    # A closure among the arguments: pickled a second time, by cloudpickle.
    assert pool.fork(lambda f, x: f() + x.sum(), lambda: 1, grid).wait() == 1 + grid.sum()
    fortran = np.asfortranarray(base.reshape(2000, 2000))
    out = pool.fork(np.copy, fortran, order="F").wait()
    np.testing.assert_array_equal(out, fortran)
    assert out.flags.f_contiguous
    np.testing.assert_array_equal(pool.fork(fill, 400_000, 7.0).wait(), np.full(200_000, 7.0))
    nested = {"a": [Holder(base[1::2])]}
    assert pool.fork(lambda d: d["a"][0].array.sum(), nested).wait() == base[1::2].sum()


def test_a_worker_changes_its_own_copy_of_an_array(pool):
    a = np.ones(100_000)
    pool.fork(in_place, a).wait()
    assert (a == 1).all()


def test_shared_memory_goes_back_when_a_worker_dies_or_a_task_fails(own_pool):
    backend = own_pool(1)
    big = np.ones(2_000_000)
    with pytest.raises(aiopar.BrokenWorkerError):
        backend.fork(_die_holding, big).wait(timeout=30)
    with pytest.raises(ValueError, match="on purpose"):
        backend.fork(_fail_holding, big).wait(timeout=30)
    assert backend.fork(np.sum, big).wait(timeout=30) == big.size
    eventually(lambda: not backend._pool.segments._busy)


def _die_holding(a):
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_holding(a):
    raise ValueError("failed on purpose")


# -- waiting ------------------------------------------------------------------------


def test_threads_waiting_on_tasks_queued_on_one_worker_all_get_their_values(own_pool):
    backend = own_pool(1, prefetch=8)
    futures = [backend.fork(sleep_then, 0.01, i) for i in range(8)]
    results = {}

    def wait(i):
        results[i] = futures[i].result()

    threads = [threading.Thread(target=wait, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {i: i for i in range(8)}


def test_ctrl_c_at_any_point_of_forks_and_waits_loses_nothing(tmp_path):
    # SIGINT lands at random points of sequential forks and waits on the
    # main thread: each KeyboardInterrupt ends one fork or wait, and the
    # pool goes on with no frame lost or sent twice.
    done = run_script(
        tmp_path,
        """
        import os, random, signal, threading, time
        import aiopar

        backend = aiopar.get_backend("process", max_workers=1)
        assert backend.fork(abs, -1).wait() == 1
        stop = threading.Event()
        go = threading.Event()  # a SIGINT outside the try below would end the script

        def interrupt():
            go.wait()
            rng = random.Random(0)
            while not stop.wait(rng.uniform(0.0005, 0.003)):
                os.kill(os.getpid(), signal.SIGINT)

        helper = threading.Thread(target=interrupt)
        helper.start()
        interrupted = checked = 0
        deadline = time.monotonic() + 20
        while interrupted < 300 and time.monotonic() < deadline:
            try:
                go.set()  # here, where a KeyboardInterrupt is caught
                fut = backend.fork(abs, -checked)
                assert fut.wait() == checked
                checked += 1
            except KeyboardInterrupt:
                interrupted += 1
        while True:  # the helper may send one more as it stops
            try:
                stop.set()
                helper.join()
                signal.signal(signal.SIGINT, signal.SIG_IGN)  # drops one still pending
                break
            except KeyboardInterrupt:
                interrupted += 1
        futures = [backend.fork(abs, -i) for i in range(50)]
        assert [f.wait(timeout=30) for f in futures] == list(range(50))
        print("ok", interrupted, checked)
        """,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok"), done.stdout


def test_a_remote_traceback_names_the_script_and_shows_its_lines(tmp_path):
    # A function of the user's script travels by value (cloudpickle), which
    # wrote "<dynamic-code>" for its file: no file name, no source line.
    done = run_script(
        tmp_path,
        """
        import aiopar

        def inner():
            raise ValueError("failed on purpose")

        def outer():
            inner()  # the line the traceback shows

        backend = aiopar.get_backend("process", max_workers=1)
        try:
            backend.fork(outer).wait()
        except ValueError as exc:
            print(exc.__cause__.tb)
        """,
    )
    assert done.returncode == 0, done.stderr
    script = str(tmp_path / "script.py")
    assert f'File "{script}", line 8, in outer' in done.stdout, done.stdout
    assert "inner()  # the line the traceback shows" in done.stdout
    assert f'File "{script}", line 5, in inner' in done.stdout
    assert 'raise ValueError("failed on purpose")' in done.stdout
    assert "<dynamic-code>" not in done.stdout
