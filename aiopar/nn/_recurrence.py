"""The LSTM recurrence for one direction of one layer, in float32 numpy.

Layout and arithmetic, each measured at the tutorial's sizes (T, B, H = 50,
50, 1024; the figures are in docs/nn.md):

* The input projection of every time step is one GEMM, ``x @ W_ih^T``, into
  a workspace buffer, with both biases added once; a step then costs one
  GEMM with the recurrent weights plus elementwise work.
* The state is row-major, ``(B, H)``, and the step is ``h @ W_hh^T`` with the
  weight stored transposed and contiguous. With OpenBLAS that ran 1.3-2x
  faster than ``W_hh @ h^T`` (on an AMD EPYC with AVX2, and 7 % faster on
  an AVX-512 one): the small matrix is the one it packs for free.
* The batch is padded to a multiple of 4 rows: OpenBLAS's kernels take the
  rows 4 at a time and slow down on a remainder (50 rows took as long as
  56, 52 less). Padded rows of ``h`` start at zero and are never written,
  so they never need masking.
* Gates are stored in the order (o, i, f, g), dense: the recurrent GEMM
  writes them whole (oneDNN's packed kernels take no strided destination).
  The cell state is kept as ``s = -2c`` beside a copy of ``tanh(g)`` in a
  buffer of its own; weights and biases of o, i, f are scaled by -1 and
  those of g by -2. Then one ``exp``, ``+ 1`` and one division by
  ``[1, -2, 1, 2]`` give ``sigmoid(o), -2 sigmoid(i), sigmoid(f)`` and
  ``1 + tanh(g)``; subtracting 1 puts ``tanh(g)`` beside ``s``, so one
  multiply of blocks ``[i; f]`` by ``[tanh(g); s]`` forms both terms of the
  next ``s``, and ``tanh(c) = 2 / (1 + exp(s)) - 1``.
  numpy's float32 ``tanh`` runs at half the speed of its ``exp`` on AVX2
  (table lookups through gathers), and these scalings are powers of two, so
  they are exact.

No step allocates: every buffer lives in a `Workspace`, and workspaces are
kept between calls (a fresh 40 MB projection buffer costs its page faults
on every call).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

__all__ = [
    "NUMPY",
    "Engine",
    "PackedWeights",
    "Project",
    "StepFactory",
    "Workspace",
    "numpy_project",
    "numpy_step",
    "pack_weights",
    "run_direction",
    "workspace",
]

_F32 = np.float32

#: A recurrent step for one direction in one workspace: called with the
#: step's input projection ``(B, 4H)``, it sets ``gates[:, :4H]`` to
#: ``h @ W_hh^T`` plus that projection (on the live rows; padded rows hold
#: ``0 @ W_hh^T``).
Step = Callable[[np.ndarray], None]
StepFactory = Callable[["PackedWeights", "Workspace"], Step]
#: The input projection of a whole direction in one workspace: called with
#: ``x`` as ``(T*B, I)`` (any strides) and a dense ``(T*B, 4H)`` view of the
#: workspace's projection buffer, it sets the latter to ``x @ W_ih^T`` plus
#: the bias, if any.
Project = Callable[["PackedWeights", "Workspace", np.ndarray, np.ndarray], None]


@dataclass(frozen=True, slots=True)
class Engine:
    """What runs the two GEMMs of `run_direction`: the input projection of
    every step at once, and the recurrent step."""

    project: Project
    step: StepFactory


@dataclass(eq=False, slots=True)
class PackedWeights:
    """One direction of one layer, rearranged for `run_direction`.

    `engine_data` is for an engine's own copies of the weights (a reordered
    layout), made at their first use and dropped with the weights.
    """

    w_ih_t: np.ndarray  # (I, 4H): gates (o, i, f, g) scaled by (-1, -1, -1, -2)
    w_hh_t: np.ndarray  # (H, 4H), same order and scaling
    bias: np.ndarray | None  # (4H,): b_ih + b_hh, same order and scaling
    hidden_size: int
    engine_data: object = None


def pack_weights(
    w_ih: np.ndarray, w_hh: np.ndarray, b_ih: np.ndarray | None, b_hh: np.ndarray | None
) -> PackedWeights:
    """Reorder and scale PyTorch-layout weights (gates i, f, g, o) for `run_direction`."""
    hidden = w_hh.shape[1]
    i, f, g, o = (slice(k * hidden, (k + 1) * hidden) for k in range(4))
    scale = np.full(4 * hidden, -1.0, _F32)
    scale[3 * hidden :] = -2.0

    def reorder(a: np.ndarray) -> np.ndarray:
        return np.concatenate([a[o], a[i], a[f], a[g]]).astype(_F32) * (
            scale if a.ndim == 1 else scale[:, None]
        )

    bias = None
    if b_ih is not None and b_hh is not None:
        bias = reorder(b_ih + b_hh)
    return PackedWeights(
        np.ascontiguousarray(reorder(w_ih).T), np.ascontiguousarray(reorder(w_hh).T), bias, hidden
    )


def padded(batch: int) -> int:
    """Rows of the state for `batch` sequences: a multiple of 4."""
    return -(-batch // 4) * 4


class Workspace:
    """The buffers of one direction's run: the projection of every step,
    the gates ``(rows, 4H)``, ``tanh(g)`` with the cell state beside it
    ``(rows, 2H)``, ``h`` and ``tanh(c)``.

    Sized by `fit`; the projection buffer only grows. `engine_data` is for
    an engine's handles on these buffers (pointed at the arrays of each use),
    which `fit` drops whenever it replaces the state's buffers.
    """

    __slots__ = ("engine_data", "g_s", "gates", "h", "proj", "tanh_c")

    def __init__(self) -> None:
        self.proj = np.empty(0, _F32)
        self.gates = self.g_s = self.h = self.tanh_c = np.empty((0, 0), _F32)
        self.engine_data: object = None

    def fit(self, steps: int, batch: int, hidden: int) -> None:
        rows = padded(batch)
        if self.proj.size < steps * batch * 4 * hidden:
            self.proj = np.empty(steps * batch * 4 * hidden, _F32)
        if self.h.shape != (rows, hidden):
            self.gates = np.zeros((rows, 4 * hidden), _F32)
            self.g_s = np.empty((rows, 2 * hidden), _F32)
            self.h = np.zeros((rows, hidden), _F32)
            self.engine_data = None
        if self.tanh_c.shape != (batch, hidden):
            self.tanh_c = np.empty((batch, hidden), _F32)


_spare: list[Workspace] = []
_spare_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # Only the forking thread survives: a lender in another thread may have
    # held the lock, and its workspace is not coming back.
    global _spare_lock
    _spare_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def workspace() -> Iterator[Workspace]:
    """Lend a `Workspace` for one run: a spare one if any, else a new one.

    Workspaces go back to a process-wide spare list, so the list holds as
    many as ran at once at most, each as large as the largest run it served.
    """
    with _spare_lock:
        lent = _spare.pop() if _spare else Workspace()
    try:
        yield lent
    finally:
        with _spare_lock:
            _spare.append(lent)


def numpy_project(weights: PackedWeights, ws: Workspace, x: np.ndarray, out: np.ndarray) -> None:
    """The input projection through numpy's matmul (BLAS), then the bias."""
    np.matmul(x, weights.w_ih_t, out=out)
    if weights.bias is not None:
        out += weights.bias


