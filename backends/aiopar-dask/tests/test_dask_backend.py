"""The "dask" backend: the same Future on a cluster, loopback only, nothing left behind."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import threading
import time
import traceback

import dask
import distributed
import numpy as np
import pytest
from aiopar_dask import DaskBackend, _results
from dask_helpers import (
    Leftovers,
    descendant_pids,
    fail_deep,
    listening_addresses,
    loopback_cluster,
    run_python,
    start_python,
    tasks_to_run,
    wait_until,
)

import aiopar
from aiopar.profiler import profile

# Above the scripts' own timeouts, which say what hung (one took 25 s on a busy machine).
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def inproc():
    """One worker thread in this process: for the semantics that need no pickling."""
    backend = DaskBackend(n_workers=1, threads_per_worker=1, processes=False)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def procs():
    """One worker process with one thread: pickling, nesting, remote tracebacks."""
    backend = DaskBackend(n_workers=1, threads_per_worker=1)
    yield backend
    backend.shutdown()


# -- functions the workers run ---------------------------------------------------

calls: list[str] = []


def record_call(tag: str) -> str:
    calls.append(tag)
    return tag


def double(x):
    return 2 * x


def sleep_then(seconds: float, value):
    time.sleep(seconds)
    return value


def countdown(n: int) -> int:
    """Forks itself and waits, n deep: each level blocks the worker's only thread."""
    if n == 0:
        return os.getpid()
    return aiopar.fork(countdown, n - 1).wait()


async def on_worker_loop(x):
    await asyncio.sleep(0.01)
    worker = distributed.get_worker()
    return x + 1, asyncio.get_running_loop() is worker.loop.asyncio_loop


def array_sum(a: np.ndarray) -> float:
    return float(a.sum())


# -- the basics ----------------------------------------------------------------------


def test_registered_as_a_plugin():
    assert "dask" in aiopar.available_backends()


def test_fork_wait_await_then(inproc):
    with aiopar.use_backend(inproc):
        assert aiopar.fork(double, 21).wait() == 42
        assert aiopar.fork(double, 5).then(lambda f: f.value() + 1).wait() == 11

        async def main():
            return await aiopar.fork(double, 4)

        assert asyncio.run(main()) == 8
        assert aiopar.wait_all([aiopar.fork(double, i) for i in range(20)]) == [
            2 * i for i in range(20)
        ]


def test_never_deduplicates(inproc):
    calls.clear()
    futures = [inproc.fork(record_call, "same") for _ in range(3)]
    assert aiopar.wait_all(futures) == ["same"] * 3
    assert calls == ["same"] * 3  # dask's pure=True default would have run it once


def test_exception_keeps_type_and_remote_traceback(procs):
    with pytest.raises(ValueError, match="on purpose") as info:
        procs.fork(fail_deep).wait()
    text = "".join(traceback.format_exception(info.value))
    assert "inner_helper" in text  # the frames from the worker process


