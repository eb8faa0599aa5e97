"""aiopar.rpc on dask: peers that join, die, time out, exit; each test its own cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import distributed
import numpy as np
import pytest
from dask_helpers import (
    Leftovers,
    after_timer,
    loopback_cluster,
    run_python,
    start_python,
    wait_until,
)

import aiopar
from aiopar import rpc

pytestmark = pytest.mark.timeout(120)


def options(**kw) -> rpc.RpcBackendOptions:
    return rpc.RpcBackendOptions(num_worker_threads=2, **kw)


def test_shutdown_stops_the_cluster_and_its_threads(leaves_nothing_behind):
    rpc.init_rpc("worker0", world_size=2, rpc_backend_options=options())
    assert rpc.rpc_sync("worker1", np.add, args=(1, 2)) == 3
    rpc.shutdown()


def test_a_peer_that_dies_fails_its_pending_calls_naming_it(leaves_nothing_behind):
    rpc.init_rpc("worker0", world_size=2, rpc_backend_options=options())
    try:
        pending = rpc.rpc_async("worker1", after_timer, args=(60, None))
        rpc.rpc_async("worker1", os._exit, args=(1,))
        start = time.monotonic()
        with pytest.raises(aiopar.BrokenWorkerError, match="'worker1'"):
            pending.wait(timeout=30)
        assert time.monotonic() - start < 10
        # Its nanny starts it again: later calls reach the new worker1.
        deadline = time.monotonic() + 30
        while True:
            try:
                assert rpc.rpc_sync("worker1", np.add, args=(2, 2), timeout=5) == 4
                break
            except (aiopar.BrokenWorkerError, ValueError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
    finally:
        rpc.shutdown(graceful=False)


def test_the_default_timeout_is_set_in_init_rpc(leaves_nothing_behind):
    rpc.init_rpc("worker0", world_size=2, rpc_backend_options=options(rpc_timeout=0.3))
    try:
        with pytest.raises(TimeoutError, match="rpc_timeout"):
            rpc.rpc_sync("worker1", after_timer, args=(5, None))
        assert rpc.rpc_sync("worker1", after_timer, args=(0.5, "late"), timeout=5) == "late"
        assert rpc.rpc_sync("worker1", after_timer, args=(0.5, "ok"), timeout=0) == "ok"
        # and read and changed after it, as torch's get_rpc_timeout and _set_rpc_timeout
        assert rpc.get_rpc_timeout() == 0.3
        rpc.set_rpc_timeout(10)
        assert rpc.get_rpc_timeout() == 10
        assert rpc.rpc_sync("worker1", after_timer, args=(0.5, "longer")) == "longer"
        rpc._set_rpc_timeout(0.2)
        with pytest.raises(TimeoutError, match=r"after 0\.2 s"):
            rpc.rpc_sync("worker1", after_timer, args=(5, None))
        rpc.set_rpc_timeout(float("inf"))
        assert rpc.get_rpc_timeout() == 0  # no limit, as RpcBackendOptions spells it
        for bad in (-1, "1", None, float("nan")):
            with pytest.raises(ValueError, match="rpc_timeout is a number of seconds"):
                rpc.set_rpc_timeout(bad)
    finally:
        rpc.shutdown()


def test_a_name_torch_gives_another_peer_is_refused(leaves_nothing_behind):
    with pytest.raises(ValueError, match="call this peer worker0"):
        rpc.init_rpc("worker1", world_size=3)


def test_every_process_that_calls_init_rpc_is_a_peer(scheduler, leaves_nothing_behind):
    script = """
        import sys
        import numpy as np
        from aiopar import rpc

        name, rank, address = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        options = rpc.RpcBackendOptions(init_method=address)
        rpc.init_rpc(name, rank=rank, world_size=3, rpc_backend_options=options)
        other = "worker2" if rank == 1 else "worker1"
        print(rpc.rpc_sync(other, np.add, args=(rank, 10)))
        rpc.shutdown()  # waits until every peer that joined calls it
    """
    procs = [start_python(script, f"worker{rank}", str(rank), scheduler) for rank in (1, 2)]
    try:
        rpc.init_rpc(
            "worker0",
            rank=0,
            world_size=3,
            rpc_backend_options=options(init_method=scheduler, rpc_timeout=60),
        )
        assert [info.name for info in rpc.agent.current_agent().peers()] == [
            "worker0",
            "worker1",
            "worker2",
        ]
        assert rpc.rpc_sync("worker2", np.add, args=(1, 2)) == 3
        rpc.shutdown()
        outputs = [proc.communicate(timeout=60) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert [proc.returncode for proc in procs] == [0, 0], [err for _, err in outputs]
    assert [out.strip() for out, _ in outputs] == ["11", "12"]


def test_aiopar_worker_serves_until_interrupted(scheduler, leaves_nothing_behind):
    command = [
        sys.executable,
        "-m",
        "aiopar",
        "worker",
        "--scheduler",
        scheduler,
        "--nthreads",
        "1",
    ]
    helpers = [
        subprocess.Popen([*command, "--name", name], stderr=subprocess.PIPE, text=True)
        for name in ("helper-a", "helper-b")
    ]
    try:
        rpc.init_rpc("main", rpc_backend_options=options(init_method=scheduler))
        joined = wait_until(
            lambda: len(rpc.agent.current_agent().peers()) >= 3, timeout=60, interval=0.1
        )
        assert joined, "the aiopar worker peers did not join"
        infos = [rpc.get_worker_info(name) for name in ("main", "helper-a", "helper-b")]
        assert len({info.id for info in infos}) == 3  # ranks given out without clashes
        assert rpc.rpc_sync("helper-a", np.add, args=(1, 2)) == 3
        for helper in helpers:
            helper.send_signal(signal.SIGTERM)
        for helper in helpers:
            assert helper.wait(timeout=30) == 0, helper.stderr.read()
        rpc.shutdown()
    finally:
        for helper in helpers:
            helper.kill()
            helper.wait()
            helper.stderr.close()


# ``aiopar worker``, which sends itself SIGTERM as it starts to join its
# scheduler (argv[2] "joining"), to start its peer there ("starting"), or
# the moment it says it serves ("serves").
SIGNALLED_WORKER = """
    import os, signal, sys
    from aiopar import cli
    from aiopar_dask import _engine, _rendezvous

    scheduler, at, name = sys.argv[1:]

    def signal_now():
        os.kill(os.getpid(), signal.SIGTERM)

    def signal_first(module, function):
        original = getattr(module, function)

        async def signalled(*args):
            signal_now()
            return await original(*args)

        setattr(module, function, signalled)

    if at == "joining":
        signal_first(_rendezvous, "join")
    elif at == "starting":
        signal_first(_engine, "_registered")
    else:
        say = _engine._say

        def say_then_signal(line):
            say(line)
            if "serves at" in line:
                signal_now()

        _engine._say = say_then_signal
    sys.exit(cli.main(["worker", "--scheduler", scheduler, "--name", name, "--nthreads", "1"]))
