"""``aiopar worker`` and TLS: dask worker's options and configuration, and what a mismatch says."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import distributed
import pytest
from dask_helpers import LOOPBACK

from aiopar import rpc

pytestmark = pytest.mark.timeout(180)

pytest.importorskip("cryptography")  # Security.temporary() makes its certificates with it


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    """A TLS scheduler on loopback, its security, and its certificate and
    key as PEM files (one certificate for every role, its own CA)."""
    security = distributed.Security.temporary()
    files = tmp_path_factory.mktemp("tls")
    role = security.get_tls_config_for_role("worker")
    pem = {"ca": role["ca_file"], "cert": role["cert"], "key": role["key"]}
    for name, text in pem.items():
        (files / f"{name}.pem").write_text(text)
    with distributed.LocalCluster(
        n_workers=0,
        processes=False,
        host=LOOPBACK,
        protocol="tls://",
        security=security,
        dashboard_address=f"{LOOPBACK}:0",
    ) as cluster:
        yield cluster.scheduler_address, security, {n: str(files / f"{n}.pem") for n in pem}


def aiopar_worker(address: str, name: str, *more: str) -> list[str]:
    """The command that runs ``aiopar worker`` as a user types it."""
    command = [sys.executable, "-m", "aiopar", "worker", "--scheduler", address, "--name", name]
    return [*command, "--nthreads", "1", *more]


def test_aiopar_worker_joins_a_tls_scheduler_with_dask_workers_tls(tls):
    address, security, pem = tls
    flags = ["--tls-ca-file", pem["ca"], "--tls-cert", pem["cert"], "--tls-key", pem["key"]]
    config = {  # dask's configuration, from the environment as dask reads it
        "DASK_DISTRIBUTED__COMM__TLS__CA_FILE": pem["ca"],
        "DASK_DISTRIBUTED__COMM__TLS__WORKER__CERT": pem["cert"],
        "DASK_DISTRIBUTED__COMM__TLS__WORKER__KEY": pem["key"],
    }
    servers = [
        subprocess.Popen(
            aiopar_worker(address, "flags", *flags), stderr=subprocess.PIPE, text=True
        ),
        subprocess.Popen(
            aiopar_worker(address, "config"),
            env={**os.environ, **config},
            stderr=subprocess.PIPE,
            text=True,
        ),
    ]
    try:
        for server in servers:
            said = server.stderr.readline()
            assert "serves at tls://127.0.0.1:" in said, said + server.communicate(timeout=60)[1]
        options = rpc.RpcBackendOptions(init_method=address, security=security)
        rpc.init_rpc("main", rpc_backend_options=options)
        try:
            assert rpc.rpc_sync("flags", abs, args=(-3,)) == 3
            assert rpc.rpc_sync("config", abs, args=(-4,)) == 4
        finally:
            rpc.shutdown()
        for server in servers:
            server.send_signal(signal.SIGTERM)
            _, said = server.communicate(timeout=60)
            assert server.returncode == 0, said
    finally:
        for server in servers:
            server.kill()
            server.wait()


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("tls://, no certificates", "takes TLS, and this process has no TLS certificates"),
        ("tcp://, no certificates", "takes TLS only (tls://127.0.0.1:"),
        ("certificates, no TLS there", "no TLS at tls://127.0.0.1:"),
    ],
)
def test_a_tls_mismatch_says_tls_and_where_to_give_certificates(tls, scheduler, case, words):
    address, _, pem = tls
    port = address.rsplit(":", 1)[1]
    plain_port = scheduler.rsplit(":", 1)[1]
    flags = ["--tls-ca-file", pem["ca"], "--tls-cert", pem["cert"], "--tls-key", pem["key"]]
    command = {
        "tls://, no certificates": aiopar_worker(address, "a"),
        "tcp://, no certificates": aiopar_worker(f"tcp://127.0.0.1:{port}", "a"),
        "certificates, no TLS there": aiopar_worker(f"tls://127.0.0.1:{plain_port}", "a", *flags),
    }[case]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert words in done.stderr, done.stderr
    assert "dask's protocol" not in done.stderr
    if case != "certificates, no TLS there":
        assert "--tls-ca-file, --tls-cert and --tls-key" in done.stderr
