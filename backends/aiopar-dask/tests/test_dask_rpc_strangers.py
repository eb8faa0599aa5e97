"""Connections that never prove they are peers cost a peer little, and
nothing once they close: hundreds of them (silent, trickling, garbage, a
partial hello) each raised a peer's memory by about 530 KiB (two read
buffers of 256 KiB), and kept it after they closed, in reference cycles
that only the garbage collector frees.

The peer runs in a child process with its garbage collector off, so what
it frees, it frees as the connections close. Its handshake deadline is
raised, so that the connections are measured while they are open.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
from typing import Any

import psutil
import pytest
from dask_helpers import wait_until

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(sys.platform != "linux", reason="psutil's RSS and glibc's malloc_trim"),
]

PER_KIND = 200
MOST_HELD = 64 << 10  # bytes a connection that has not proved itself may cost, on average
MOST_KEPT = 16 << 10  # bytes a closed one may leave behind, on average

# The attacked peer, worker0: it answers the test's commands on stdin, one line each.
PEER = """
    import ctypes, functools, gc, json, os, sys, threading
    from aiopar import rpc
    import aiopar_dask._wire.handshake
    from aiopar_dask._wire import Connection
    from aiopar_dask._wire.tls import TlsSession

    aiopar_dask._wire.handshake.HANDSHAKE_TIMEOUT = 120  # measured open, then closed by the test
    security = {"default": None, "plain": False}[sys.argv[1]]
    options = rpc.RpcBackendOptions(security=security)
    rpc.init_rpc("worker0", world_size=2, rpc_backend_options=options)
    agent = rpc.agent.current_agent()
    # worker1 calls worker0 back: a peer's new connection is served meanwhile
    call_back = functools.partial(rpc.rpc_sync, "worker0", len, ((1, 2, 3),))

    def settled():
        # Each call runs at the end of a round of the hub, which reads what
        # arrived before the round began: after two, what the test sent
        # before asking has been read, its new connections accepted too.
        for _ in range(2):
            done = threading.Event()
            agent.hub.call_soon(done.set)
            done.wait(60)

    def alive():
        return sum(isinstance(o, (Connection, TlsSession)) for o in gc.get_objects())

    def hurry():  # from now on, a new connection has half a second to prove itself
        aiopar_dask._wire.handshake.HANDSHAKE_TIMEOUT = 0.5

    def trim():  # hand what is free back to the system, as RSS counts only what is not
        ctypes.CDLL(None).malloc_trim(0)

    answers = {
        "call": lambda: rpc.rpc_sync("worker1", call_back, timeout=60),
        "settle": settled,
        "alive": alive,
        "hurry": hurry,
        "trim": trim,
    }
    answers["call"]()
    gc.collect()
    gc.disable()
    print(json.dumps({"pid": os.getpid(), "port": agent.port, "local": agent.local}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        print(json.dumps(answers[line.strip()]()), flush=True)
    rpc.shutdown()
"""


class Peer:
    """worker0 of a two-peer cluster in a child process, and its commands."""

    def __init__(self, security: str) -> None:
        self.tls = security == "default"
        self.process = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PEER), security],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        started: dict[str, Any] = self._line(timeout=120)
        self.pid, self.port, self.local = started["pid"], started["port"], started["local"]
        self._memory = psutil.Process(self.pid)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put("")

    def _line(self, timeout: float = 60) -> Any:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            line = ""
        if not line:
            os.killpg(self.process.pid, signal.SIGKILL)  # worker1's processes too
            pytest.fail(f"the peer did not answer: {self.process.communicate()[1][-3000:]}")
        return json.loads(line)

    def ask(self, command: str) -> Any:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self._line()

    def rss(self) -> int:
        """Its resident memory once what it freed is handed back to the system."""
        self.ask("trim")
        return int(self._memory.memory_info().rss)

    def close(self) -> None:
        try:
            _, err = self.process.communicate("\n", timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.communicate()
            raise
        assert self.process.returncode == 0, err[-3000:]


@pytest.fixture(params=["default", "plain"])
def peer(request):
    peer = Peer(request.param)
    yield peer
    peer.close()


def strangers(peer: Peer) -> list[socket.socket]:
    """``PER_KIND`` connections of each kind to the peer, none of which proves itself."""
    if peer.tls:  # the start of a TLS ClientHello: a handshake record, its first bytes
        hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(40)
    else:  # the rpc wire's own hello, cut short
        hello = b"aiopar-rpc/1\n" + os.urandom(20)
    kinds: list[tuple[str, bytes]] = [
        ("tcp", b""),  # says nothing
        ("tcp", b"\x16"),  # slowloris: one byte, and more later
        ("tcp", os.urandom(4096)),  # garbage
        ("tcp", hello),  # a hello that never ends
    ]
    if peer.local is not None:
        kinds.append(("unix", b"aiopar-rpc/1\n" + os.urandom(20)))  # its socket for this machine
    opened = []
    for family, data in kinds:
        for _ in range(PER_KIND):
            if family == "unix":
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect("\0" + peer.local)
            else:
                sock = socket.create_connection(("127.0.0.1", peer.port), timeout=30)
            if data:
                sock.sendall(data)
            opened.append(sock)
    return opened


def test_connections_that_never_prove_themselves_cost_little_and_nothing_once_closed(peer):
    alive = peer.ask("alive")
    before = peer.rss()

    opened = strangers(peer)
    for sock in opened[PER_KIND : 2 * PER_KIND]:  # the slowloris trickles on
        sock.send(b"\x03")
    peer.ask("settle")
    assert peer.ask("call") == 3  # calls go on meanwhile, a new connection included
    held = peer.rss() - before
    per_connection = held / len(opened)
    assert per_connection < MOST_HELD, f"{per_connection / 1024:.0f} KiB a connection"

    for sock in opened:
        sock.close()
    # Freed as they close, the garbage collector being off in the peer:
    # nothing of theirs stays, and their memory goes back.
    assert wait_until(lambda: peer.ask("alive") == alive, timeout=60), _left(peer, alive)
    kept = peer.rss() - before
    assert kept < MOST_KEPT * len(opened), f"{kept >> 10} KiB kept of {held >> 10} KiB held"
    assert peer.ask("call") == 3

    # The same when the peer closes them, at their handshake's deadline.
    peer.ask("hurry")
    opened = strangers(peer)
    assert wait_until(lambda: peer.ask("alive") == alive, timeout=60), _left(peer, alive)
    for sock in opened:
        sock.close()
    assert peer.ask("call") == 3


def _left(peer: Peer, alive: int) -> str:
    return f"{peer.ask('alive') - alive} connections and TLS sessions still held by the peer"
