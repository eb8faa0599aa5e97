"""Shared fixtures: every async test runs on asyncio, uvloop and trio."""

from __future__ import annotations

import threading

import pytest

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
