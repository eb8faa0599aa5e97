"""The TorchScript parallelism tutorial's models: a bidirectional LSTM and an ensemble of them.

Structure and state-dict keys follow the tutorial's PyTorch modules
(``models.0.cell_f.weight_ih_l0`` ...), so its weights load unchanged. The
`fork` switches select the tutorial's three variants: sequential, directions
forked, models forked.
"""

from __future__ import annotations

from dataclasses import dataclass
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
        out = _output(x_tm, self.cell_f.hidden_size + self.cell_b.hidden_size)
        self._run_into(x_tm, out)
        return out[:, 0, :] if unbatched else out

    if TYPE_CHECKING:  # calling a module runs forward: show type checkers its signature
        __call__ = forward

    def _run_into(self, x: np.ndarray, out: np.ndarray, *, accumulate: bool = False) -> None:
        """Write (or add, with `accumulate`) the output for time-major `x` into `out`."""
        hidden_f = self.cell_f.hidden_size
        out_f, out_b = out[:, :, :hidden_f], out[:, :, hidden_f:]
        forward_half = [_Job(self.cell_f, reverse=False, target=0, accumulate=accumulate)]
        backward_half = [_Job(self.cell_b, reverse=True, target=0, accumulate=accumulate)]
        if self.fork:
            _run_streams(x, [(forward_half, [out_f]), (backward_half, [out_b])])
        else:
            _run_stream(x, forward_half, [out_f])
            _run_stream(x, backward_half, [out_b])


class LSTMEnsemble(Module):
    """`n_models` `BidirectionalRecurrentLSTM` run on the same input; their outputs are summed.

    ``forward(x)`` equals ``stack([m(x) for m in models]).sum(0)``, up to
    float32 rounding. `fork_models` and `fork_directions` (each model's
    `fork`) select the tutorial's variants:

    * neither: every direction runs in the caller, one after another;
    * `fork_directions` alone: for each model in turn, `cell_f` runs in a
      forked task beside `cell_b` in the caller;
    * `fork_models` alone: every model runs in its own forked task (both
      directions one after the other), and the caller sums the results;
    * both (the default): the models' directions run forked, grouped into
      one stream per worker of the current backend (at most one per
      direction): with two workers, every model's `cell_f` in one forked
      task and every `cell_b` in the caller, each stream adding its
      directions into its own half of the output. That is the tutorial's
      "every model forked" with one task per worker instead of one per
      model: each stream keeps one BLAS thread busy, reuses its buffers from
      one direction to the next and needs no output of its own.

    Outputs are added in model order, so the variants agree bit for bit on
    the same engine unless more than one stream shares a half of the output.
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
        # rather than in forked tasks.
        first = self.models[0]
        x_tm, unbatched = first.cell_f._time_major(x)
        out = _output(x_tm, first.cell_f.hidden_size + first.cell_b.hidden_size)
        if self.fork_models and self.fork_directions:
            self._run_streamed(x_tm, out)
        elif self.fork_models:
            futures = [aiopar.fork(model, x_tm) for model in self.models]
            for k, result in enumerate(_wait_every(futures)):
                if k:
                    out += result
                else:
                    np.copyto(out, result)
        else:
            for k, model in enumerate(self.models):
                model._run_into(x_tm, out, accumulate=k > 0)
        return out[:, 0, :] if unbatched else out

    if TYPE_CHECKING:  # calling a module runs forward: show type checkers its signature
        __call__ = forward

    def _run_streamed(self, x: np.ndarray, out: np.ndarray) -> None:
        """Every direction of every model, in one stream per worker of the current backend."""
        hidden = self.models[0].cell_f.hidden_size
        halves = (out[:, :, :hidden], out[:, :, hidden:])
        directions = [(model.cell_f, 0) for model in self.models]
        directions += [(model.cell_b, 1) for model in self.models]
        n_streams = max(1, min(aiopar.get_backend().max_workers, len(directions)))
        size, extra = divmod(len(directions), n_streams)
        streams: list[tuple[list[_Job], list[np.ndarray]]] = []
        owner: dict[int, int] = {}  # half -> the stream that adds into it directly
        later: list[tuple[np.ndarray, np.ndarray]] = []  # (half, a buffer to add to it)
        start = 0
        for k in range(n_streams):
            end = start + size + (k < extra)
            jobs: list[_Job] = []
            targets: list[np.ndarray] = []
            slot: dict[int, int] = {}  # half -> its index in targets
            for cell, half in directions[start:end]:
                fresh = half not in slot
                if fresh:
                    slot[half] = len(targets)
                    if owner.setdefault(half, k) == k:
                        targets.append(halves[half])
                    else:  # another stream adds into this half: this one gets a buffer
                        targets.append(np.empty_like(halves[half]))
                        later.append((halves[half], targets[-1]))
                jobs.append(_Job(cell, reverse=half == 1, target=slot[half], accumulate=not fresh))
            streams.append((jobs, targets))
            start = end
        _run_streams(x, streams)
        for target, partial in later:
            target += partial


def _output(x: np.ndarray, width: int) -> np.ndarray:
    steps, batch, _ = x.shape
    return np.empty((steps, batch, width), np.float32)


@dataclass(frozen=True, slots=True)
class _Job:
    """One direction of a stream, written (or added) into the stream's target number `target`."""

    cell: LSTM
    reverse: bool
    target: int
    accumulate: bool


def _run_stream(x: np.ndarray, jobs: list[_Job], targets: list[np.ndarray]) -> list[np.ndarray]:
    """Run `jobs` one after another; return `targets` (which a backend that
    runs this in another process sends back as copies)."""
    for job in jobs:
        job.cell._run(x, targets[job.target], reverse=job.reverse, accumulate=job.accumulate)
    return targets


def _run_streams(x: np.ndarray, streams: list[tuple[list[_Job], list[np.ndarray]]]) -> None:
    """Run every stream but the last in a forked task and the last in the
    caller (a lone stream is forked); wait for all, and raise the first
    failure once every stream is done."""
    forked, here = (streams, []) if len(streams) == 1 else (streams[:-1], streams[-1:])
    futures = [aiopar.fork(_run_stream, x, jobs, targets) for jobs, targets in forked]
    try:
        for jobs, targets in here:
            _run_stream(x, jobs, targets)
    except Exception:
        # The forked streams write into the same output and may fail too:
        # let them finish and retrieve their outcomes; this error is raised.
        for future in futures:
            future.exception()
        raise
    for (_, targets), results in zip(forked, _wait_every(futures), strict=True):
        for target, result in zip(targets, results, strict=True):
            if result is not target:  # the stream ran in another process: a copy came back
                np.copyto(target, result)


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


def _spawn(seed: Seed, n: int) -> list[np.random.SeedSequence]:
    """`n` independent child seeds of `seed`, so sibling modules get different weights."""
    if isinstance(seed, np.random.SeedSequence):
        return seed.spawn(n)
    if isinstance(seed, np.random.Generator):
        seed = int(seed.integers(2**63))
    return np.random.SeedSequence(seed).spawn(n)
