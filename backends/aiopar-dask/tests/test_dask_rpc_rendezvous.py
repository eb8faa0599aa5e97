"""Where the ranks of a torch job meet: env://, tcp://, and what goes wrong on the way.

Each rank is a script of its own, started as torch's docs start them
(``python script.py RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set), with
a timeout; rank 0 starts the scheduler on loopback and the others join it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from aiopar_dask import _credentials
from dask_helpers import listening_addresses

from aiopar import rpc

pytestmark = pytest.mark.timeout(180)

# A training script as torch's tutorials write one: its rank comes from
# the command line, where to meet from MASTER_ADDR and MASTER_PORT. Its
# functions run on the other rank as that rank's own, module state and
# all. It reports what it found as a JSON line.
SCRIPT = """
    import dataclasses, json, os, stat, sys, threading
    import psutil
    from aiopar import rpc
    from aiopar_dask import _credentials, _wire

    LOCK = threading.Lock()  # (a lock does not pickle: the function must go by name)
    calls = 0


    def bump():
        global calls
        with LOCK:
            calls += 1
            return calls


    @dataclasses.dataclass
    class Point:
        x: int


    def report(rank):
        agent = rpc.agent.current_agent()
        other = f"worker{1 - rank}"
        found = {
            "bumps": [rpc.rpc_sync(other, bump) for _ in range(3)] if rank == 0 else None,
            "a_point": isinstance(rpc.rpc_sync(other, Point, args=(1,)), Point),
            "other_pid": rpc.rpc_sync(other, os.getpid),
            "peers": [info.name for info in rpc.agent.current_agent().peers()],
            "scheduler": agent.worker.scheduler.address,
            "hosts": agent.cluster is not None,
            "children": len(psutil.Process().children()),
        }
        if rank == 1:
            where = _credentials.path(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
            found["modes"] = [oct(stat.S_IMODE(os.stat(p).st_mode)) for p in (where.parent, where)]
            context = agent.worker.connection_args.get("ssl_context")
            port = agent._lookup("worker0").port
            try:  # the rpc wire still asks for the cluster's secret
                _wire.connect("127.0.0.1", port, 5, context, _wire.new_secret(), "stranger")
            except PermissionError:
                found["stranger"] = "refused"
        return found


    def main(rank):
        print("joining", flush=True)
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        print(json.dumps(report(rank)), flush=True)
        rpc.shutdown()


    if __name__ == "__main__":
        main(int(sys.argv[1]))
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rank_environment(port: int, **more: str) -> dict[str, str]:
    """This environment with the rendezvous at 127.0.0.1:``port``, and
    distributed's logs as a user sees them (the tests' conftest quiets them)."""
    env = {k: v for k, v in os.environ.items() if k != "DASK_LOGGING__DISTRIBUTED"}
    return {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **more}


def start_rank(script: str, rank: int, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, script, str(rank)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_each_rank_a_script_meeting_at_master_addr_and_port(tmp_path, leaves_nothing_behind):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    port = free_port()
    env = rank_environment(port)
    ranks = [start_rank(str(script), 1, env)]  # rank 1 first: it waits for rank 0
    try:
        assert ranks[0].stdout.readline() == "joining\n", ranks[0].communicate(timeout=60)
        ranks.insert(0, start_rank(str(script), 0, env))
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert [rank.returncode for rank in ranks] == [0, 0], [err for _, err in outputs]
    assert [err for _, err in outputs] == ["", ""]  # not a word from dask either
    reports = [json.loads(out.splitlines()[-1]) for out, _ in outputs]
    for rank, report in enumerate(reports):
        assert report["other_pid"] == ranks[1 - rank].pid  # the other script itself
        assert report["peers"] == ["worker0", "worker1"]
        assert report["scheduler"] == f"tls://127.0.0.1:{port}"  # closed by default
        assert report["hosts"] is (rank == 0)
        assert report["children"] == 0  # no rank started a world of its own
    assert reports[0]["bumps"] == [1, 2, 3]  # worker1's own counter, as in torch
    assert [report["a_point"] for report in reports] == [True, True]  # the caller's own class
    assert reports[1]["modes"] == ["0o700", "0o600"]
    assert reports[1]["stranger"] == "refused"
    assert not _credentials.path("127.0.0.1", port).exists()  # rank 0 took them along


def test_a_tcp_rendezvous_rank_0_joins_late_on_loopback(leaves_nothing_behind):
    # torch's init_method="tcp://host:port": this process is rank 0, and
    # rank 1, a script started before it, keeps trying until it is there.
    address = f"tcp://127.0.0.1:{free_port()}"
    rank_1 = """
        import os, sys
        from aiopar import rpc

        calls = 0

        def bump():
            global calls
            calls += 1
            return calls

        options = rpc.RpcBackendOptions(init_method=sys.argv[1])
        print("joining", flush=True)
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options)
        print(rpc.rpc_sync("worker0", os.getpid), flush=True)
        # rank 0 runs another script: bump travels by value, its globals copied
        print(*[rpc.rpc_sync("worker0", bump) for _ in range(3)], calls, flush=True)
        rpc.shutdown()
    """
    other = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(rank_1), address],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert other.stdout.readline() == "joining\n", other.communicate(timeout=60)
        options = rpc.RpcBackendOptions(init_method=address, num_worker_threads=2)
        rpc.init_rpc("worker0", rank=0, world_size=2, rpc_backend_options=options)
        try:
            agent = rpc.agent.current_agent()
            assert agent.cluster.scheduler_address == address.replace("tcp://", "tls://")
            assert rpc.rpc_sync("worker1", os.getpid) == other.pid
            assert listening_addresses({os.getpid(), other.pid}) == {"127.0.0.1"}
        finally:
            rpc.shutdown()
        out, err = other.communicate(timeout=60)
    finally:
        other.kill()
        other.wait()
    assert other.returncode == 0, err
    assert out.split() == [str(os.getpid()), "1", "1", "1", "0"]


@pytest.mark.parametrize(
    ("env", "call", "words"),
    [
        ({}, {"rank": 1, "world_size": 2}, "MASTER_ADDR and MASTER_PORT to rank 0's address"),
        ({"MASTER_ADDR": "127.0.0.1"}, {"rank": 1, "world_size": 2}, "MASTER_PORT is not set"),
        ({"MASTER_PORT": "29500"}, {"rank": 0, "world_size": 2}, "MASTER_ADDR is not set"),
        ({}, {"rank": 0, "init_method": "env://"}, "MASTER_ADDR and MASTER_PORT are not set"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "http"}, {"rank": 0}, "MASTER_PORT must be a port"),
        ({"MASTER_ADDR": "h", "MASTER_PORT": "1", "RANK": "one"}, {}, "variable RANK"),
    ],
)
def test_a_rendezvous_without_its_variables_says_which_are_missing(monkeypatch, env, call, words):
    for variable in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(variable, raising=False)
    for variable, value in env.items():
        monkeypatch.setenv(variable, value)
    options = rpc.RpcBackendOptions(init_method=call.pop("init_method", None))
    with pytest.raises(ValueError, match=words):
        rpc.init_rpc(f"worker{call.get('rank', 0)}", **call, rpc_backend_options=options)
    assert rpc.agent._current is None


