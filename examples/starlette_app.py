"""A Starlette app that offloads its work with ``await aiopar.fork``.

Three endpoints, one per kind of work an async app hands off the event loop:

- ``/matmul?seed=3``: numpy, a 300x300 matrix product (releases the GIL);
- ``/blocking?seconds=0.05``: a blocking call, ``time.sleep`` standing for a
  database driver or an SDK that does its own socket I/O;
- ``/cpu?n=20000``: pure-Python CPU work, on the process backend (it holds
  the GIL, so threads would not run it in parallel).

``/health`` answers without offloading. The lifespan's shutdown awaits
``aiopar.drain()``: uvicorn ends a graceful shutdown on SIGTERM by raising
the signal again with its default action, so no exit hook of this process
runs after it, and forks still queued then (fire-and-forget ones an app
adds) would be lost without the drain (docs/async.md, "Stopping a server").

    python examples/starlette_app.py [--port 8000]
    uvicorn examples.starlette_app:app --timeout-graceful-shutdown 5
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import AsyncIterator

import numpy as np
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

import aiopar

SIZE = 300  # the side of the matrices /matmul multiplies


def matmul_sum(seed: int) -> float:
    """The sum of ``a @ b`` for two matrices of small whole numbers drawn
    from ``seed``: exact in float64, so a client can check it."""
    a, b = np.random.default_rng(seed).integers(0, 10, (2, SIZE, SIZE)).astype(np.float64)
    return float((a @ b).sum())


def sum_of_squares(n: int) -> int:
    """Pure-Python work that holds the GIL for as long as ``n`` says."""
    total = 0
    for i in range(n):
        total += i * i
    return total


async def matmul(request: Request) -> JSONResponse:
    seed = int(request.query_params.get("seed", "0"))
    return JSONResponse({"seed": seed, "sum": await aiopar.fork(matmul_sum, seed)})


async def blocking(request: Request) -> JSONResponse:
    seconds = float(request.query_params.get("seconds", "0.05"))
    await aiopar.fork(time.sleep, seconds)
    return JSONResponse({"slept": seconds})


async def cpu(request: Request) -> JSONResponse:
    n = int(request.query_params.get("n", "20000"))
    total = await aiopar.get_backend("process").fork(sum_of_squares, n)
    return JSONResponse({"n": n, "sum_of_squares": total})


async def health(request: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    yield
    # Every backend runs what is still queued before the process goes.
    await aiopar.drain()


app = Starlette(
    routes=[
        Route("/matmul", matmul),
        Route("/blocking", blocking),
        Route("/cpu", cpu),
        Route("/health", health),
    ],
    lifespan=lifespan,
)


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(app, host="127.0.0.1", port=args.port, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
