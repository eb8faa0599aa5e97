"""Shared fixtures: a loopback scheduler to join, distributed's logs at
ERROR, and the garbage collector off for tests of reference cycles."""

from __future__ import annotations

import logging
import os

# Worker processes inherit the environment: they log at ERROR too.
os.environ["DASK_LOGGING__DISTRIBUTED"] = "error"

import dask
import pytest
from dask_helpers import Leftovers, loopback_cluster, wait_until
from helpers import gc_off as gc_off  # the core suite's, shared

from aiopar import rpc

dask.config.set({"logging.distributed": "error"})
logging.getLogger("distributed").setLevel(logging.ERROR)


@pytest.fixture
def scheduler():
    """The address of a scheduler alone, on loopback, for peers to join."""
    with loopback_cluster(n_workers=0) as cluster:
        yield cluster.scheduler_address


@pytest.fixture
def leaves_nothing_behind():
    """After the test: no process or thread of its left, and this process no rpc peer."""
    left = Leftovers()
    yield
    peer = rpc.agent._current
    if peer is not None:  # shut down here, or every later test of this process fails too
        rpc.shutdown(graceful=False)
    wait_until(lambda: not (left.processes() or left.threads()), timeout=15)
    assert peer is None, "the test left this process an rpc peer"
    assert left.processes() == set()
    assert left.threads() == set()