def numpy_step(weights: PackedWeights, ws: Workspace) -> Step:
    """The recurrent step through numpy's matmul (BLAS)."""
    batch = ws.tanh_c.shape[0]
    matmul, add = np.matmul, np.add
    h, w_hh_t, gates, live = ws.h, weights.w_hh_t, ws.gates, ws.gates[:batch]

    def step(proj_t: np.ndarray) -> None:
        matmul(h, w_hh_t, out=gates)
        add(live, proj_t, out=live)

    return step


#: both GEMMs through numpy's matmul
NUMPY = Engine(numpy_project, numpy_step)


def run_direction(
    weights: PackedWeights,
    x: np.ndarray,
    out: np.ndarray,
    h0: np.ndarray | None = None,
    c0: np.ndarray | None = None,
    *,
    reverse: bool = False,
    accumulate: bool = False,
    engine: Engine = NUMPY,
) -> tuple[np.ndarray, np.ndarray]:
    """Run one LSTM direction over `x` and write every hidden state into `out`.

    `x` is ``(T, B, I)`` float32 (any strides); `out` is a writable float32
    ``(T, B, H)`` view (any strides), where ``out[t]`` receives the hidden
    state after input ``x[t]``, or has it added with `accumulate`. With
    `reverse` the steps run from ``T - 1`` down to 0, which is
    ``flip(lstm(flip(x)))``. `h0` and `c0` are ``(B, H)`` or None for zeros.
    `engine` runs the GEMMs (numpy's matmul by default).
    Returns the final ``(h, c)`` as new ``(B, H)`` arrays.
    """
    steps, batch, features = x.shape
    hidden = weights.hidden_size
    with workspace() as ws:
        ws.fit(steps, batch, hidden)
        h, tanh_c = ws.h, ws.tanh_c
        h.fill(0.0)
        s = ws.g_s[:batch, hidden:]  # -2c
        if h0 is not None:
            h[:batch] = h0
        if c0 is None:
            s.fill(0.0)
        else:
            np.multiply(c0, -2.0, out=s)
        if steps:
            proj = ws.proj[: steps * batch * 4 * hidden].reshape(steps * batch, 4 * hidden)
            engine.project(weights, ws, x.reshape(steps * batch, features), proj)
            with np.errstate(over="ignore"):  # exp(z) = inf is a gate's limit: 0 or 1
                _recur(
                    engine.step(weights, ws),
                    proj.reshape(steps, batch, 4 * hidden),
                    ws.gates[:batch],
                    ws.g_s[:batch],
                    h[:batch],
                    tanh_c,
                    out,
                    range(steps - 1, -1, -1) if reverse else range(steps),
                    first_from_zero=h0 is None,
                    accumulate=accumulate,
                )
        return h[:batch].copy(), s * -0.5


