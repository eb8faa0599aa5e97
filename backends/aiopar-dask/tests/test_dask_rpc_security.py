"""What a local process that is not a peer can do to an aiopar.rpc cluster, found by trying.

Each claim of docs/distributed.md's Security section is tried here: a
stranger writes a call to a peer's rpc port and Unix socket, holds a
connection open without a word, uses the dask scheduler, and opens the HTTP
pages, against the default cluster (TLS with certificates made at
start-up), one with the user's own TLS, and one without TLS
(``security=False``). Each payload would create a marker file; the cluster
runs in a child process with a timeout.
"""

from __future__ import annotations

import json
import pathlib
import queue
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import pytest
from aiopar_dask import _wire
from dask_helpers import run_python

pytestmark = pytest.mark.timeout(180)

# The cluster's side: start it, report what a stranger could reach, wait for
# the stranger (this test) to finish, leave. argv[1] picks its security:
# "default" (none given), "tls" (the user's own), "plain" (security=False).
CLUSTER = """
    import json, sys, time
    import distributed
    from aiopar import rpc
    import aiopar_dask._wire.handshake

    aiopar_dask._wire.handshake.HANDSHAKE_TIMEOUT = 0.5  # this process's listener: worker0's
    given = {"default": None, "plain": False}.get(sys.argv[1])
    if sys.argv[1] == "tls":
        given = distributed.Security.temporary()
    rpc.init_rpc("worker0", world_size=2,
                 rpc_backend_options=rpc.RpcBackendOptions(security=given))
    agent = rpc.agent.current_agent()
    security = agent.cluster.security

    def rpc_port():
        return distributed.get_worker().rpc_agent.port

    def rpc_local():
        return distributed.get_worker().rpc_agent.local

    scheduler = agent.cluster.scheduler
    health = None
    if security.require_encryption:  # a client with the cluster's certificate gets the pages
        import ssl, urllib.request
        context = security.get_connection_args("client")["ssl_context"]
        context.check_hostname = False
        url = f"https://127.0.0.1:{scheduler.http_server.port}/health"
        health = urllib.request.urlopen(url, context=context, timeout=10).read().decode()
    print(json.dumps({
        "health": health,
        "worker0": agent.port,
        "worker1": rpc.rpc_sync("worker1", rpc_port),
        "worker1_local": rpc.rpc_sync("worker1", rpc_local),
        "scheduler": agent.cluster.scheduler_address,
        "scheduler_http": scheduler.http_server.port,
        "worker0_http": agent._worker.http_server.port,
    }), flush=True)
    sys.stdin.readline()  # the stranger is done
    assert rpc.rpc_sync("worker1", len, args=((1, 2),)) == 2  # the peers still talk
    rpc.shutdown()
    print("done")
"""

# A stranger's use of the dask scheduler: run code on every worker.
STRANGER_CLIENT = """
    import pathlib, sys
    import distributed
    try:
        with distributed.Client(sys.argv[1], timeout=20) as client:
            client.run(pathlib.Path(sys.argv[2]).touch)
    except Exception as exc:
        print(type(exc).__name__, exc)
"""


def call_message(payload: object) -> bytes:
    """A call as the wire framed it before the handshake: header, frame length, pickle."""
    import pickle

    data = pickle.dumps(payload)
    return struct.pack("!BQH", _wire.CALL, 0, 1) + struct.pack("!Q?", len(data), True) + data