"""


@pytest.mark.parametrize("at", ["joining", "starting", "serves"])
def test_aiopar_worker_stops_cleanly_on_a_signal_from_its_start(scheduler, at):
    # A SIGTERM as it joins, starts or says it serves stops the peer as one
    # at any later time does: the handlers are in place first, and a peer
    # that is starting starts, then stops.
    worker = run_python(SIGNALLED_WORKER, scheduler, at, "helper", timeout=90)
    assert worker.returncode == 0, worker.stderr
    said = {
        "joining": "aiopar worker: rpc peer 'helper' stopped before it joined: SIGTERM",
        "starting": "aiopar worker: rpc peer 'helper' stopped: SIGTERM",
        "serves": "aiopar worker: rpc peer 'helper' stopped: SIGTERM",
    }[at]
    assert said in worker.stderr
    assert ("serves at" in worker.stderr) == (at == "serves")
    assert "Traceback" not in worker.stderr
    assert wait_until(lambda: "helper" not in peer_names(scheduler), timeout=30)


def aiopar_worker(scheduler: str, name: str, *more: str) -> subprocess.Popen[str]:
    """``aiopar worker`` as a user starts it, its messages (stderr) piped."""
    command = [sys.executable, "-m", "aiopar", "worker", "--scheduler", scheduler]
    return subprocess.Popen(
        [*command, "--name", name, "--nthreads", "1", *more], stderr=subprocess.PIPE, text=True
    )


def test_each_job_on_a_shared_scheduler_meets_its_own_ranks(scheduler, leaves_nothing_behind):
    # Two jobs in turn on one scheduler, this process rank 0 of each; their
    # rank 1 starts once rank 0 waits there. In the first, rank 1 joins and
    # leaves at once: having joined, it counts. In the second, rank 0 waits
    # for the second's own rank 1 (the first's once counted, and init_rpc
    # returned before its rank 1 was there).
    script = """
        import os, sys
        from aiopar import rpc

        options = rpc.RpcBackendOptions(init_method=sys.argv[1])
        if sys.argv[2] == "leaves":  # no world_size: it does not wait for rank 0
            rpc.init_rpc("worker1", rank=1, rpc_backend_options=options)
            rpc.shutdown(graceful=False)
        else:
            rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options)
            print(rpc.rpc_sync("worker0", os.getpid), flush=True)
            rpc.shutdown()
    """
    for how in ("leaves", "stays"):
        rank_1: list[subprocess.Popen[str]] = []

        def start_rank_1(how: str = how, rank_1: list = rank_1) -> None:
            if wait_until(lambda: "worker0" in peer_names(scheduler), timeout=60, interval=0.1):
                rank_1.append(start_python(script, scheduler, how))

        starter = threading.Thread(target=start_rank_1)
        starter.start()
        try:
            rpc.init_rpc(
                "worker0", rank=0, world_size=2, rpc_backend_options=options(init_method=scheduler)
            )
            try:
                if how == "stays":
                    assert rpc.rpc_sync("worker1", os.getpid) == rank_1[0].pid
            finally:
                rpc.shutdown()
        finally:
            starter.join()
            for proc in rank_1:
                out, err = proc.communicate(timeout=60)
                assert proc.returncode == 0, err
                assert out.split() == ([] if how == "leaves" else [str(os.getpid())])


def test_a_call_to_a_peer_that_died_says_so_and_a_misspelt_name_is_no_peer(
    scheduler, leaves_nothing_behind
):
    helper = aiopar_worker(scheduler, "helper")
    try:
        assert "serves at" in helper.stderr.readline()
        rpc.init_rpc("main", rpc_backend_options=options(init_method=scheduler))
        try:
            pending = rpc.rpc_async("helper", time.sleep, args=(60,))
            helper.kill()
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"'helper' .* has left or died"):
                pending.wait(timeout=30)  # at once: its connection broke
            assert time.monotonic() - start < 10
            assert wait_until(lambda: "helper" not in peer_names(scheduler), timeout=30)
            # torch's users catch RuntimeError; the message names the peer
            with pytest.raises(RuntimeError, match=r"rpc peer 'helper' \(id -1\) has left or died"):
                rpc.rpc_sync("helper", abs, args=(-1,))
            with pytest.raises(ValueError, match="there is no rpc peer called 'helpr'"):
                rpc.rpc_sync("helpr", abs, args=(-1,))
        finally:
            rpc.shutdown()
    finally:
        helper.kill()
        helper.wait()
        helper.stderr.close()


def test_a_peer_known_dead_fails_at_once_and_one_of_its_name_that_joins_later_is_found(
    scheduler, leaves_nothing_behind
):
    # Every call to a dead peer asked the scheduler again, which lists every
    # worker: 300 calls, 299 look-ups.
    from aiopar_dask._agent import _RELOOK

    helpers = [aiopar_worker(scheduler, "helper")]
    try:
        assert "serves at" in helpers[0].stderr.readline()
        rpc.init_rpc("main", rpc_backend_options=options(init_method=scheduler))
        try:
            assert rpc.rpc_sync("helper", os.getpid) == helpers[0].pid
            helpers[0].kill()
            with pytest.raises(aiopar.BrokenWorkerError):  # its connection broke
                rpc.rpc_sync("helper", os.getpid, timeout=30)
            with pytest.raises(aiopar.BrokenWorkerError):  # and the scheduler says so
                rpc.rpc_sync("helper", os.getpid, timeout=30)
            agent = rpc.agent.current_agent()
            look_ups = []
            look_up = agent.refresh_peers

            async def counted():
                look_ups.append(time.monotonic())
                await look_up()

            agent.refresh_peers = counted
            start = time.monotonic()
            for _ in range(300):
                with pytest.raises(RuntimeError, match=r"rpc peer 'helper' .* has left or died"):
                    rpc.rpc_sync("helper", os.getpid)
            spent = time.monotonic() - start
            assert len(look_ups) <= 1 + spent / _RELOOK, (len(look_ups), spent)
            helpers.append(aiopar_worker(scheduler, "helper"))
            assert "serves at" in helpers[1].stderr.readline()

            def found_again() -> bool:
                try:
                    return rpc.rpc_sync("helper", os.getpid, timeout=30) == helpers[1].pid
                except aiopar.BrokenWorkerError:
                    return False

            assert wait_until(found_again, timeout=30)
        finally:
            rpc.shutdown(graceful=False)
    finally:
        for helper in helpers:
            helper.kill()
            helper.wait()
            helper.stderr.close()


def test_ranks_of_one_job_that_give_different_world_sizes_are_refused(
    scheduler, leaves_nothing_behind
):
    script = """
        import sys
        from aiopar import rpc

        options = rpc.RpcBackendOptions(init_method=sys.argv[1], rpc_timeout=0)
        try:
            rpc.init_rpc("worker0", rank=0, world_size=3, rpc_backend_options=options)
        except KeyboardInterrupt:
            print("interrupted")
    """
    rank_0 = start_python(script, scheduler)
    try:
        assert wait_until(lambda: "worker0" in peer_names(scheduler), timeout=60, interval=0.1)
        with pytest.raises(ValueError, match="gave world_size 3, and this one 2: give every rank"):
            rpc.init_rpc(
                "worker1", rank=1, world_size=2, rpc_backend_options=options(init_method=scheduler)
            )
        rank_0.send_signal(signal.SIGINT)
        out, err = rank_0.communicate(timeout=60)
        assert out == "interrupted\n", err
    finally:
        rank_0.kill()
        rank_0.wait()


def on_which_worker() -> str:
    return str(distributed.get_worker().name)


def test_peers_run_no_task_of_the_schedulers_clients_unless_asked(leaves_nothing_behind):
    # A peer of this process beside an ordinary dask worker: a client of
    # the same scheduler had most of its tasks run inside the peer.
    with loopback_cluster(n_workers=1) as cluster:
        address = cluster.scheduler_address
        (ordinary,) = (str(worker.name) for worker in cluster.workers.values())
        rpc.init_rpc("trainer", rpc_backend_options=options(init_method=address))
        helper = None
        try:
            with distributed.Client(address, timeout=30) as client:
                tasks = [client.submit(on_which_worker, pure=False) for _ in range(20)]
                assert set(client.gather(tasks)) == {ordinary}
                # asked to, a peer runs them as any worker does
                helper = aiopar_worker(address, "helper", "--run-tasks")
                assert "serves at" in helper.stderr.readline()
                task = client.submit(os.getpid, workers=["helper"], pure=False)
                assert task.result(timeout=60) == helper.pid
        finally:
            rpc.shutdown()
            if helper is not None:
                helper.send_signal(signal.SIGTERM)
                helper.communicate(timeout=60)


def test_world_size_counts_only_ranks_below_it(scheduler, leaves_nothing_behind):
    server = aiopar_worker(scheduler, "server", "--rank", "7")
    try:
        assert "serves at" in server.stderr.readline()
        with pytest.raises(TimeoutError, match=r"ranks 0 to 1 to join, and rank 1 did not"):
            rpc.init_rpc(
                "worker0",
                rank=0,
                world_size=2,
                rpc_backend_options=options(init_method=scheduler, rpc_timeout=2),
            )
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)


def test_the_docs_ranked_peers_and_an_unranked_aiopar_worker_run_together(
    scheduler, leaves_nothing_behind
):
    # docs/distributed.md: three processes with ranks 0, 1 and 2, and a serving peer
    server = aiopar_worker(scheduler, "gpu-box")
    script = """
        import sys
        from aiopar import rpc

        rank, address = int(sys.argv[1]), sys.argv[2]
        options = rpc.RpcBackendOptions(init_method=address)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
        print(rpc.get_worker_info("gpu-box").id, rpc.rpc_sync("gpu-box", abs, args=(-rank,)))
        rpc.shutdown()
    """
    try:
        started = server.stderr.readline()
        assert "rpc peer 'gpu-box' (id -1, no rank) serves at tcp://127.0.0.1:" in started
        assert f"for the scheduler at {scheduler}" in started
        ranks = [start_python(script, str(rank), scheduler) for rank in (0, 1, 2)]
        outputs = [proc.communicate(timeout=90) for proc in ranks]
        assert [proc.returncode for proc in ranks] == [0, 0, 0], [err for _, err in outputs]
        assert [out.split() for out, _ in outputs] == [["-1", "0"], ["-1", "1"], ["-1", "2"]]
        server.send_signal(signal.SIGINT)
        _, said = server.communicate(timeout=30)
        assert server.returncode == 0, said
        assert "aiopar worker: rpc peer 'gpu-box' stopped: SIGINT" in said
    finally:
        server.kill()
        server.communicate()


def test_aiopar_worker_says_why_it_stopped_when_the_scheduler_goes(leaves_nothing_behind):
    with loopback_cluster(n_workers=0) as cluster:
        address = cluster.scheduler_address
        server = aiopar_worker(address, "server")
        try:
            assert "serves at" in server.stderr.readline()
        except BaseException:
            server.kill()
            raise
    try:
        _, said = server.communicate(timeout=60)
    finally:
        server.kill()
    assert f"rpc peer 'server' stopped: the scheduler at {address} went away" in said, said


def test_a_taken_name_is_refused(scheduler, leaves_nothing_behind):
    rpc.init_rpc("main", rpc_backend_options=options(init_method=scheduler))
    try:
        script = """
            import sys
            from aiopar import rpc

            options = rpc.RpcBackendOptions(init_method=sys.argv[1])
            try:
                rpc.init_rpc("main", rpc_backend_options=options)
            except ValueError as exc:
                print(exc)
        """
        done = run_python(script, scheduler, timeout=60)
        assert "called 'main' is in the cluster already" in done.stdout, done.stderr
    finally:
        rpc.shutdown()


def peer_names(scheduler: str) -> set[str]:
    """The names of the workers (peers) that the scheduler at ``scheduler`` lists now."""
    with distributed.Client(scheduler, timeout=30) as client:
        return {w["name"] for w in client.scheduler_info()["workers"].values()}


def assert_left_as_it_was(left: Leftovers, scheduler: str) -> None:
    """After a failed init_rpc: no peer here, nothing of it running, none at the scheduler."""
    assert rpc.agent._current is None
    with pytest.raises(RuntimeError, match="init_rpc"):
        rpc.get_worker_info()
    assert left.threads() == set()
    assert left.processes() == set()
    assert wait_until(lambda: "a" not in peer_names(scheduler), timeout=10)
    # and this process can be a peer again, under the same name
    rpc.init_rpc("a", rpc_backend_options=options(init_method=scheduler))
    assert rpc.get_worker_info().name == "a"
    rpc.shutdown()


def test_init_rpc_that_waits_in_vain_for_peers_leaves_no_peer(scheduler, leaves_nothing_behind):
    left = Leftovers()
    with pytest.raises(TimeoutError, match="for ranks 0 to 1 to join, and rank 1 did not"):
        rpc.init_rpc(
            "a", world_size=2, rpc_backend_options=options(init_method=scheduler, rpc_timeout=0.5)
        )
    assert_left_as_it_was(left, scheduler)


def test_init_rpc_with_a_taken_rank_leaves_no_peer(scheduler, leaves_nothing_behind):
    holder = aiopar_worker(scheduler, "holder", "--rank", "0")
    try:
        assert wait_until(lambda: "holder" in peer_names(scheduler), timeout=60, interval=0.2)
        left = Leftovers()
        with pytest.raises(ValueError, match="rank 0 is taken by rpc peer 'holder'"):
            rpc.init_rpc("a", rank=0, rpc_backend_options=options(init_method=scheduler))
        assert_left_as_it_was(left, scheduler)
    finally:
        holder.kill()
        holder.wait()
        holder.stderr.close()


def test_init_rpc_interrupted_while_waiting_for_peers_leaves_no_peer(scheduler):
    script = """
        import sys
        import threading
        from aiopar import rpc

        options = rpc.RpcBackendOptions(init_method=sys.argv[1], rpc_timeout=0)  # no limit
        try:
            rpc.init_rpc("a", world_size=2, rpc_backend_options=options)
        except KeyboardInterrupt:
            print("interrupted")
        print(rpc.agent._current)
        print(sorted(t.name for t in threading.enumerate() if t.name.startswith("aiopar-")))
        rpc.init_rpc("a", rpc_backend_options=options)
        rpc.shutdown()
        print("again")
    """
    proc = start_python(script, scheduler)
    try:
        joined = wait_until(lambda: "a" in peer_names(scheduler), timeout=60, interval=0.2)
        assert joined, proc.stderr.read() if proc.poll() is not None else "peer a never joined"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert out.split("\n") == ["interrupted", "None", "[]", "again", ""], err


@pytest.mark.parametrize("rpc_timeout", [float("inf"), 1e300])
def test_an_infinite_rpc_timeout_is_no_limit(scheduler, leaves_nothing_behind, rpc_timeout):
    opts = options(init_method=scheduler, rpc_timeout=rpc_timeout)
    rpc.init_rpc("a", world_size=1, rpc_backend_options=opts)
    try:
        assert rpc.rpc_sync("a", np.add, args=(1, 2)) == 3
        assert rpc.remote("a", np.add, args=(2, 2)).to_here() == 4
        # and calls with a timeout still time out
        late = rpc.rpc_async("a", after_timer, args=(2, None), timeout=0.2)
        with pytest.raises(TimeoutError, match=r"no reply after 0\.2 s"):
            late.wait(timeout=10)
    finally:
        rpc.shutdown()


def test_exit_without_shutdown_leaves_nothing_running(tmp_path):
    script = """
        import numpy as np
        from aiopar import rpc

        rpc.init_rpc("worker0", world_size=2)
        print(rpc.rpc_sync("worker1", np.add, args=(1, 2)))
    """
    done = run_python(script, timeout=60)
    assert done.stdout.strip() == "3", done.stderr


def test_exit_runs_queued_tasks_that_call_peers_before_leaving():
    # The peer leaves at exit only once the thread tasks still queued have
    # run: their calls once failed with "this rpc peer has shut down".
    script = """
        import threading, time
        import numpy as np
        import aiopar
        from aiopar import rpc

        printing = threading.Lock()  # a blocked call's worker is compensated: two print at once

        def call(i):
            time.sleep(0.1)
            value = rpc.rpc_sync("worker1", np.add, args=(i, 100))
            with printing:
                print(value, flush=True)

        rpc.init_rpc("worker0", world_size=2)
        pool = aiopar.get_backend("thread", max_workers=1)
        for i in range(4):
            pool.fork(call, i)
    """
    done = run_python(script, timeout=90)
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.split()) == ["100", "101", "102", "103"], done.stderr


def test_tls_through_dasks_security(leaves_nothing_behind):
    pytest.importorskip("cryptography")  # Security.temporary() makes its certificates with it
    tls = distributed.Security.temporary()
    rpc.init_rpc("worker0", world_size=2, rpc_backend_options=options(security=tls))
    try:
        agent = rpc.agent.current_agent()
        assert agent.cluster.scheduler_address.startswith("tls://")
        assert agent._listener._context is not None  # the calls are encrypted too
        assert rpc.rpc_sync("worker1", np.add, args=(1, 2)) == 3
    finally:
        rpc.shutdown()