def test_a_failure_deep_in_the_stack_settles_its_fork():
    # dask's own exception transport asserts on a traceback too deep to
    # pickle: the fork stayed pending for ever, and exit hung.
    script = """
        import aiopar

        def deep(n):
            if n:
                return deep(n - 1)
            raise ValueError("at the bottom")

        if __name__ == "__main__":
            with aiopar.use_backend("dask", n_workers=1, threads_per_worker=1):
                try:
                    aiopar.fork(deep, 900).wait(timeout=60)
                except ValueError as exc:
                    print(exc)
    """
    done = run_python(script, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "at the bottom", done.stderr


def test_a_failure_the_caller_handles_leaves_no_dask_error_lines():
    script = """
        import aiopar

        def bad(key):
            raise KeyError(key)

        if __name__ == "__main__":
            with aiopar.use_backend("dask", n_workers=1, threads_per_worker=1):
                try:
                    aiopar.fork(bad, "handled").wait(timeout=60)
                except KeyError as exc:
                    print("caught", exc)
    """
    done = run_python(script, timeout=90)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "caught 'handled'\n"
    assert "Compute Failed" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr


def test_arguments_and_results_cross_processes(procs):
    a = np.arange(1_000_000, dtype=np.float64)
    assert procs.fork(array_sum, a).wait() == a.sum()
    assert procs.fork(lambda x: x[::-1], a).wait()[0] == a[-1]  # a lambda: cloudpickle


def test_coroutine_function_runs_on_the_worker_loop(procs):
    assert procs.fork(on_worker_loop, 1).wait() == (2, True)


def test_nested_fork_and_wait_never_deadlock_a_one_thread_worker(procs):
    # Raw dask deadlocks here: the parent holds the only thread, the child waits for it.
    assert procs.fork(countdown, 4).wait() in descendant_pids()


def test_then_callbacks_may_block_on_other_forks(inproc):
    chained = inproc.fork(double, 1).then(lambda f: inproc.fork(double, f.value()).wait())
    assert chained.wait(timeout=20) == 4


def test_a_fork_that_cannot_be_sent_fails_alone(inproc):
    before = [inproc.fork(double, x) for x in range(3)]
    unsendable = inproc.fork(double, threading.Lock())
    after = inproc.fork(double, 5)
    with pytest.raises(TypeError, match=r"double\(\) cannot be sent to the cluster.*pickle"):
        unsendable.wait(timeout=30)
    assert aiopar.wait_all([*before, after]) == [0, 2, 4, 10]


released = threading.Event()


def hold_the_worker() -> str:
    assert released.wait(30)
    return "held"


def test_cancel_maps_to_dask_cancel(inproc):
    calls.clear()
    released.clear()
    busy = inproc.fork(hold_the_worker)  # holds the only worker thread
    queued = inproc.fork(record_call, "queued")
    assert wait_until(lambda: tasks_to_run(inproc) == 2, timeout=30)  # dask has it
    assert queued.cancel()
    assert queued.cancelled()
    with pytest.raises(aiopar.CancelledError):
        queued.wait()
    assert wait_until(lambda: tasks_to_run(inproc) == 1, timeout=30)  # dask has dropped it
    released.set()
    assert busy.wait() == "held"
    # Had it not been cancelled, it would run before a later fork on the one thread.
    assert inproc.fork(record_call, "later").wait() == "later"
    assert calls == ["later"]  # the cancelled task never ran


@pytest.mark.xfail(
    strict=True,
    reason="cancel() says yes while dask's cancel is on its way: a worker that frees up "
    "meanwhile runs the task",
)
def test_a_fork_cancelled_just_before_its_worker_frees_up_never_runs(inproc):
    # The dask task waits on the worker behind the one running; the cancel
    # goes client, scheduler, worker, and the worker may run the task first.
    calls.clear()
    for _ in range(10):
        released.clear()
        busy = inproc.fork(hold_the_worker)
        queued = inproc.fork(record_call, "cancelled")
        assert wait_until(lambda: tasks_to_run(inproc) == 2, timeout=30)  # dask has it
        assert queued.cancel()
        released.set()
        assert busy.wait() == "held"
        assert inproc.fork(record_call, "later").wait() == "later"
    assert "cancelled" not in calls


def test_profiler_shows_a_row_per_dask_worker(procs):
    with profile() as prof:
        procs.fork(sleep_then, 0.05, None).wait()
    (record,) = prof.records
    assert record.worker.pid in descendant_pids()
    assert record.worker.name.startswith("dask worker")
    assert record.fork_ns <= record.start_ns < record.end_ns
    trace = prof.chrome_trace()
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert any(name.startswith("dask worker") for name in names)
    json.dumps(trace)


# -- map -------------------------------------------------------------------------------------


class Stop(BaseException):
    """Ends a chunk, as SystemExit would, without ending the test."""


def the_dask_task(x):
    """The key of the dask task that runs this call, and x."""
    return distributed.get_worker().get_current_task(), x


def odd_fails(x):
    if x == 13:
        raise Stop("a BaseException ends its chunk")
    if x % 2:
        raise ValueError(f"{x} is odd")
    return x


def test_map_runs_a_dask_task_per_chunk_and_a_future_per_item(inproc):
    futures = inproc.map(the_dask_task, range(10), chunksize=4)
    assert len(futures) == 10
    results = aiopar.wait_all(futures)
    assert [x for _, x in results] == list(range(10))
    keys = [key for key, _ in results]
    assert [keys.count(key) for key in dict.fromkeys(keys)] == [4, 4, 2]
    assert inproc.map(double, [], chunksize=3) == []
    assert aiopar.wait_all(inproc.map(pow, [2, 3], [5, 2])) == [32, 9]  # zip(*iterables)


def test_a_forks_dask_key_names_its_function(inproc):
    key, _ = inproc.fork(the_dask_task, 1).wait()
    assert key.startswith("the_dask_task-"), key


def test_arguments_reach_the_function_as_given_not_computed_by_dask(procs):
    # dask reads a task's arguments as a graph: a Task among them was computed first.
    from dask._task_spec import Task

    assert procs.fork(type, Task("k", abs, -3)).wait() is Task
    nested = procs.fork(
        lambda xs, *, d: (type(xs[0]), type(d["t"])),
        [Task("k", abs, -3)],
        d={"t": Task("j", abs, 1)},
    )
    assert nested.wait() == (Task, Task)
    assert procs.fork(lambda t: t(), Task("k", abs, -3)).wait() == 3
    assert procs.fork(Task("k", abs, -3)).wait() == 3  # a Task is callable
    assert aiopar.wait_all(procs.map(type, [Task("k", abs, -3)])) == [Task]
    executor = aiopar.Executor(procs)
    assert dask.compute(dask.delayed(abs)(-3), scheduler=executor) == (3,)


def test_map_fails_an_item_alone_and_stops_a_chunk_at_a_base_exception(procs):
    futures = procs.map(odd_fails, range(20), chunksize=5)
    for x in range(10):
        if x % 2:
            with pytest.raises(ValueError, match=f"{x} is odd"):
                futures[x].wait()
        else:
            assert futures[x].wait() == x
    with pytest.raises(Stop):
        futures[13].wait()
    assert futures[14].cancelled()  # after the BaseException, in its chunk
    assert [futures[x].wait() for x in (10, 12, 16, 18)] == [10, 12, 16, 18]


def test_map_on_a_cluster_with_no_worker_yet_returns_its_futures():
    # The default chunk size divided by the workers there are: none, at first.
    with (
        loopback_cluster(n_workers=0) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        backend = DaskBackend(client=client)
        try:
            futures = backend.map(double, range(4))
            assert not any(future.done() for future in futures)
            cluster.scale(1)
            assert [future.wait(timeout=30) for future in futures] == [0, 2, 4, 6]
        finally:
            backend.shutdown()


def test_map_of_a_coroutine_function_forks_each_item(procs):
    assert aiopar.wait_all(procs.map(on_worker_loop, [1, 2])) == [(2, True), (3, True)]


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "words"),
    [
        ((42, [1]), {}, TypeError, "needs a callable"),
        ((double,), {}, TypeError, "an iterable of arguments"),
        ((double, [1]), {"chunksize": 0}, ValueError, "chunksize"),
    ],
)
def test_map_refuses_bad_arguments_at_once(inproc, args, kwargs, error, words):
    with pytest.raises(error, match=words):
        inproc.map(*args, **kwargs)


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"n_workers": 0}, ValueError, "n_workers must be a whole number >= 1"),
        ({"address": "tcp://127.0.0.1:1", "n_workers": 2}, ValueError, "sizes the embedded"),
        ({"address": 8786}, TypeError, "scheduler address"),
        ({"client": "tcp://127.0.0.1:1"}, TypeError, "distributed.Client"),
        ({"processes": "yes"}, TypeError, "True or False"),
        ({"security": {"tls": True}}, TypeError, "distributed.Security"),
        ({"address": "tcp://127.0.0.1:1", "timeout": 0}, ValueError, "a number > 0"),
        ({"timeout": 5}, ValueError, "bounds the wait for the scheduler at address"),
    ],
)
def test_bad_options_fail_at_once(options, error, words):
    with pytest.raises(error, match=words):
        DaskBackend(**options)


