"""Serving the tutorial's LSTM ensemble from an event loop with ``await aiopar.fork``.

Many requests arrive at once; each is handled by a coroutine that awaits
``aiopar.fork(ens, x)``, so the ensemble (which forks its own models and
directions inside) runs on aiopar's worker threads while the loop stays free.
A heartbeat coroutine wakes every millisecond and records how late it woke:
that lag is what every other coroutine on the loop would feel. Runs on uvloop
when it is installed.

    python examples/async_inference.py            # tutorial sizes, 16 requests
    python examples/async_inference.py --quick    # small sizes
"""

from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np

import aiopar
from aiopar.nn import LSTMEnsemble

HEARTBEAT = 0.001  # seconds between heartbeats


async def heartbeat(lags: list[float], stop: asyncio.Event) -> None:
    # perf_counter, not loop.time(): uvloop's clock ticks in whole milliseconds.
    while not stop.is_set():
        before = time.perf_counter()
        await asyncio.sleep(HEARTBEAT)
        lags.append(max(0.0, time.perf_counter() - before - HEARTBEAT))


async def serve(ens: LSTMEnsemble, requests: list[np.ndarray]) -> tuple[float, list[float]]:
    """Handle every request concurrently; return the wall time and the loop lags."""
    lags: list[float] = []
    stop = asyncio.Event()
    beat = asyncio.create_task(heartbeat(lags, stop))
    await asyncio.sleep(0.05)  # a few idle beats as a baseline

    async def handle(x: np.ndarray) -> np.ndarray:
        return await aiopar.fork(ens, x)

    start = time.perf_counter()
    results = await asyncio.gather(*(handle(x) for x in requests))
    elapsed = time.perf_counter() - start
    stop.set()
    await beat
    assert all(
        r.shape == (*requests[0].shape[:2], 2 * ens.models[0].cell_f.hidden_size) for r in results
    )
    return elapsed, lags


def main() -> None:
    parser = argparse.ArgumentParser(description="LSTM ensemble inference behind an event loop")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    parser.add_argument("--requests", type=int, default=None, help="concurrent requests")
    args = parser.parse_args()
    steps, batch, channels = (10, 8, 64) if args.quick else (50, 50, 1024)
    n_requests = args.requests or (8 if args.quick else 16)

    ens = LSTMEnsemble(n_models=4, input_size=channels, hidden_size=channels, seed=0)
    rng = np.random.default_rng(0)
    requests = [rng.random((steps, batch, channels), dtype=np.float32) for _ in range(n_requests)]
    ens(requests[0])  # warm up outside the loop

    try:
        import uvloop
    except ImportError:
        uvloop = None
    runner = uvloop.run if uvloop is not None else asyncio.run
    elapsed, lags = runner(serve(ens, requests))

    lag_ms = np.array(lags) * 1e3
    flops = 4 * 2 * steps * 8 * batch * channels * 2 * channels * n_requests
    print(f"event loop: {'uvloop' if uvloop is not None else 'asyncio'}")
    print(
        f"{n_requests} requests of {steps}x{batch}x{channels} in {elapsed:.2f} s: "
        f"{n_requests / elapsed:.2f} requests/s, {flops / elapsed / 1e9:.0f} GFLOP/s"
    )
    print(
        f"event-loop lag over {lag_ms.size} heartbeats: p50 {np.percentile(lag_ms, 50):.2f} ms, "
        f"p99 {np.percentile(lag_ms, 99):.2f} ms, max {lag_ms.max():.2f} ms"
    )


if __name__ == "__main__":
    main()
