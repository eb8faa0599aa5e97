"""torch's futures where aiopar takes futures: ``aiopar.wrap`` and
``@rpc.functions.async_execution``. torch is never a dependency: without it
these tests skip."""

from __future__ import annotations

import asyncio
import threading

import pytest

import aiopar
from aiopar import rpc
from aiopar.rpc.agent import run_callee

torch = pytest.importorskip("torch", reason="torch's futures need torch, which is not installed")

pytestmark = pytest.mark.timeout(60)


def later(fut, value=None, error=None):
    """Settle the torch future ``fut`` from another thread, as torch's own work does."""
    settle = fut.set_result if error is None else fut.set_exception
    threading.Timer(0.02, settle, (value if error is None else error,)).start()
    return fut


def test_wrap_adopts_a_torch_future():
    assert aiopar.wrap(later(torch.futures.Future(), 3)).wait(timeout=10) == 3
    failed = aiopar.wrap(later(torch.futures.Future(), error=ValueError("on purpose")))
    with pytest.raises(ValueError, match="on purpose"):
        failed.wait(timeout=10)
    done = torch.futures.Future()
    done.set_result(5)
    assert aiopar.wrap(done).wait(timeout=10) == 5

    async def main():
        return await aiopar.wrap(later(torch.futures.Future(), 4))

    assert asyncio.run(main()) == 4


@rpc.functions.async_execution
def replies_with_a_torch_future(x):
    return later(torch.futures.Future(), x + 1)


def returns_a_torch_future_undecorated():
    return later(torch.futures.Future(), 1)


def test_an_async_execution_function_may_return_a_torch_future():
    # It was refused: "must return an aiopar.Future, but it returned Future".
    reply = run_callee(replies_with_a_torch_future, (1,), {})
    assert isinstance(reply, aiopar.Future)
    assert reply.wait(timeout=10) == 2
    with pytest.raises(TypeError, match=r"returned a torch future: decorate it"):
        run_callee(returns_a_torch_future_undecorated, (), {})
    with pytest.raises(
        TypeError, match=r"must return an aiopar\.Future, but it returned int \(a torch"
    ):
        run_callee(rpc.functions.async_execution(lambda: 1), (), {})


def test_a_peer_replies_with_a_torch_futures_value(leaves_nothing_behind):
    rpc.init_rpc("worker0", world_size=2)
    try:
        assert rpc.rpc_sync("worker1", replies_with_a_torch_future, args=(41,)) == 42
    finally:
        rpc.shutdown()
