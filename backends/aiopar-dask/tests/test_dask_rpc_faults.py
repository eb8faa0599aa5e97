"""aiopar.rpc on dask under faults: fork, dead owners and schedulers, bad
addresses, floods of blocked calls and dropped RRefs. Each test runs its
peers in child interpreters under a hard timeout, so a regression fails
instead of hanging the suite."""

from __future__ import annotations

import textwrap

import pytest
from dask_helpers import run_python

pytestmark = pytest.mark.timeout(180)

# What the scripts' peers run: defined in __main__, so it travels by value.
PRELUDE = """
import threading
import aiopar
from aiopar import rpc

@rpc.functions.async_execution
def after_timer(seconds, value):
    fut = aiopar.Future()
    threading.Timer(seconds, fut.set_result, args=(value,)).start()
    return fut
"""


def run(script: str, timeout: float, *args: str) -> list[str]:
    """The words that ``script`` printed, run with ``args`` after PRELUDE in
    a child interpreter that must end well within ``timeout`` seconds."""
    done = run_python(PRELUDE + textwrap.dedent(script), *args, timeout=timeout)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout.split()


def test_the_child_of_a_fork_is_no_peer_and_leaves_the_parents_links_alone(scheduler):
    # The parent joins a scheduler, so the child may end as a script does,
    # running its atexit handlers. (A process with an embedded cluster has
    # multiprocessing children, which the atexit handler of a forked child
    # would terminate: such a child ends with os._exit.)
    script = """
        import os, sys
        import numpy as np
        from aiopar import rpc

        options = rpc.RpcBackendOptions(init_method=sys.argv[1])
        rpc.init_rpc("parent", world_size=1, rpc_backend_options=options)
        assert rpc.rpc_sync("parent", np.add, args=(1, 1)) == 2  # the link exists
        pending = rpc.rpc_async("parent", after_timer, args=(0.5, "parent's"))
        pid = os.fork()
        if pid == 0:
            try:
                rpc.rpc_sync("parent", np.add, args=(100, 100))
            except RuntimeError as exc:
                code = 0 if "init_rpc" in str(exc) and "fork" in str(exc) else 3
            else:
                code = 4
            sys.exit(code)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        print(pending.wait(timeout=20))
        print(rpc.rpc_sync("parent", np.add, args=(2, 3), timeout=20))
        rpc.shutdown()
    """
    assert run(script, 90, scheduler) == ["0", "parent's", "5"]


def test_the_child_of_a_fork_leaves_its_parents_cluster_alone_at_exit():
    script = """
        import os, sys
        import numpy as np
        from aiopar import rpc

        rpc.init_rpc("worker0", world_size=2)
        worker1 = rpc.rpc_sync("worker1", os.getpid)
        directory = rpc.agent.current_agent()._worker.local_directory
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # atexit handlers and finalizers run here
        os.waitpid(pid, 0)
        print(rpc.rpc_sync("worker1", os.getpid, timeout=20) == worker1, os.path.isdir(directory))
        rpc.shutdown()
    """
    assert run(script, 90) == ["True", "True"]


def test_to_here_of_an_rref_whose_owner_died_fails_naming_it():
    script = """
        import os, time
        import numpy as np
        import aiopar
        from aiopar import rpc

        def back_again():
            deadline = time.monotonic() + 60
            while True:
                try:
                    return rpc.rpc_sync("worker1", os.getpid, timeout=5)
                except (aiopar.BrokenWorkerError, ValueError, TimeoutError):
                    assert time.monotonic() < deadline
                    time.sleep(0.2)

        rpc.init_rpc("worker0", world_size=2)
        # The owner dies while it makes the value; its nanny starts it again.
        died = rpc.remote("worker1", os._exit, args=(1,))
        back_again()
        assert not died.confirmed_by_owner()
        try:
            died.to_here(timeout=None)
        except aiopar.BrokenWorkerError as exc:
            print("creation", "'worker1'" in str(exc))
        # The owner dies after it made the value: the new one never had it.
        made = rpc.remote("worker1", np.add, args=(1, 2))
        assert made.to_here() == 3 and made.confirmed_by_owner()
        rpc.rpc_async("worker1", os._exit, args=(1,))
        back_again()
        for fetch in (lambda: made.to_here(timeout=None), lambda: made.rpc_sync().item()):
            try:
                fetch()
            except LookupError as exc:
                print("lost", "'worker1'" in str(exc))
        rpc.shutdown()
    """
    assert run(script, 150) == ["creation", "True"] + ["lost", "True"] * 2


