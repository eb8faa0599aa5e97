"""A small user program of aiopar: ``mypy --strict`` must pass on it and infer
the types that ``assert_type`` states. It runs, too."""

from __future__ import annotations

import asyncio
from typing import assert_type

import numpy as np

import aiopar
import aiopar.nn
from aiopar import Future


def square(x: int) -> int:
    return x * x


def describe(fut: Future[int]) -> str:
    return f"#{fut.value()}"


async def double(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def script() -> list[int]:
    fut = aiopar.fork(square, 3)
    assert_type(fut, Future[int])
    assert_type(aiopar.wait(fut), int)
    assert_type(fut.wait(timeout=1.0), int)
    assert_type(fut.value(), int)
    assert_type(fut.then(describe), Future[str])
    assert_type(fut.then(lambda f: f.value() / 2), Future[float])
    assert_type(aiopar.fork(double, 4), Future[int])  # a coroutine function's future
    values = aiopar.wait_all([fut, aiopar.fork(square, 4)])
    assert_type(values, list[int])
    for done in aiopar.as_completed([fut], timeout=5):
        assert_type(done, Future[int])
    with aiopar.task_group() as tg:
        part = tg.fork(square, 5)
    assert_type(part, Future[int])
    assert_type(aiopar.collect_all([fut]), Future[list[Future[int]]])
    return [*values, part.value()]


async def in_a_loop() -> int:
    value = await aiopar.fork(square, 6)
    assert_type(value, int)
    assert_type(await aiopar.fork(double, 7), int)
    async for done in aiopar.as_completed([aiopar.fork(square, 2)]):
        assert_type(done, Future[int])
    async with aiopar.task_group() as tg:
        part = tg.fork(double, 1)
    assert_type(part, Future[int])
    return value + part.value()


def models() -> tuple[np.ndarray, np.ndarray]:
    ens = aiopar.nn.LSTMEnsemble(2, 4, 3, seed=0)
    x = np.zeros((5, 1, 4), dtype=np.float32)
    fut = aiopar.fork(ens, x)
    assert_type(fut, Future[np.ndarray])
    output, (h_n, c_n) = aiopar.nn.LSTM(4, 3)(x)
    assert_type(output, np.ndarray)
    assert h_n.shape == c_n.shape
    return fut.wait(), output


def misuse() -> None:
    # Arguments are checked against fn's parameters: mypy reports this call
    # (with --strict an ignore comment that silences nothing is an error too).
    aiopar.fork(square, "three")  # type: ignore[call-overload]


if __name__ == "__main__":
    print(script(), asyncio.run(in_a_loop()), [a.shape for a in models()])
