"""The TorchScript dynamic-parallelism tutorial's example, on aiopar.

An ensemble of four bidirectional LSTMs (T, B, C = 50, 50, 1024) runs three
ways, as in the tutorial: sequentially; with each model's forward direction
forked while the backward one runs in the caller; and with every model forked
as well. The results are the same every time; only the wall time changes.

    python examples/lstm_ensemble.py            # tutorial sizes
    python examples/lstm_ensemble.py --quick    # small sizes, a few milliseconds
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import aiopar
from aiopar.nn import LSTMEnsemble, lstm_engine


def main() -> None:
    parser = argparse.ArgumentParser(description="the tutorial's LSTM ensemble, three ways")
    parser.add_argument("--quick", action="store_true", help="small sizes")
    args = parser.parse_args()
    steps, batch, channels = (10, 8, 64) if args.quick else (50, 50, 1024)

    ens = LSTMEnsemble(n_models=4, input_size=channels, hidden_size=channels, seed=0)
    # Normally the input would come out of an embedding table.
    x = np.random.default_rng(0).random((steps, batch, channels), dtype=np.float32)

    first = None
    for label, fork_models, fork_directions in [
        ("sequential", False, False),
        ("directions forked", False, True),
        ("models and directions forked", True, True),
    ]:
        ens.fork_models, ens.fork_directions = fork_models, fork_directions
        ens(x)  # warm up: packed weights, allocator
        start = time.perf_counter()
        y = ens(x)
        elapsed = time.perf_counter() - start
        print(f"{label:>30}: inference took {elapsed:.3f} s")
        if first is None:
            first = y
        elif not np.allclose(y, first, atol=1e-5):
            raise SystemExit(f"{label} gave a different result")
    print(
        f"output {first.shape}, backend {aiopar.get_backend().name!r}, "
        f"LSTM engine {lstm_engine()!r}"
    )


if __name__ == "__main__":
    main()
