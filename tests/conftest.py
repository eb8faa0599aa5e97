"""Shared fixtures: every async test runs on asyncio, uvloop and trio; the
thread budget is put back after the tests that change it; the garbage
collector is off for tests of reference cycles."""

from __future__ import annotations

import threading

import pytest
from helpers import gc_off as gc_off  # shared with the plugin's suite

import aiopar

ASYNC_BACKENDS = [
    pytest.param(("asyncio", {}), id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param(("trio", {}), id="trio"),
]


@pytest.fixture(params=ASYNC_BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    """Used by ``@pytest.mark.anyio`` tests: asyncio, uvloop and trio."""
    return request.param


@pytest.fixture
def no_leaked_threads():
    """Fail a test that leaves aiopar worker threads running after it ends."""
    before = set(threading.enumerate())
    yield
    leaked = [t for t in threading.enumerate() if t not in before and t.name.startswith("aiopar-")]
    for thread in leaked:
        thread.join(timeout=5)
    assert not [t for t in leaked if t.is_alive()], f"threads left running: {leaked}"


@pytest.fixture
def automatic_budget():
    """The test starts from, and leaves, the automatic budget on all cores with
    the default interop workers; whatever was set before comes back after."""
    from aiopar._budget import budget, cores

    explicit, source = budget.explicit, budget.explicit_from
    interop = aiopar.get_num_interop_threads()
    aiopar.set_num_threads(None)
    aiopar.set_num_interop_threads(cores())
    yield
    aiopar.set_num_interop_threads(interop)
    budget.set_explicit(explicit, source)
