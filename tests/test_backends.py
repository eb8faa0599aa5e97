"""The registry, backend selection, and the lifecycle of the thread backend."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from importlib.metadata import EntryPoint

import pytest
from helpers import run_python

import aiopar
from aiopar.backends import Backend, Task
from aiopar.backends.thread import ThreadBackend


def test_builtins_are_available():
    names = aiopar.available_backends()
    assert names[:2] == ["inline", "thread"]


def test_default_backend_is_thread():
    assert aiopar.get_backend().name == "thread"


def test_get_backend_caches_per_name_and_options():
    assert aiopar.get_backend("thread") is aiopar.get_backend("thread")
    three = aiopar.get_backend("thread", max_workers=3)
    assert three is aiopar.get_backend("thread", max_workers=3)
    assert three is not aiopar.get_backend("thread")
    assert three.max_workers == 3


def test_unknown_backend_lists_the_available_ones():
    with pytest.raises(
        ValueError, match=r"unknown backend 'nope'; available backends: inline, thread"
    ):
        aiopar.set_backend("nope")
    with pytest.raises(ValueError, match="available backends"):
        aiopar.get_backend("nope")
    with pytest.raises(ValueError, match="available backends"), aiopar.use_backend("nope"):
        pass


def test_bad_backend_arguments():
    with pytest.raises(TypeError, match="backend name or a Backend instance"):
        aiopar.set_backend(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="options go with a backend name"):
        aiopar.get_backend(max_workers=2)
    with pytest.raises(TypeError, match="options go with a backend name"):
        aiopar.set_backend(aiopar.get_backend("inline"), max_workers=2)
    with pytest.raises(ValueError, match="max_workers must be a whole number >= 1"):
        aiopar.get_backend("thread", max_workers=0)
    with pytest.raises(TypeError, match="hashable"):
        aiopar.get_backend("thread", max_workers=[1])


def test_set_backend_changes_the_process_default():
    try:
        aiopar.set_backend("inline")
        assert aiopar.fork(threading.get_ident).wait() == threading.get_ident()
        assert aiopar.get_backend().name == "inline"
    finally:
        aiopar.set_backend("thread")


def test_use_backend_is_scoped_and_accepts_instances():
    mine = ThreadBackend(max_workers=1)
    with mine, aiopar.use_backend(mine) as chosen:
        assert chosen is mine
        assert aiopar.get_backend() is mine
        started = threading.Event()
        fut = aiopar.fork(lambda: (started.set(), threading.current_thread().name)[1])
        assert started.wait(5)  # a worker of `mine` took it: this thread never waited
        assert fut.wait().startswith("aiopar-thread")
    assert aiopar.get_backend() is not mine


def test_use_backend_does_not_leak_into_other_threads():
    seen = []
    with aiopar.use_backend("inline"):
        t = threading.Thread(target=lambda: seen.append(aiopar.get_backend().name))
        t.start()
        t.join()
    assert seen == ["thread"]


def test_backend_fork_goes_to_that_backend_only():
    inline = aiopar.get_backend("inline")
    assert inline.fork(threading.get_ident).wait() == threading.get_ident()


class _CountingBackend(Backend):
    """A minimal plugin: runs tasks inline and counts them."""

    name = "counting"

    def __init__(self, start: int = 0) -> None:
        super().__init__()
        self.count = start

    @property
    def max_workers(self) -> int:
        return 1

    def enqueue(self, task: Task) -> None:
        self.count += 1
        task.run()

    def shutdown(self, wait: bool = True, *, cancel_pending: bool = False) -> None:
        self._closed = True


def test_plugin_backends_come_from_entry_points(monkeypatch):
    from aiopar import backends

    entry_point = EntryPoint(
        name="counting", value=f"{__name__}:_CountingBackend", group=backends.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(backends, "_plugins", {"counting": entry_point})
    assert "counting" in aiopar.available_backends()
    with aiopar.use_backend("counting", start=10) as plugin:
        assert aiopar.fork(lambda: 5).wait() == 5
    assert plugin.count == 11


def test_shutdown_wait_runs_what_was_queued_and_stops_threads():
    before = set(threading.enumerate())
    backend = ThreadBackend(max_workers=2)
    results = []
    futs = [backend.fork(lambda i=i: (time.sleep(0.005), results.append(i))) for i in range(20)]
    backend.shutdown(wait=True)
    assert all(f.done() and not f.cancelled() for f in futs)
    assert sorted(results) == list(range(20))
    names = backend._thread_names + "-"
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith(names)]
    with pytest.raises(RuntimeError, match="shut down"):
        backend.fork(len, [])
    backend.shutdown()  # a second shutdown does nothing


def test_shutdown_cancel_pending():
    backend = ThreadBackend(max_workers=1)
    started, gate = threading.Event(), threading.Event()
    running = backend.fork(lambda: (started.set(), gate.wait(10))[1])
    assert started.wait(10)
    queued = [backend.fork(lambda: "x") for _ in range(5)]
    # The running task ends once shutdown has cancelled the last queued one.
    queued[-1].add_done_callback(lambda _: gate.set())
    backend.shutdown(wait=True, cancel_pending=True)
    assert running.value() is True
    assert all(f.cancelled() for f in queued)


def test_shut_down_default_backend_is_replaced():
    default = aiopar.get_backend()
    default.shutdown()
    try:
        assert aiopar.fork(lambda: 1).wait() == 1
        assert aiopar.get_backend() is not default
    finally:
        aiopar.set_backend("thread")


def test_interop_threads_follow_set_num_interop_threads():
    old = aiopar.get_num_interop_threads()
    backend = ThreadBackend()
    fixed = ThreadBackend(max_workers=2)  # keeps its own
    try:
        aiopar.set_num_interop_threads(3)
        assert (backend.max_workers, fixed.max_workers) == (3, 2)
        with ThreadBackend() as made_now:
            assert made_now.max_workers == 3
        with pytest.raises(ValueError, match="whole number >= 1"):
            aiopar.set_num_interop_threads(0)
        assert backend.max_workers == 3
    finally:
        aiopar.set_num_interop_threads(old)
        backend.shutdown()
        fixed.shutdown()
    assert (backend.max_workers, fixed.max_workers) == (old, 2)


def test_exit_with_pending_work_does_not_hang():
    proc = run_python(
        """
        import time, aiopar
        futs = [aiopar.fork(time.sleep, 0.1) for _ in range(10)]
        print("forked", flush=True)
        """,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "forked" in proc.stdout


def test_exit_runs_queued_work():
    proc = run_python(
        """
        import sys, time, aiopar
        def write(i):
            time.sleep(0.01)
            sys.stdout.write(f"ran {i}\\n")  # one write: lines from two threads stay whole
        for i in range(6):
            aiopar.fork(write, i)
        """
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == [f"ran {i}" for i in range(6)]


def test_lowering_the_interop_limit_stops_idle_workers_before_new_tasks_run():
    old = aiopar.get_num_interop_threads()
    backend = ThreadBackend()
    try:
        aiopar.set_num_interop_threads(4)
        barrier = threading.Barrier(5, timeout=5)
        futs = [backend.fork(barrier.wait) for _ in range(4)]
        barrier.wait()  # four workers run at once
        aiopar.wait_all(futs)
        aiopar.set_num_interop_threads(1)
        running, peak = 0, 0
        lock = threading.Lock()

        def task():
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
            # It computes: a worker blocked in a sleep would be compensated.
            end = time.perf_counter() + 0.01
            while time.perf_counter() < end:
                pass
            with lock:
                running -= 1

        futs = [backend.fork(task) for _ in range(8)]
        # Not aiopar's wait: concurrent.futures' runs none of them in this thread.
        assert not concurrent.futures.wait(futs, timeout=30).not_done
        assert peak == 1
    finally:
        aiopar.set_num_interop_threads(old)
        backend.shutdown()