def test_rank_1_tries_to_reach_rank_0_until_its_rpc_timeout(monkeypatch, leaves_nothing_behind):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    options = rpc.RpcBackendOptions(rpc_timeout=1)
    with pytest.raises(TimeoutError, match=rf"127\.0\.0\.1:{port}: the connection was refused"):
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options)


def test_rank_0_alone_names_the_ranks_that_did_not_come(monkeypatch, leaves_nothing_behind):
    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    options = rpc.RpcBackendOptions(rpc_timeout=1, num_worker_threads=1)
    with pytest.raises(TimeoutError, match="ranks 1, 2 did not"):
        rpc.init_rpc("worker0", rank=0, world_size=3, rpc_backend_options=options)
    assert not _credentials.path("127.0.0.1", port).exists()
    with socket.socket() as sock:  # and its scheduler is gone
        assert sock.connect_ex(("127.0.0.1", port)) != 0


def test_a_rank_of_another_machine_is_told_to_bring_certificates(
    tmp_path, monkeypatch, leaves_nothing_behind
):
    # Rank 0's certificates are where only the ranks of its machine look:
    # this process looks elsewhere, as a rank on another machine would.
    port = free_port()
    rank_0 = """
        import sys
        from aiopar import rpc

        rpc.init_rpc("worker0", rank=0, world_size=1)
        print("ready", flush=True)
        sys.stdin.read()
        rpc.shutdown()
    """
    host = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(rank_0)],
        env=rank_environment(port),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout.readline() == "ready\n", host.communicate(timeout=60)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(OSError, match="takes TLS only") as raised:
            rpc.init_rpc("worker1", rank=1, rpc_backend_options=rpc.RpcBackendOptions())
        assert "security=distributed.Security(...)" in str(raised.value)
        assert "security=False" in str(raised.value)
        _, err = host.communicate("", timeout=60)
    finally:
        host.kill()
        host.wait()
    assert host.returncode == 0, err