def test_rrefs_dropped_at_once_from_many_threads_leave_nothing_on_their_owner():
    script = """
        import gc, threading, time
        import numpy as np
        from aiopar import rpc

        def owned():
            from aiopar.rpc import _rref
            return len(_rref._owned)

        rpc.init_rpc("worker0", world_size=2)

        def drop(n):
            for i in range(n):
                rpc.remote("worker1", np.negative, args=(i,))

        threads = [threading.Thread(target=drop, args=(1500,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        gc.collect()
        rpc.rpc_sync("worker1", owned)  # sends the last ids collected
        deadline = time.monotonic() + 30
        while (left := rpc.rpc_sync("worker1", owned)) and time.monotonic() < deadline:
            time.sleep(0.1)
        print(left)
        rpc.shutdown()
    """
    assert run(script, 150) == ["0"]


def test_calls_blocked_on_a_callee_are_compensated_up_to_a_limit():
    # Each call blocks on worker1 in an rpc_sync to a gate on worker0, until
    # as many calls arrived there as the limit lets block at once, and then
    # 3 s more pass without the others (all 150 arrive without a limit).
    script = """
        import threading, time
        from aiopar import rpc
        from aiopar_dask import COMPENSATION_LIMIT

        class Gate:
            def __init__(self):
                self.arrived, self.open = [], False

            @rpc.functions.async_execution
            def wait(self):
                fut = aiopar.Future()
                if self.open:
                    fut.set_result(None)
                else:
                    self.arrived.append(fut)
                return fut

        def blocked(gate):
            seen = threading.active_count()
            gate.rpc_sync(timeout=120).wait()
            return seen

        options = rpc.RpcBackendOptions(num_worker_threads=2)
        rpc.init_rpc("worker0", world_size=2, rpc_backend_options=options)
        base = rpc.rpc_sync("worker1", threading.active_count)
        gate = Gate()
        shared = rpc.RRef(gate)
        calls = [rpc.rpc_async("worker1", blocked, args=(shared,), timeout=120) for _ in range(150)]
        while len(gate.arrived) < 2 + COMPENSATION_LIMIT:
            time.sleep(0.05)
        deadline = time.monotonic() + 3
        while len(gate.arrived) < len(calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        gate.open = True
        for fut in list(gate.arrived):
            fut.set_result(None)
        peak = max(call.wait() for call in calls)
        # the pool's 2 threads, the compensation, and a few that worker1's
        # calls to worker0 start once (its link's reader, timeouts, settler)
        print(peak - base <= 2 + COMPENSATION_LIMIT + 5, peak - base, COMPENSATION_LIMIT)
        rpc.shutdown()
    """
    assert run(script, 150)[0] == "True"


