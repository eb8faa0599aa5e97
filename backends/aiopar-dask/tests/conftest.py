"""Shared fixtures: a loopback scheduler to join, distributed's logs at
ERROR, and the garbage collector off for tests of reference cycles."""

from __future__ import annotations

import gc
import logging
import os

# Worker processes inherit the environment: they log at ERROR too.
os.environ["DASK_LOGGING__DISTRIBUTED"] = "error"

import dask
import pytest
from dask_helpers import loopback_cluster

dask.config.set({"logging.distributed": "error"})
logging.getLogger("distributed").setLevel(logging.ERROR)


@pytest.fixture
def scheduler():
    """The address of a scheduler alone, on loopback, for peers to join."""
    with loopback_cluster(n_workers=0) as cluster:
        yield cluster.scheduler_address


@pytest.fixture
def gc_off():
    """The garbage collector off during the test: what a reference cycle holds stays."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()
