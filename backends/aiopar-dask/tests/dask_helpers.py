"""Helpers for the plugin's tests: processes, sockets and threads left behind."""

from __future__ import annotations

import os
import threading

import pytest


def child_pids() -> set[int]:
    """Live (not yet reaped) child processes of this process, but multiprocessing's
    resource tracker."""
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
        if fields[1] == me and not _is_resource_tracker(entry):  # fields: state, ppid, ...
            children.add(int(entry))
    return children


def _is_resource_tracker(pid: str) -> bool:
    """multiprocessing's resource tracker: started by the first spawn, it
    lives as long as this process, whoever spawned."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" in f.read()
    except OSError:
        return False


def listening_addresses(pids: set[int]) -> set[str]:
    """The IP addresses that these processes' listening TCP sockets are bound to."""
    psutil = pytest.importorskip("psutil")
    hosts = set()
    for pid in pids:
        for conn in psutil.Process(pid).net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                hosts.add(conn.laddr.ip)
    return hosts


def aiopar_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("aiopar-")}