def reply_to(message: bytes, port: int) -> bytes:
    """Write ``message`` to the rpc port and return what comes back before it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(message)
        return _read_to_end(sock)


def _read_to_end(sock: socket.socket) -> bytes:
    """What comes until the other side closes (a reset, when it closed unread, too)."""
    got = b""
    try:
        while chunk := sock.recv(1 << 16):
            got += chunk
    except ConnectionResetError:
        pass
    return got


@pytest.fixture
def cluster():
    """Start the cluster child with ``kind`` ("plain" or "tls"); yields its
    addresses, and checks it ends well after the test."""
    children: list[subprocess.Popen[str]] = []

    def start(kind: str) -> dict[str, object]:
        child = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(CLUSTER), kind],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        children.append(child)
        assert child.stdout is not None
        line = child.stdout.readline()
        if not line:
            children.remove(child)
            child.kill()
            pytest.fail(f"the cluster did not start: {child.communicate(timeout=60)[1]}")
        return json.loads(line)

    yield start
    for child in children:
        try:
            out, err = child.communicate("\n", timeout=60)
        finally:
            child.kill()
        assert "done" in out, err


@pytest.mark.parametrize("kind", ["plain", "default"])
def test_a_stranger_cannot_call_a_peer(cluster, tmp_path, kind):
    ports = cluster(kind)
    marker = tmp_path / "ran"
    message = call_message((pathlib.Path.touch, (marker,), {}))
    assert reply_to(message, ports["worker1"]) == b""  # closed unread, no reply
    assert not marker.exists()
    if ports["worker1_local"] is not None:  # the Unix socket for peers of this machine
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect("\0" + ports["worker1_local"])
            sock.sendall(message)
            assert _read_to_end(sock) == b""
        assert not marker.exists()


def test_a_stranger_that_says_nothing_is_dropped(cluster):
    ports = cluster("plain")
    with socket.create_connection(("127.0.0.1", ports["worker0"]), timeout=30) as sock:
        assert _read_to_end(sock) == b""  # closed after HANDSHAKE_TIMEOUT (0.5 s there)


def test_without_tls_a_stranger_can_use_the_dask_scheduler(cluster, tmp_path):
    # What the docs say of security=False: the rpc wire is closed, dask's scheduler is not.
    ports = cluster("plain")
    marker = tmp_path / "ran"
    done = run_python(STRANGER_CLIENT, str(ports["scheduler"]), str(marker), timeout=60)
    assert marker.exists(), done.stdout + done.stderr


@pytest.mark.parametrize("kind", ["default", "tls"])
def test_with_tls_a_stranger_can_do_nothing(cluster, tmp_path, kind):
    pytest.importorskip("cryptography")  # Security.temporary() makes its certificates with it
    import ssl
    import urllib.request

    ports = cluster(kind)
    assert ports["health"] == "ok"
    assert str(ports["scheduler"]).startswith("tls://")
    marker = tmp_path / "ran"
    done = run_python(STRANGER_CLIENT, str(ports["scheduler"]), str(marker), timeout=60)
    assert not marker.exists(), done.stdout
    plain_address = str(ports["scheduler"]).replace("tls://", "tcp://")
    done = run_python(STRANGER_CLIENT, plain_address, str(marker), timeout=60)
    assert not marker.exists(), done.stdout
    # not TLS, so the TLS handshake fails: closed unread
    assert reply_to(call_message((pathlib.Path.touch, (marker,), {})), ports["worker1"]) == b""
    assert not marker.exists()
    for port in ports["scheduler_http"], ports["worker0_http"]:
        with pytest.raises(OSError):  # http: the server speaks TLS only
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10)
        no_certificate = ssl.create_default_context()
        no_certificate.check_hostname, no_certificate.verify_mode = False, ssl.CERT_NONE
        with pytest.raises(OSError):  # https without the cluster's certificate
            urllib.request.urlopen(
                f"https://127.0.0.1:{port}/health", timeout=10, context=no_certificate
            )


# -- the handshake itself, in this process ----------------------------------------------


def listener(secret: bytes) -> tuple[_wire.Listener, _wire.Hub, list[object]]:
    """A Listener that answers each call with its payload, and its hub."""
    calls: list[object] = []

    def echo(connection: _wire.Connection, kind: int, call_id: int, frames: object) -> None:
        calls.append(_wire.loads(frames))
        connection.send(_wire.VALUE, call_id, *_wire.dumps(calls[-1]), wait=False)

    hub = _wire.Hub(name="aiopar-rpc-io-test")
    return _wire.Listener(hub, "127.0.0.1", None, secret, echo), hub, calls


def test_peers_with_the_secret_talk():
    secret = _wire.new_secret()
    server, hub, _ = listener(secret)
    try:
        connection = _wire.connect("127.0.0.1", server.port, 5, None, secret, "a-caller")
        try:
            replies: queue.Queue[object] = queue.Queue()
            connection.serve(
                hub,
                _wire.messages(connection, lambda c, *message: replies.put(message)),
                replies.put,
            )
            connection.send(_wire.CALL, 7, *_wire.dumps("hello"))
            kind, call_id, frames = replies.get(timeout=10)
            assert (kind, call_id, _wire.loads(frames)) == (_wire.VALUE, 7, "hello")
        finally:
            connection.close()
    finally:
        server.close()
        hub.close()


def test_a_caller_without_the_secret_is_refused():
    server, hub, calls = listener(_wire.new_secret())
    try:
        with pytest.raises(PermissionError, match="not a peer of this cluster"):
            _wire.connect("127.0.0.1", server.port, 5, None, _wire.new_secret())
    finally:
        server.close()
        hub.close()
    assert calls == []


def test_a_caller_refuses_a_stranger_on_a_peers_port():
    # A process that took a dead peer's port and answers the handshake as best it can.
    stranger = socket.create_server(("127.0.0.1", 0))
    heard: list[bytes] = []

    def answer() -> None:
        sock, _ = stranger.accept()
        with sock:
            sock.recv(1 << 10)
            sock.sendall(bytes(64))  # a nonce and a made-up proof
            sock.settimeout(10)
            heard.append(_read_to_end(sock))

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(PermissionError, match="not a peer of this cluster"):
            _wire.connect("127.0.0.1", stranger.getsockname()[1], 5, None, _wire.new_secret())
    finally:
        thread.join(15)
        stranger.close()
    assert heard == [b""]  # the caller sent nothing after the failed proof
