"""The "process" backend: any callable, zero-copy numpy, crash-safe workers.

Whatever could hang (exit, shutdown, signals, fork) runs in a subprocess with
a timeout, so a regression fails instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import logging
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref

import numpy as np
import pytest
from helpers import python

import aiopar
from aiopar import _trace
from aiopar.backends import _process_handle
from aiopar.backends._process_dispatch import prefetch_depth
from aiopar.backends.process import ProcessBackend, RemoteError, RemoteTraceback

# -- fixtures ----------------------------------------------------------------


def _child_pids() -> set[int]:
    """Live (not yet reaped) child processes of this process."""
    me = str(os.getpid())
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # fields: state, ppid, ...
            children.add(int(entry))
    return children


def _shared_memory() -> set[str]:
    # Semaphores are left out: aiopar makes none, and other programs on the
    # machine (multiprocessing's locks) come and go meanwhile.
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test leaves /dev/shm, the process table and the threads as it found them."""
    shm_before = _shared_memory()
    children_before = _child_pids()
    threads_before = set(threading.enumerate())
    yield
    assert _shared_memory() - shm_before == set()
    assert not multiprocessing.active_children()
    deadline = time.monotonic() + 5
    while _child_pids() - children_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _child_pids() - children_before == set()
    leaked = [
        t for t in threading.enumerate() if t not in threads_before and t.name.startswith("aiopar-")
    ]
    for thread in leaked:
        thread.join(timeout=5)
    assert not [t for t in leaked if t.is_alive()]


@pytest.fixture(scope="module")
def pool():
    """A two-worker pool shared by the tests that do not break or stop it."""
    backend = ProcessBackend(2)
    # Start both workers now, so no test sees them as processes it started.
    aiopar.wait_all([backend.fork(sleep_then, 0.2, None) for _ in range(2)])
    yield backend
    backend.shutdown()


@pytest.fixture
def own_pool():
    """A one-worker pool of the test's own (to kill, cancel or shut down)."""
    backends = []

    def make(max_workers: int = 1, **options) -> ProcessBackend:
        backend = ProcessBackend(max_workers, **options)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.shutdown(cancel_pending=True)