def test_fork_after_shutdown_says_so():
    backend = DaskBackend(n_workers=1, threads_per_worker=1, processes=False)
    backend.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        backend.fork(double, 1)


# -- clusters: where they listen, what they leave behind ------------------------------------


@pytest.mark.parametrize("cluster", ["inproc", "procs"], ids=["in-process", "processes"])
def test_embedded_cluster_listens_on_loopback_only(request, cluster):
    backend = request.getfixturevalue(cluster)
    assert backend.fork(double, 1).wait() == 2
    # (every process this one started: none may listen elsewhere)
    assert listening_addresses({os.getpid(), *descendant_pids()}) == {"127.0.0.1"}


def test_shutdown_leaves_no_process_or_thread_behind():
    left = Leftovers()
    backend = DaskBackend(n_workers=1, threads_per_worker=1)
    assert backend.fork(double, 3).then(lambda f: f.value()).wait() == 6
    backend.shutdown()
    wait_until(lambda: not left.processes(), timeout=10)  # reaping takes a moment
    assert left.processes() == set()
    assert left.threads() == set()  # joined by shutdown itself


def test_shutdown_runs_or_cancels_what_is_pending():
    backend = DaskBackend(n_workers=1, threads_per_worker=1, processes=False)
    running = backend.fork(sleep_then, 0.3, "ran")
    backend.shutdown(wait=True)
    assert running.value() == "ran"

    backend = DaskBackend(n_workers=1, threads_per_worker=1, processes=False)
    first = backend.fork(sleep_then, 0.3, "first")
    queued = backend.fork(sleep_then, 0.3, "queued")
    backend.shutdown(wait=True, cancel_pending=True)
    assert first.done() and queued.done()
    assert queued.cancelled()