#: what divides ``1 + exp(z)`` for each gate block: sigmoid(o), -2 sigmoid(i),
#: sigmoid(f), 1 + tanh(g)
_NUMERATORS = (1.0, -2.0, 1.0, 2.0)
_numerators: dict[int, np.ndarray] = {}


def _numerator(hidden: int) -> np.ndarray:
    row = _numerators.get(hidden)
    if row is None:
        row = np.repeat(np.array(_NUMERATORS, _F32), hidden)
        _numerators[hidden] = row
    return row


def _recur(
    step: Step,
    proj: np.ndarray,
    gates: np.ndarray,
    g_s: np.ndarray,
    h: np.ndarray,
    tanh_c: np.ndarray,
    out: np.ndarray,
    order: range,
    *,
    first_from_zero: bool,
    accumulate: bool,
) -> None:
    """The time loop on the live rows: `gates` ``(B, 4H)``, `g_s` ``(B, 2H)``,
    `h` and `tanh_c` ``(B, H)``; fourteen numpy calls a step, none allocating."""
    hidden = h.shape[1]
    numerator = _numerator(hidden)
    o = gates[:, :hidden]
    in_forget = gates[:, hidden : 3 * hidden]
    in_term = gates[:, hidden : 2 * hidden]
    forget_term = gates[:, 2 * hidden : 3 * hidden]
    g = gates[:, 3 * hidden :]
    tanh_g, s = g_s[:, :hidden], g_s[:, hidden:]
    exp, add, subtract, multiply, divide = np.exp, np.add, np.subtract, np.multiply, np.divide
    skip_step = first_from_zero
    for t in order:
        proj_t = proj[t]
        if skip_step:  # h is zero: h @ W_hh^T is too
            np.copyto(gates, proj_t)
            skip_step = False
        else:
            step(proj_t)
        exp(gates, out=gates)
        add(gates, 1.0, out=gates)
        divide(numerator, gates, out=gates)  # sigmoid(o), -2 sigmoid(i), sigmoid(f), 1 + tanh(g)
        subtract(g, 1.0, out=tanh_g)
        multiply(in_forget, g_s, out=in_forget)  # -2 sigmoid(i) tanh(g), sigmoid(f) s
        add(in_term, forget_term, out=s)  # the next s = -2c
        exp(s, out=tanh_c)
        add(tanh_c, 1.0, out=tanh_c)
        divide(2.0, tanh_c, out=tanh_c)
        subtract(tanh_c, 1.0, out=tanh_c)  # tanh(c)
        multiply(o, tanh_c, out=h)
        if accumulate:
            add(out[t], h, out=out[t])
        else:
            np.copyto(out[t], h)
