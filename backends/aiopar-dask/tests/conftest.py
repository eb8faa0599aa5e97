"""Shared fixtures: small loopback clusters, distributed's logs at ERROR."""

from __future__ import annotations

import logging
import os

# Worker processes inherit the environment: they log at ERROR too.
os.environ["DASK_LOGGING__DISTRIBUTED"] = "error"

import dask

dask.config.set({"logging.distributed": "error"})
logging.getLogger("distributed").setLevel(logging.ERROR)