def test_a_users_client_stays_open():
    with (
        loopback_cluster(n_workers=1) as cluster,
        distributed.Client(cluster, set_as_default=False) as client,
    ):
        backend = DaskBackend(client=client)
        assert backend.fork(double, 2).wait() == 4
        backend.shutdown()
        assert client.status == "running"
        assert client.submit(double, 3).result() == 6


def test_a_scheduler_address():
    with loopback_cluster(n_workers=1) as cluster:
        with aiopar.use_backend("dask", address=cluster.scheduler_address) as backend:
            assert aiopar.fork(double, 8).wait() == 16
            assert backend.max_workers == 1
        backend.shutdown()


def test_a_worker_that_keeps_dying_raises_broken_worker_error():
    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        backend = DaskBackend(n_workers=1, threads_per_worker=1)
    try:
        with pytest.raises(aiopar.BrokenWorkerError, match="died"):
            backend.fork(os._exit, 1).wait(timeout=30)
        assert backend.fork(double, 5).wait(timeout=30) == 10  # the nanny replaced it
    finally:
        backend.shutdown()


def test_interpreter_exit_runs_pending_work(tmp_path):
    script = """
        import sys, time, aiopar

        def touch(path):
            time.sleep(0.3)
            open(path, "w").close()

        if __name__ == "__main__":
            with aiopar.use_backend("dask", n_workers=1, threads_per_worker=1, processes=False):
                aiopar.fork(touch, sys.argv[1])
    """
    done = run_python(script, str(tmp_path / "ran"), timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ran").exists()


def test_exit_runs_thread_tasks_that_fork_on_dask(tmp_path):
    # A thread task still queued at exit forks on a dask backend: the dask
    # backend shuts down only after every backend has run what was queued.
    script = """
        import sys, time, aiopar

        def touch(path):
            open(path, "w").close()

        def task(dask, path):
            time.sleep(0.2)
            dask.fork(touch, path).wait(timeout=30)

        if __name__ == "__main__":
            dask = aiopar.get_backend("dask", n_workers=1, threads_per_worker=1, processes=False)
            aiopar.get_backend("thread", max_workers=1).fork(task, dask, sys.argv[1])
    """
    done = run_python(script, str(tmp_path / "ran"), timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ran").exists(), done.stderr


def test_ctrl_c_cancels_the_forks_that_have_not_started():
    # As on the other backends: after an uncaught Ctrl-C, exit waits only for
    # what is running; the queued forks never start.
    proc = start_python(
        """
        import sys, time, aiopar

        sys.path.insert(0, sys.argv[1])
        from dask_helpers import tasks_to_run

        futures = []

        def task(i):
            import __main__  # this process's, not the copy of its globals a fork takes along

            print(f"started {i}", flush=True)
            # Runs until Ctrl-C has cancelled the four forks queued behind it
            # and dask has dropped their tasks (or for 20 s: then the next
            # one starts, and the test fails).
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                queued = __main__.futures[1:]
                if len(queued) == 4 and all(f.cancelled() for f in queued):
                    if tasks_to_run(__main__.backend) <= 1:  # this one's, if not cancelled
                        break
                time.sleep(0.01)

        with aiopar.use_backend(
            "dask", n_workers=1, threads_per_worker=1, processes=False
        ) as backend:
            futures.extend(aiopar.fork(task, i) for i in range(5))
            aiopar.wait_all(futures)
        """,
        os.path.dirname(__file__),
    )
    try:
        assert proc.stdout.readline() == "started 0\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err
    assert "started" not in out, f"forks queued before Ctrl-C still ran: {out}"
    assert "nobody retrieved" not in err, err  # aiopar's own wait_all leaves nothing unread


def test_a_backend_that_failed_to_connect_leaves_exit_clean():
    done = run_python(
        """
        import aiopar

        try:
            aiopar.use_backend("dask", address="tcp://127.0.0.1:1", timeout=1).__enter__()
        except OSError as error:
            print("OSError", error)
        """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OSError")
    assert "Exception ignored" not in done.stderr, done.stderr
    assert "Error" not in done.stderr, done.stderr


def test_settler_threads_hand_over_while_a_callback_blocks(inproc):
    gate: aiopar.Future[None] = aiopar.Future()
    blocked = inproc.fork(double, 1).then(lambda f: (gate.wait(10), f.value())[1])
    # Another result settles while the first callback is still blocked.
    assert inproc.fork(double, 2).wait(timeout=10) == 4
    gate.set_result(None)
    assert blocked.wait(timeout=10) == 2


def _on_an_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_a_forks_callbacks_run_off_dasks_loop_and_its_waiter_wakes_without_them(inproc):
    # The future settles on the client's loop; its callbacks go to a settler thread.
    released.clear()
    held = inproc.fork(hold_the_worker)
    gate = threading.Event()
    on_loop: list[bool] = []
    held.add_done_callback(lambda f: (on_loop.append(_on_an_event_loop()), gate.wait(30)))
    released.set()
    assert held.wait(timeout=30) == "held"  # while its callback still blocks
    assert inproc.fork(double, 3).wait(timeout=30) == 6  # and dask's loop goes on
    assert wait_until(lambda: on_loop, timeout=30)
    gate.set()
    assert on_loop == [False]


def _record_sends(backend: DaskBackend, monkeypatch) -> list[tuple[str, frozenset]]:
    """What the client sends the scheduler from now on: each message's op and keys."""
    sent: list[tuple[str, frozenset]] = []
    stream = backend.client.scheduler_comm
    send = stream.send

    def recording(*msgs):
        sent.extend((msg["op"], frozenset(msg.get("keys", ()))) for msg in msgs)
        return send(*msgs)

    monkeypatch.setattr(stream, "send", recording)
    return sent


def test_a_fork_waited_for_alone_lets_go_of_its_key_behind_the_next_forks_graph(
    inproc, monkeypatch
):
    # Ahead of that graph, the key's release would start the scheduler's
    # batch interval to the worker, which the next task would wait out.
    monkeypatch.setattr(_results, "KEEP_ALONE", 60.0)  # only the next fork lets go
    sent = _record_sends(inproc, monkeypatch)
    assert [inproc.fork(double, x).wait(timeout=30) for x in range(3)] == [0, 2, 4]
    graphs = [keys for op, keys in sent if op == "update-graph"]
    assert len(graphs) == 3
    for before, after in itertools.pairwise(graphs):
        release = ("client-releases-keys", before)
        assert wait_until(lambda release=release: release in sent, timeout=30)
        assert sent.index(("update-graph", after)) < sent.index(release)
    assert ("client-releases-keys", graphs[-1]) not in sent  # kept: no fork came after it


def test_a_fork_waited_for_alone_lets_go_of_its_key_when_no_other_comes(inproc, monkeypatch):
    sent = _record_sends(inproc, monkeypatch)
    assert inproc.fork(double, 4).wait(timeout=30) == 8
    (graph,) = [keys for op, keys in sent if op == "update-graph"]
    assert wait_until(lambda: ("client-releases-keys", graph) in sent, timeout=30)


def test_the_embedded_cluster_uses_tls_unless_told_not_to(procs):
    pytest.importorskip("cryptography")  # Security.temporary() makes its certificates with it
    import urllib.request

    plain = DaskBackend(n_workers=1, threads_per_worker=1, security=False)
    try:
        for backend, scheme in ((procs, "tls://"), (plain, "tcp://")):  # (procs: no security=)
            assert backend.client.scheduler.address.startswith(scheme)
            assert backend.fork(double, 3).wait() == 6
            port = backend._cluster.scheduler.http_server.port
            if scheme == "tls://":
                with pytest.raises(OSError):  # its HTTP pages over TLS only
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
            else:
                assert urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
    finally:
        plain.shutdown()


def test_tls_through_dasks_security():
    pytest.importorskip("cryptography")  # Security.temporary() makes its certificates with it
    backend = DaskBackend(
        n_workers=1, threads_per_worker=1, security=distributed.Security.temporary()
    )
    try:
        assert backend.client.scheduler.address.startswith("tls://")
        assert backend.fork(double, 4).wait() == 8
    finally:
        backend.shutdown()


def test_a_tls_scheduler_at_a_tcp_address_is_reached_with_the_certificates_given():
    # init_rpc and aiopar worker reached it so; use_backend said it "takes TLS only".
    pytest.importorskip("cryptography")  # Security.temporary() makes its certificates with it
    security = distributed.Security.temporary()
    with distributed.LocalCluster(
        n_workers=1,
        threads_per_worker=1,
        processes=False,
        host="127.0.0.1",
        protocol="tls://",
        security=security,
        dashboard_address="127.0.0.1:0",
    ) as cluster:
        port = cluster.scheduler_address.rsplit(":", 1)[1]
        address = f"tcp://127.0.0.1:{port}"
        with aiopar.use_backend("dask", address=address, security=security) as backend:
            assert aiopar.fork(double, 5).wait() == 10
            assert backend.client.scheduler.address == f"tls://127.0.0.1:{port}"
        backend.shutdown()
        # no certificates: said so
        with (
            pytest.raises(OSError, match="takes TLS only"),
            aiopar.use_backend("dask", address=address),
        ):
            pass


def test_a_scheduler_without_tls_when_encryption_is_required_is_named_so():
    # It read as "no dask scheduler at ...".
    with loopback_cluster(n_workers=0) as cluster:
        address = cluster.scheduler_address
        tls = distributed.Security(require_encryption=True)
        with (
            pytest.raises(OSError, match="requires encryption") as raised,
            aiopar.use_backend("dask", address=address, security=tls, timeout=10),
        ):
            pass
        assert "no dask scheduler" not in str(raised.value)
        assert address in str(raised.value)


def test_a_silent_address_fails_within_the_timeout_naming_it():
    # dask's own connect waited 30 s, and use_backend took no timeout.
    script = """
        import socket, aiopar
        silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        try:
            with aiopar.use_backend("dask", address=address, timeout=1):
                pass
        except TimeoutError as exc:
            print(address in str(exc), "within 1 s" in str(exc))
    """
    done = run_python(script, timeout=60)
    assert done.stdout.split() == ["True", "True"], done.stderr


def test_a_bad_address_or_client_fails_at_use_backend_saying_what_is_there():
    script = """
        import socket, aiopar
        silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        for kwargs in ({"address": address, "timeout": 1}, {"client": lambda: 42}):
            try:
                with aiopar.use_backend("dask", **kwargs):
                    pass
            except (OSError, TypeError) as exc:
                print(type(exc).__name__)
    """
    done = run_python(script, timeout=90)
    assert done.stdout.split() == ["TimeoutError", "TypeError"], done.stderr