CRASHING = """
    import os, signal, sys, threading, time
    from aiopar import rpc

    LOCK, READY = threading.Lock(), threading.Event()
    ready = 0


    def here():  # runs on rank 0, for each other rank past init_rpc
        global ready
        with LOCK:
            ready += 1
            if ready == 2:
                READY.set()


    rank, how = int(sys.argv[1]), sys.argv[2]
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3)
    if rank != 0:
        try:
            rpc.rpc_sync("worker0", here)
        except RuntimeError:  # rank 0 crashed before it replied
            pass
    else:  # hosts the rendezvous's scheduler, and crashes once the others are in
        assert READY.wait(60)
        if how == "raise":
            raise RuntimeError("a bug in rank 0's training loop")
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    rpc.shutdown()
    print("left after", time.monotonic() - start, flush=True)
"""


@pytest.mark.parametrize("how", ["raise", "exit", "kill"])
def test_shutdown_of_the_other_ranks_survives_a_crashed_rank_0(how, tmp_path):
    # An exception in rank 0 failed the others' shutdown with "ConnectionPool
    # is closed" (rank 0's scheduler closed their peers as it went).
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(CRASHING))
    # (a killed rank 0 leaves its certificates: here, not in the user's directory)
    env = rank_environment(free_port(), XDG_RUNTIME_DIR=str(tmp_path))
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), how],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(3)
    ]
    try:
        outputs = [rank.communicate(timeout=120) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    assert ranks[0].returncode != 0
    for rank, (out, err) in zip(ranks[1:], outputs[1:], strict=True):
        assert rank.returncode == 0, err
        assert out.startswith("left after"), err
        assert float(out.split()[-1]) < 10, out
        assert "Traceback" not in err and "Could not close" not in err, err
        if "shutdown left without waiting" in err:  # (else it had not heard who stays)
            assert "0 (worker0)" in err, err


def test_a_rank_waiting_in_init_rpc_fails_at_once_when_rank_0_dies(tmp_path):
    # It waited for dask's 30 s connect timeout, then raised dask's OSError.
    import distributed
    from dask_helpers import wait_until

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
            import sys
            from aiopar import rpc

            rank = int(sys.argv[1])
            options = rpc.RpcBackendOptions(security=False, rpc_timeout=120)
            try:  # rank 2 never comes
                rpc.init_rpc(f"worker{rank}", rank=rank, world_size=3, rpc_backend_options=options)
            except ConnectionError as exc:
                print(type(exc).__name__, exc, flush=True)
        """)
    )
    port = free_port()
    env = rank_environment(port)
    ranks = [start_rank(str(script), rank, env) for rank in (0, 1)]
    try:
        with distributed.Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:

            def both_wait() -> bool:
                rounds = client.get_metadata(["aiopar-rpc-rounds"], default=None) or {}
                return any(set(r["members"]) == {"0", "1"} for r in rounds.values())

            assert wait_until(both_wait, timeout=60)
        ranks[0].kill()
        killed = time.monotonic()
        out, err = ranks[1].communicate(timeout=60)
        spent = time.monotonic() - killed
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
            rank.stdout.close()
            rank.stderr.close()
    assert out.startswith("ConnectionError init_rpc: the scheduler at"), err
    assert "rank 0" in out and "crashed" in out, out
    assert spent < 15, spent


def test_a_dead_rank_0_s_certificates_do_not_bar_a_later_scheduler_without_tls(
    scheduler, tmp_path, monkeypatch, leaves_nothing_behind
):
    # A rank 0 killed at its rendezvous leaves its certificates behind; a
    # plain scheduler that later got the same port was refused by every
    # process that joined it ("takes no TLS, and this process's Security
    # requires encryption").
    import distributed

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    host, port = scheduler.removeprefix("tcp://").rsplit(":", 1)
    _credentials.save(host, int(port), distributed.Security.temporary())
    options = rpc.RpcBackendOptions(init_method=scheduler)
    rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=options)
    try:
        assert rpc.agent.current_agent().worker.scheduler.address == scheduler
    finally:
        rpc.shutdown()


@pytest.mark.parametrize("broken", ["CommClosedError", "ConnectionResetError"])
def test_a_rank_whose_connection_breaks_as_it_waits_in_init_rpc_names_the_scheduler(
    broken, scheduler, monkeypatch, leaves_nothing_behind
):
    # Its connection to the scheduler broke (rank 0 killed) before the
    # scheduler counted as lost: dask's CommClosedError came out of init_rpc.
    from aiopar_dask import _rounds
    from distributed.comm import CommClosedError

    error = {"CommClosedError": CommClosedError, "ConnectionResetError": ConnectionResetError}

    async def connection_breaks(*args: object) -> bool:
        raise error[broken]("in <TCP (closed)>: ConnectionResetError: [Errno 104]")

    monkeypatch.setattr(_rounds, "wait_for_ranks", connection_breaks)
    options = rpc.RpcBackendOptions(init_method=scheduler, rpc_timeout=60)
    with pytest.raises(ConnectionError, match=f"init_rpc: the scheduler at {scheduler} went away"):
        rpc.init_rpc("worker1", rank=1, world_size=2, rpc_backend_options=options)


def test_rank_0_says_at_once_what_holds_the_port_when_it_is_no_dask_scheduler():
    # A silent server on MASTER_PORT (torch's TCPStore is one) kept rank 0 waiting 60 s.
    script = """
        import os, socket, time
        from aiopar import rpc

        silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(silent.getsockname()[1]))
        start = time.monotonic()
        try:
            rpc.init_rpc("worker0", rank=0, world_size=2)
        except OSError as exc:
            print(time.monotonic() - start)
            print(exc)
    """
    from dask_helpers import run_python

    done = run_python(script, timeout=60)
    spent, message = done.stdout.split("\n", 1)
    assert float(spent) < 15, done.stdout + done.stderr
    assert "rank 0 cannot start the rendezvous at tcp://127.0.0.1:" in message, message
    assert "something holds that port" in message and "TCPStore" in message, message


def test_no_rank_joins_a_scheduler_its_rank_0_did_not_start_at_master_port(
    scheduler, monkeypatch, leaves_nothing_behind
):
    # A stranger's plain scheduler on MASTER_PORT got every rank: it listed
    # them, read the job's secret and ran code in them.
    import distributed

    host, port = scheduler.removeprefix("tcp://").rsplit(":", 1)
    monkeypatch.setenv("MASTER_ADDR", host)
    monkeypatch.setenv("MASTER_PORT", port)
    for rank in (0, 1):
        with pytest.raises(OSError, match="did not start it") as raised:
            rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        assert f"tcp://{host}:{port}" in str(raised.value)
        assert "dask scheduler" in str(raised.value)
    with distributed.Client(scheduler, timeout=30) as stranger:
        assert stranger.scheduler_info()["workers"] == {}
    # Joining it on purpose: the user says so.
    options = rpc.RpcBackendOptions(security=False)
    rpc.init_rpc("worker0", rank=0, world_size=1, rpc_backend_options=options)
    rpc.shutdown()


def test_a_rank_says_soon_that_a_silent_server_holds_the_rendezvous(
    monkeypatch, leaves_nothing_behind
):
    # torchrun's TCPStore (or any server that accepts and stays silent) on
    # MASTER_PORT kept every rank waiting its whole rpc_timeout, 60 s.
    from aiopar_dask._reach import SILENT

    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    port = silent.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    start = time.monotonic()
    with silent, pytest.raises(TimeoutError, match="did not answer") as raised:
        rpc.init_rpc("worker1", rank=1, world_size=2)  # rpc_timeout: 60 s
    assert time.monotonic() - start < SILENT + 10
    assert f"127.0.0.1:{port}" in str(raised.value)
    assert "TCPStore" in str(raised.value)