def test_joining_an_address_without_a_scheduler_fails_in_time_saying_what_is_there():
    script = """
        import http.server, socket, time
        from aiopar import rpc

        silent = socket.create_server(("127.0.0.1", 0))  # accepts (its backlog), never answers
        closed = socket.create_server(("127.0.0.1", 0))
        refused = closed.getsockname()[1]
        closed.close()
        web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
        threading.Thread(target=web.serve_forever, daemon=True).start()
        cases = {
            f"tcp://127.0.0.1:{silent.getsockname()[1]}": "accepted a connection and did not",
            f"tcp://127.0.0.1:{refused}": "refused",
            "tcp://no-such-host.invalid:8786": "does not resolve",
            f"tcp://127.0.0.1:{web.server_address[1]}": "an HTTP server answers there",
        }
        for address, found in cases.items():
            options = rpc.RpcBackendOptions(init_method=address, rpc_timeout=3)
            start = time.monotonic()
            try:
                rpc.init_rpc("a", rpc_backend_options=options)
            except OSError as exc:
                elapsed = time.monotonic() - start
                print(address in str(exc) and found in str(exc) and elapsed < 10 or exc)
    """
    assert run(script, 120) == ["True"] * 4


def test_peers_that_know_each_other_outlive_their_scheduler():
    # The scheduler and peer b are processes of their own; this script is
    # peer a. The scheduler is killed, once both have joined, while a's call to
    # b is in flight.
    script = """
        import os, signal, subprocess, sys, time
        import numpy as np

        SCHEDULER = '''
        import asyncio, distributed
        async def main():
            async with distributed.Scheduler(
                host="127.0.0.1", port=0, dashboard=False, dashboard_address="127.0.0.1:0"
            ) as s:
                print(s.address, flush=True)
                await s.finished()
        asyncio.run(main())
        '''
        PEER = '''
        import sys
        from aiopar import rpc
        options = rpc.RpcBackendOptions(init_method=sys.argv[1])
        rpc.init_rpc("b", world_size=2, rpc_backend_options=options)
        print("joined", flush=True)
        sys.stdin.read()  # until a closes it
        rpc.shutdown()
        print("b left", flush=True)
        '''
        scheduler = subprocess.Popen(
            [sys.executable, "-c", SCHEDULER], stdout=subprocess.PIPE, text=True
        )
        address = scheduler.stdout.readline().strip()
        b = subprocess.Popen(
            [sys.executable, "-c", PEER, address],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        def as_a():
            options = rpc.RpcBackendOptions(init_method=address, rpc_timeout=30)
            rpc.init_rpc("a", world_size=2, rpc_backend_options=options)
            agent = rpc.agent.current_agent()
            assert rpc.rpc_sync("b", np.add, args=(1, 1)) == 2
            # b knows a once its init_rpc has returned (until then it may
            # still be looking at the scheduler for the ranks to join).
            assert b.stdout.readline().strip() == "joined"
            in_flight = rpc.rpc_async("b", after_timer, args=(1.0, "in-flight"))
            scheduler.kill()
            scheduler.wait()
            serving = agent._worker.status.name == "paused"  # (a peer runs no dask task)
            while serving and getattr(agent, "_scheduler_gone", None) is None:  # b's link is up
                time.sleep(0.05)
                serving = agent._worker.status.name == "paused"
            print(in_flight.wait())
            print(rpc.rpc_sync("b", np.add, args=(2, 3)))
            print(rpc.remote("b", np.add, args=(3, 3)).to_here())
            try:
                rpc.rpc_sync("c", np.add, args=(1, 1))
            except ValueError as exc:
                print("lookup", "scheduler" in str(exc) and address in str(exc))
            rpc.shutdown()

        try:
            as_a()
        except BaseException:  # what b said goes into this test's report
            b.kill()
            print("peer b wrote:", b.communicate()[1], file=sys.stderr)
            raise
        print("left", sorted(t.name for t in threading.enumerate() if t.name.startswith("aiopar")))
        out, err = b.communicate()  # closes b's stdin: b leaves
        if b.returncode:  # what b said goes into this test's report
            sys.exit(f"peer b ended with {b.returncode}: {err}")
        print(out.strip().replace(" ", "-"))
    """
    assert run(script, 150) == [
        "in-flight",
        "5",
        "6",
        "lookup",
        "True",
        "left",
        "[]",
        "b-left",
    ]
