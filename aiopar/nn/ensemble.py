"""The TorchScript parallelism tutorial's models: a bidirectional LSTM and an ensemble of them.

Structure and state-dict keys follow the tutorial's PyTorch modules
(``models.0.cell_f.weight_ih_l0`` ...), so its weights load unchanged. The
`fork` switches select the tutorial's three variants: sequential, directions
forked, models forked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

import aiopar

from .lstm import LSTM, Seed
from .module import Module, ModuleList

__all__ = ["BidirectionalRecurrentLSTM", "LSTMEnsemble"]

T = TypeVar("T")


class BidirectionalRecurrentLSTM(Module):
    """Two LSTMs over the same sequence, one of them reversed in time.

    ``forward(x)`` returns ``concatenate([out_f, flip(out_b)], axis=-1)``
    where ``out_f = cell_f(x)[0]`` and ``out_b = cell_b(flip(x))[0]``, flips
    being on the time axis; `x` is ``(T, B, input_size)`` or unbatched
    ``(T, input_size)`` and the result has ``2 * hidden_size`` features.

    With ``fork=True``, `cell_f` runs in a task forked on the current aiopar
    backend while `cell_b` runs in the caller, as in the tutorial. The result
    is the same either way. Both halves are written straight into the output
    array, so no flipped or concatenated copies are made.
    """

    def __init__(
        self, input_size: int, hidden_size: int, *, fork: bool = True, seed: Seed = None
    ) -> None:
        super().__init__()
        seeds = _spawn(seed, 2)
        self.fork = fork
        self.cell_f = LSTM(input_size, hidden_size, seed=seeds[0])
        self.cell_b = LSTM(input_size, hidden_size, seed=seeds[1])

    def extra_repr(self) -> str:
        return f"fork={self.fork}"

    def forward(self, x: Any) -> np.ndarray:
        x_tm, unbatched = self.cell_f._time_major(x)
        steps, batch, _ = x_tm.shape
        hidden_f = self.cell_f.hidden_size
        out = np.empty((steps, batch, hidden_f + self.cell_b.hidden_size), np.float32)
        out_f, out_b = out[:, :, :hidden_f], out[:, :, hidden_f:]
        if self.fork:
            future = aiopar.fork(run_direction, self.cell_f, x_tm, out_f)
            try:
                run_direction(self.cell_b, x_tm, out_b, reverse=True)
            except Exception:
                # The forked half writes into `out` and may fail too: let it
                # finish and retrieve its outcome; this half's error is raised.
                future.exception()
                raise
            result_f = future.wait()
            if result_f is not out_f:
                # The task ran in another process and sent back a copy.
                np.copyto(out_f, result_f)
        else:
            run_direction(self.cell_f, x_tm, out_f)
            run_direction(self.cell_b, x_tm, out_b, reverse=True)
        return out[:, 0, :] if unbatched else out

    if TYPE_CHECKING:  # calling a module runs forward: show type checkers its signature
        __call__ = forward


class LSTMEnsemble(Module):
    """`n_models` `BidirectionalRecurrentLSTM` run on the same input; their outputs are summed.

    ``forward(x)`` equals ``stack([m(x) for m in models]).sum(0)``. With
    ``fork_models=True`` every model runs in its own forked task (the caller
    waits for them in order); `fork_directions` is each model's `fork`.
    """

    def __init__(
        self,
        n_models: int,
        input_size: int,
        hidden_size: int,
        *,
        fork_models: bool = True,
        fork_directions: bool = True,
        seed: Seed = None,
    ) -> None:
        super().__init__()
        if not isinstance(n_models, int) or n_models < 1:
            raise ValueError(f"LSTMEnsemble n_models must be an integer >= 1, got {n_models!r}")
        seeds = _spawn(seed, n_models)
        self.fork_models = fork_models
        self.models = ModuleList(
            BidirectionalRecurrentLSTM(input_size, hidden_size, fork=fork_directions, seed=s)
            for s in seeds
        )

    @property
    def fork_directions(self) -> bool:
        return all(model.fork for model in self.models)

    @fork_directions.setter
    def fork_directions(self, value: bool) -> None:
        for model in self.models:
            model.fork = value

    def extra_repr(self) -> str:
        return f"n_models={len(self.models)}, fork_models={self.fork_models}"

    def forward(self, x: Any) -> np.ndarray:
        # Every model takes the same input: refuse a wrong one here, once,
        # rather than in n_models forked tasks.
        self.models[0].cell_f._time_major(x)
        if self.fork_models:
            futures = [aiopar.fork(model, x) for model in self.models]
            results = _wait_every(futures)
        else:
            results = [model(x) for model in self.models]
        total: np.ndarray = results[0]
        if not total.flags.writeable:  # a backend may hand back read-only buffers
            total = total.copy()
        for result in results[1:]:
            total += result
        return total

    if TYPE_CHECKING:  # calling a module runs forward: show type checkers its signature
        __call__ = forward


def _wait_every(futures: list[aiopar.Future[T]]) -> list[T]:
    """Every future's value, in order.

    All of them are waited for before the first failure (in list order) is
    raised, so a sibling's failure is never left unretrieved.
    """
    values: list[T] = []
    first_error: Exception | None = None
    for future in futures:
        try:
            values.append(future.wait())
        except Exception as error:
            first_error = first_error or error
    if first_error is not None:
        raise first_error
    return values


def run_direction(
    cell: LSTM, x: np.ndarray, out: np.ndarray, *, reverse: bool = False
) -> np.ndarray:
    """Write ``cell``'s output for time-major `x` into `out` and return `out`.

    Returning the buffer lets a backend that runs the call elsewhere (another
    process) hand the values back.
    """
    cell._run(x, out, reverse=reverse)
    return out


def _spawn(seed: Seed, n: int) -> list[np.random.SeedSequence]:
    """`n` independent child seeds of `seed`, so sibling modules get different weights."""
    if isinstance(seed, np.random.SeedSequence):
        return seed.spawn(n)
    if isinstance(seed, np.random.Generator):
        seed = int(seed.integers(2**63))
    return np.random.SeedSequence(seed).spawn(n)