def _eventually(predicate, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def _script_env() -> dict[str, str]:
    """The environment for a script that imports what this process does."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def _run_script(tmp_path, source: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return python(str(script), timeout=timeout, env=_script_env(), cwd=tmp_path)


def _exited(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (its new parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


# -- helpers that run in workers ---------------------------------------------


def add(a, b=0):
    return a + b


def pid_and_backend():
    return os.getpid(), aiopar.get_backend().name


def nested_fork():
    inner = aiopar.fork(pid_and_backend)
    return os.getpid(), inner.wait()


def explicit_process_fork():
    # Even asking for the process backend inside a worker stays in the worker.
    return aiopar.get_backend("process").fork(os.getpid).wait()


def kill_self(sig: int = signal.SIGKILL):
    os.kill(os.getpid(), sig)
    time.sleep(10)


def sleep_then_die(seconds: float):
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_now(code: int):
    os._exit(code)


def segfault():
    ctypes.string_at(0)


def sleep_then(seconds: float, value):
    time.sleep(seconds)
    return value


def fail_deep():
    def inner_helper():
        raise ValueError("the task failed on purpose")

    inner_helper()


def return_lock():
    return threading.Lock()


class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def raise_unpicklable():
    raise Unpicklable("carries a lock")


def double(a):
    return a * 2


def echo(a):
    return a


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def scale(self, x):
        return x * self.factor

    def __call__(self, x):
        return x * self.factor


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
    assert backend._workers == []
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
    segments = pool._segments
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


# -- crashes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fn", "args", "words"),
    [
        (kill_self, (), "SIGKILL"),
        (exit_now, (3,), "exited with code 3"),
        (segfault, (), "SIGSEGV"),
    ],
    ids=["sigkill", "os_exit", "segfault"],
)
def test_a_dying_worker_fails_only_its_task(own_pool, fn, args, words):
    backend = own_pool(1)  # one worker: the queued tasks sit behind the dying one
    doomed = backend.fork(fn, *args)
    queued = [backend.fork(add, i, 1) for i in range(4)]
    with pytest.raises(aiopar.BrokenWorkerError, match=words) as info:
        doomed.wait(timeout=30)
    assert fn.__name__ in str(info.value)
    assert [f.wait(timeout=30) for f in queued] == [1, 2, 3, 4]
    assert backend.fork(add, 1, 1).wait() == 2  # replaced


def test_sigkill_from_outside_while_running(own_pool, tmp_path):
    backend = own_pool(1)
    marker = tmp_path / "pid"
    fut = backend.fork(_write_pid_and_sleep, str(marker))
    deadline = time.monotonic() + 30
    while not marker.exists() or not marker.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(int(marker.read_text()), signal.SIGKILL)
    with pytest.raises(aiopar.BrokenWorkerError, match="SIGKILL"):
        fut.wait(timeout=30)
    assert backend.fork(add, 2, 2).wait() == 4


def _write_pid_and_sleep(path):
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(30)


def test_an_idle_worker_that_dies_is_replaced(own_pool):
    backend = own_pool(1)
    pid = backend.fork(os.getpid).wait()
    os.kill(pid, signal.SIGKILL)
    _eventually(lambda: all(worker.pid != pid for worker in backend._workers))
    assert backend.fork(os.getpid).wait(timeout=30) != pid


def test_workers_that_cannot_start_fail_the_queue(own_pool, monkeypatch):
    monkeypatch.setattr(_process_handle, "BOOT", "import sys; sys.exit(7)")
    backend = own_pool(1)
    with pytest.raises(aiopar.BrokenWorkerError, match="before they were ready"):
        backend.fork(add, 1).wait(timeout=30)


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


# -- cancel and shutdown ---------------------------------------------------------


def test_cancel_before_sent(own_pool):
    backend = own_pool(1, prefetch=0)
    running = backend.fork(sleep_then, 0.5, "first")
    queued = backend.fork(add, 1)
    assert queued.cancel()
    assert queued.cancelled()
    with pytest.raises(aiopar.CancelledError):
        queued.wait()
    assert running.wait() == "first"
    assert not running.cancel()


def test_prefetched_task_is_no_longer_cancellable(own_pool):
    backend = own_pool(1, prefetch=1)
    running = backend.fork(sleep_then, 0.3, "first")
    _eventually(running.running)
    prefetched = backend.fork(add, 1)
    queued = backend.fork(add, 2)
    assert not prefetched.cancel()
    assert queued.cancel()
    assert running.wait() == "first" and prefetched.wait() == 1


def test_shutdown_runs_what_was_queued(own_pool):
    backend = own_pool(1)
    futures = [backend.fork(sleep_then, 0.02, i) for i in range(6)]
    backend.shutdown(wait=True)
    assert [f.value() for f in futures] == list(range(6))
    assert backend._workers == []
    with pytest.raises(RuntimeError, match="shut down"):
        backend.fork(add, 1)


def test_shutdown_cancel_pending(own_pool):
    backend = own_pool(1, prefetch=0)
    running = backend.fork(sleep_then, 0.3, "ran")
    _eventually(running.running)
    queued = [backend.fork(add, i) for i in range(5)]
    backend.shutdown(wait=True, cancel_pending=True)
    assert running.value() == "ran"
    assert all(f.cancelled() for f in queued)


def test_shutdown_without_wait_finishes_in_the_background(own_pool):
    backend = own_pool(1)
    futures = [backend.fork(sleep_then, 0.02, i) for i in range(3)]
    backend.shutdown(wait=False)
    assert [f.wait(timeout=30) for f in futures] == [0, 1, 2]
    backend.shutdown(wait=True)  # joins the manager


def test_shutdown_of_an_unused_backend():
    threads_before = set(threading.enumerate())
    backend = ProcessBackend(1)
    backend.shutdown()
    backend.shutdown()  # again: does nothing
    assert backend.closed
    assert backend._workers == []
    assert set(threading.enumerate()) <= threads_before  # no manager left behind
    with pytest.raises(RuntimeError, match="shut down"):
        backend.fork(add, 1)


def test_interpreter_exit_with_pending_work(tmp_path):
    done = _run_script(
        tmp_path,
        """
        import time, aiopar
        backend = aiopar.get_backend("process", max_workers=1)
        futures = [backend.fork(time.sleep, 0.05) for _ in range(4)]
        futures[-1].add_done_callback(lambda f: print("last done", flush=True))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "last done" in done.stdout
    assert "Traceback" not in done.stderr


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


def test_prefetch_adapts_to_task_length(own_pool):
    backend = own_pool(1)
    aiopar.wait_all([backend.fork(add, i) for i in range(200)])
    assert prefetch_depth(backend) > 4  # tiny tasks: several queued per worker
    aiopar.wait_all([backend.fork(sleep_then, 0.01, i) for i in range(30)])
    assert prefetch_depth(backend) == 1  # 10 ms tasks: one


def test_deeply_prefetched_tasks_survive_a_crash(own_pool):
    backend = own_pool(1)
    aiopar.wait_all([backend.fork(add, i) for i in range(200)])
    doomed = backend.fork(sleep_then_die, 0.3)
    queued = [backend.fork(add, i, 1) for i in range(40)]
    assert len(backend._workers[0].inflight) > 2  # prefetched behind the doomed task
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
def test_any_exception_from_a_callback_is_logged_and_the_pool_lives_on(own_pool, caplog, exc_type):
    backend = own_pool(1)
    fut = backend.fork(sleep_then, 0.2, "value")
    ran = []

    def callback(f):
        ran.append(f.value())
        raise exc_type("raised by a done-callback")

    fut.add_done_callback(callback)  # before the task ends: it runs in the manager thread
    with caplog.at_level(logging.ERROR, logger="aiopar"):
        assert fut.wait(timeout=30) == "value"
        _eventually(lambda: ran == ["value"] and exc_type.__name__ in caplog.text)
    assert "done-callback" in caplog.text
    assert not backend.closed
    assert [backend.fork(add, i, 1).wait(timeout=30) for i in range(3)] == [1, 2, 3]


# -- tasks that never return -----------------------------------------------------------


def test_shutdown_cancel_pending_terminates_a_stuck_worker(tmp_path):
    done = _run_script(
        tmp_path,
        """
        import time
        from aiopar.backends.process import ProcessBackend

        backend = ProcessBackend(1, prefetch=1, grace=0.5)
        stuck = backend.fork(time.sleep, 3600)
        prefetched = backend.fork(abs, -1)  # sent to the stuck worker behind it
        queued = backend.fork(abs, -2)
        while not stuck.running():
            time.sleep(0.01)
        backend.shutdown(wait=True, cancel_pending=True)
        print("stuck:", repr(stuck.exception()))
        print("prefetched:", repr(prefetched.exception()))
        print("queued cancelled:", queued.cancelled())
        print("workers left:", len(backend._workers))
        """,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "stuck: BrokenWorkerError(" in out
    assert "sleep() was terminated at shutdown" in out
    assert "0.5 s after shutdown(cancel_pending=True)" in out
    assert "prefetched: BrokenWorkerError(" in out and "never ran" in out
    assert "queued cancelled: True" in out
    assert "workers left: 0" in out
    assert "terminating" in done.stderr  # logged, with what to change


def test_a_stuck_worker_that_ignores_sigterm_is_killed(tmp_path):
    done = _run_script(
        tmp_path,
        """
        import os, signal, time
        from aiopar.backends.process import ProcessBackend

        def stubborn():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open("ignoring", "w").close()
            time.sleep(3600)

        backend = ProcessBackend(1, grace=0.2)
        future = backend.fork(stubborn)
        while not os.path.exists("ignoring"):
            time.sleep(0.01)
        backend.shutdown(cancel_pending=True)
        print(repr(future.exception()))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "BrokenWorkerError(" in done.stdout and "stubborn() was terminated" in done.stdout


def test_interpreter_exit_terminates_a_stuck_worker(tmp_path):
    done = _run_script(
        tmp_path,
        """
        import time, aiopar

        backend = aiopar.get_backend("process", max_workers=1, grace=0.5)
        stuck = backend.fork(time.sleep, 3600)
        stuck.add_done_callback(lambda f: print("stuck:", repr(f.exception()), flush=True))
        finished = backend.fork(abs, -3)
        while not stuck.running():
            time.sleep(0.01)
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "stuck: BrokenWorkerError(" in done.stdout
    assert "the interpreter is exiting and no task finished for 0.5 s" in done.stdout


def test_exit_after_an_uncaught_keyboard_interrupt_cancels_the_queue(tmp_path):
    done = _run_script(
        tmp_path,
        """
        import time, aiopar

        backend = aiopar.get_backend("process", max_workers=1, prefetch=0, grace=0.5)
        assert backend.fork(abs, -1).wait() == 1
        stuck = backend.fork(time.sleep, 3600)  # starts at once on the idle worker
        stuck.add_done_callback(lambda f: print("stuck:", repr(f.exception()), flush=True))
        for i in range(3):
            backend.fork(print, "ran", i).add_done_callback(
                lambda f: print("cancelled:", f.cancelled(), flush=True)
            )
        raise KeyboardInterrupt
        """,
    )
    assert done.returncode != 0  # the interrupt still ends the program
    assert done.stdout.count("cancelled: True") == 3 and "ran 0" not in done.stdout
    assert "0.5 s after an uncaught KeyboardInterrupt" in done.stdout


def test_exit_still_runs_the_queue_while_tasks_finish(tmp_path):
    # No task takes the grace period, so all of them run although together
    # they take longer. The worker is up first: its start is no task.
    done = _run_script(
        tmp_path,
        """
        import time, aiopar

        backend = aiopar.get_backend("process", max_workers=1, grace=1.0)
        backend.fork(int).wait()
        futures = [backend.fork(time.sleep, 0.1) for _ in range(15)]
        futures[-1].add_done_callback(lambda f: print("last:", f.exception(), flush=True))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert "last: None" in done.stdout


def test_workers_exit_when_the_parent_is_killed(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time, aiopar

            backend = aiopar.get_backend("process", max_workers=2, prefetch=0)
            aiopar.wait_all([backend.fork(time.sleep, 0.3) for _ in range(2)])
            stuck = backend.fork(time.sleep, 3600)  # one worker busy, the other idle
            while not stuck.running():
                time.sleep(0.01)
            print(*[w.pid for w in backend._workers], flush=True)
            time.sleep(3600)
            """
        )
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=_script_env()
    )
    pids: list[int] = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10  # a second is the promise; the machine is shared
        while not all(_exited(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [pid for pid in pids if not _exited(pid)] == []
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        for pid in pids:
            if not _exited(pid):
                os.kill(pid, signal.SIGKILL)


# -- os.fork() ---------------------------------------------------------------------------


def test_a_forked_child_gets_a_fresh_pool(tmp_path):
    done = _run_script(
        tmp_path,
        """
        import multiprocessing, os, time, traceback
        import numpy as np
        import aiopar

        backend = aiopar.get_backend("process", max_workers=2)
        parent_workers = set(aiopar.wait_all([backend.fork(os.getpid) for _ in range(4)]))
        inherited = {os.fstat(w.channel.fileno()).st_ino for w in backend._workers}

        def open_sockets():
            inodes = set()
            for fd in os.listdir("/proc/self/fd"):
                try:
                    link = os.readlink(f"/proc/self/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
            return inodes

        def child():
            # The parent's worker sockets are closed here, so its workers
            # see it shut them down.
            assert not open_sockets() & inherited, "a worker socket of the parent is open"
            # A task pending at the fork is the parent's: it fails here.
            error = pending.exception(timeout=10)
            assert isinstance(error, aiopar.BrokenWorkerError), error
            assert "os.fork" in str(error)
            pool = aiopar.get_backend("process", max_workers=2)
            assert aiopar.wait_all([pool.fork(pow, 2, i) for i in range(8)]) == [
                2**i for i in range(8)
            ]
            pids = set(aiopar.wait_all([pool.fork(os.getpid) for _ in range(4)]))
            assert not pids & parent_workers and os.getpid() not in pids
            big = np.arange(1_000_000.0)  # through shared memory
            assert (pool.fork(np.negative, big).wait() == -big).all()
            pool.shutdown()

        def run_child():
            try:
                child()
            except BaseException:
                traceback.print_exc()
                os._exit(1)

        pending = backend.fork(time.sleep, 2)
        pid = os.fork()
        if pid == 0:
            run_child()
            os._exit(0)
        assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0, "os.fork child failed"
        assert pending.wait(timeout=30) is None  # the parent's copy is unharmed

        pending = backend.fork(time.sleep, 2)
        process = multiprocessing.get_context("fork").Process(target=run_child)
        process.start()
        process.join(60)
        assert process.exitcode == 0, f"multiprocessing child: exit code {process.exitcode}"
        assert pending.wait(timeout=30) is None

        assert backend.fork(abs, -5).wait() == 5
        backend.shutdown()
        print("ok")
        """,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


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
    _eventually(lambda: not backend._segments._busy)


def _die_holding(a):
    os.kill(os.getpid(), signal.SIGKILL)


def _fail_holding(a):
    raise ValueError("failed on purpose")
