"""Which engine runs the LSTM's GEMMs: numpy (BLAS), or oneDNN when it pays.

The choice is made once, at the first LSTM run (or `lstm_engine()` call):

* ``AIOPAR_LSTM_ENGINE=numpy`` (or ``set_lstm_engine("numpy")``) forces numpy;
* otherwise oneDNN is loaded (``pip install aiopar[onednn]``) and self-tested
  against numpy on a small LSTM; any failure leaves numpy running, logged at
  debug level on the ``aiopar`` logger and stated by `aiopar.parallel_info`;
* ``auto`` (the default) then keeps oneDNN only if it has a packed (brgemm)
  kernel for this CPU: its generic one is no faster than OpenBLAS. ``onednn``
  keeps it whatever its kernel.

Either engine gives the same outputs within float32 rounding (the self-test
checks 1e-5).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Literal, cast

import numpy as np

import aiopar

from ._onednn import OneDNN, OneDNNError, load
from ._recurrence import (
    NUMPY,
    Engine,
    PackedWeights,
    Step,
    Workspace,
    numpy_project,
    numpy_step,
    pack_weights,
)
from ._recurrence import run_direction as _run_direction

__all__ = ["ENV_VAR", "current_engine", "engine_info", "lstm_engine", "set_lstm_engine"]

_logger = logging.getLogger("aiopar")

#: the environment variable read at the first choice: auto, numpy or onednn
ENV_VAR = "AIOPAR_LSTM_ENGINE"
Preference = Literal["auto", "numpy", "onednn"]
_PREFERENCES = ("auto", "numpy", "onednn")

#: the largest difference from numpy that the self-test accepts
SELF_TEST_TOLERANCE = 1e-5


@dataclass(frozen=True, slots=True)
class _Choice:
    name: Literal["numpy", "onednn"]
    engine: Engine
    why: str


_lock = threading.Lock()
_choice: _Choice | None = None
_preference: Preference | None = None  # set_lstm_engine's; None: the environment's
_decided: dict[Preference, _Choice] = {}  # by set_lstm_engine's preference: a switch back is free


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # a choice under way in another thread is not coming back


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_engine() -> Engine:
    """The engine that runs (chosen at the first call)."""
    choice = _choice or _choose()
    return choice.engine


def lstm_engine() -> Literal["numpy", "onednn"]:
    """The engine that runs the LSTM's GEMMs: ``"numpy"`` or ``"onednn"``.

    The first call (or the first LSTM run) makes the choice: see
    `set_lstm_engine`. `aiopar.parallel_info` says why it fell as it did.
    """
    return (_choice or _choose()).name


def set_lstm_engine(preference: Preference) -> Literal["numpy", "onednn"]:
    """Choose the LSTM engine again, by `preference`, and return the one that runs.

    ``"numpy"`` runs the input projection and the recurrent step through
    numpy's matmul (BLAS). ``"onednn"`` runs them through oneDNN if it loads
    and passes its self-test, else numpy.
    ``"auto"`` (the default, also read from the ``AIOPAR_LSTM_ENGINE``
    environment variable) does so only if oneDNN has a packed kernel for
    this CPU. The choice for each preference is made once: switching back
    to one is free. Runs already under way finish on the engine they started
    with.
    """
    global _preference, _choice
    if preference not in _PREFERENCES:
        raise ValueError(
            f"set_lstm_engine(preference): expected one of {', '.join(map(repr, _PREFERENCES))}, "
            f"got {preference!r}"
        )
    with _lock:
        _preference = preference
        _choice = _decided.get(preference)
    return lstm_engine()


def engine_info() -> list[str]:
    """The line `aiopar.parallel_info` shows for the LSTM engine."""
    choice = _choice or _choose()
    return [f"aiopar.nn LSTM engine: {choice.name} ({choice.why})"]


def _choose() -> _Choice:
    global _choice
    with _lock:
        if _choice is None:
            _choice = _decide()
            if _preference is not None:
                _decided[_preference] = _choice
            _logger.debug("aiopar.nn LSTM engine: %s (%s)", _choice.name, _choice.why)
        return _choice


def _decide() -> _Choice:
    if _preference is not None:
        preference, source = _preference, f"set_lstm_engine({_preference!r})"
    else:
        raw = os.environ.get(ENV_VAR, "").strip().lower() or "auto"
        source = f"{ENV_VAR}={raw}"
        if raw not in _PREFERENCES:
            return _Choice(
                "numpy",
                NUMPY,
                f"{source} is not one of {', '.join(_PREFERENCES)}, so numpy runs",
            )
        preference = cast("Preference", raw)
    if preference == "numpy":
        return _Choice("numpy", NUMPY, source)
    try:
        onednn = load()
        kernel = _self_test(onednn)
    except Exception as error:  # any failure of an optional engine leaves numpy running
        return _Choice("numpy", NUMPY, f"oneDNN not used: {error}")
    if preference == "auto" and not kernel.startswith("brg"):
        return _Choice(
            "numpy",
            NUMPY,
            f"oneDNN {onednn.version} has only its generic kernel {kernel} for this CPU, "
            f"no faster than OpenBLAS; {ENV_VAR}=onednn uses it anyway",
        )
    return _Choice("onednn", _guarded(onednn), f"oneDNN {onednn.version}, {kernel} kernel")


def _guarded(onednn: OneDNN) -> Engine:
    """oneDNN's GEMMs, or numpy's for a shape oneDNN refuses (logged at debug level)."""

    def project(weights: PackedWeights, ws: Workspace, x: np.ndarray, out: np.ndarray) -> None:
        # oneDNN's primitives run on one thread: with more intra-op threads
        # to use (an LSTM run outside forks), numpy's BLAS spreads the
        # projection, half of the FLOPs, over them.
        if aiopar.get_num_threads() > 1:
            numpy_project(weights, ws, x, out)
            return
        try:
            onednn.project(weights, ws, x, out)
        except OneDNNError as error:
            _logger.debug("oneDNN refused a projection, numpy runs it: %s", error)
            numpy_project(weights, ws, x, out)

    def step(weights: PackedWeights, ws: Workspace) -> Step:
        try:
            return onednn.step(weights, ws)
        except OneDNNError as error:
            _logger.debug("oneDNN refused a step, numpy runs it: %s", error)
            return numpy_step(weights, ws)

    return Engine(project, step)


def _self_test(onednn: OneDNN) -> str:
    """Run a small LSTM direction through `onednn` and numpy; return oneDNN's
    kernel name, or raise `OneDNNError` if the outputs differ."""
    steps, batch, features, hidden = 6, 16, 24, 64
    rng = np.random.default_rng(20240531)
    bound = 1 / np.sqrt(hidden)

    def uniform(*shape: int) -> np.ndarray:
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    weights = pack_weights(
        uniform(4 * hidden, features),
        uniform(4 * hidden, hidden),
        uniform(4 * hidden),
        uniform(4 * hidden),
    )
    x = rng.standard_normal((steps, batch, features)).astype(np.float32)
    h0, c0 = uniform(batch, hidden), uniform(batch, hidden)
    outputs = []
    for engine in (NUMPY, Engine(onednn.project, onednn.step)):
        out = np.empty((steps, batch, hidden), np.float32)
        h_n, c_n = _run_direction(weights, x, out, h0, c0, engine=engine)
        outputs.append(np.concatenate([out.ravel(), h_n.ravel(), c_n.ravel()]))
    difference = float(np.abs(outputs[0] - outputs[1]).max())
    if not difference <= SELF_TEST_TOLERANCE:
        raise OneDNNError(
            f"oneDNN {onednn.version}'s self-test differs from numpy by {difference:.3g}"
        )
    return onednn.matmul(batch, hidden, 4 * hidden, accumulate=True).implementation
