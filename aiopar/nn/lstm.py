"""`LSTM`: `torch.nn.LSTM` inference in float32 numpy."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from ._engine import current_engine
from ._recurrence import PackedWeights, pack_weights, run_direction
from .module import Module

__all__ = ["LSTM"]

Seed = int | np.random.SeedSequence | np.random.Generator | None


def as_float_input(x: Any, who: str) -> np.ndarray:
    """`x` as a float32 ndarray. Floats of any width are cast; anything else is refused.

    Integers are refused rather than cast because an integer array handed to a
    recurrent layer is almost always token ids that were meant to go through
    an embedding first.
    """
    if hasattr(x, "detach") and hasattr(x, "cpu") and hasattr(x, "numpy"):
        x = x.detach().cpu().numpy()
    array = np.asarray(x)
    if array.dtype.kind != "f":
        hint = (
            " (integers are refused rather than cast: if these are values, not token ids, "
            "pass x.astype(np.float32))"
            if array.dtype.kind in "iub"
            else ""
        )
        raise TypeError(
            f"{who} input must be a floating-point array, got dtype {array.dtype}{hint}"
        )
    return array.astype(np.float32, copy=False)


class LSTM(Module):
    """A multi-layer LSTM with `torch.nn.LSTM`'s inference semantics.

    Shapes, parameter names (``weight_ih_l{k}``, ``weight_hh_l{k}``,
    ``bias_ih_l{k}``, ``bias_hh_l{k}``, ``_reverse`` for the second direction),
    gate order (i, f, g, o) and initialization (uniform in ``±1/sqrt(hidden_size)``,
    drawn from ``np.random.default_rng(seed)``) are PyTorch's, so a state dict
    moves between the two unchanged.

    Computation is float32. Input of any floating dtype is cast to float32;
    integer, boolean and complex input raise `TypeError`. NaN and inf propagate
    as numpy arithmetic makes them.
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        bidirectional: bool = False,
        *,
        seed: Seed = None,
    ) -> None:
        super().__init__()
        for name, value, low in (
            ("input_size", input_size, 1),
            ("hidden_size", hidden_size, 1),
            ("num_layers", num_layers, 1),
        ):
            if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < low:
                raise ValueError(f"LSTM {name} must be an integer >= {low}, got {value!r}")
        for name, value in (("bias", bias), ("batch_first", batch_first)):
            if not isinstance(value, bool | np.bool_):
                raise TypeError(f"LSTM {name} must be True or False, got {value!r}")
        if not isinstance(bidirectional, bool | np.bool_):
            # torch.nn.LSTM's sixth positional argument is dropout, which an
            # inference-only port does not take: refuse it rather than read
            # LSTM(10, 20, 2, True, False, 0.5) as bidirectional.
            raise TypeError(
                f"LSTM bidirectional must be True or False, got {bidirectional!r}; "
                "aiopar.nn.LSTM has no dropout (inference only), so pass options from "
                "torch.nn.LSTM by keyword"
            )
        self.input_size = int(input_size)
        self.hidden_size = int(hidden_size)
        self.num_layers = int(num_layers)
        self.bias = bool(bias)
        self.batch_first = bool(batch_first)
        self.bidirectional = bool(bidirectional)
        self._packed: list[PackedWeights] | None = None

        rng = np.random.default_rng(seed)
        bound = 1.0 / math.sqrt(hidden_size)
        gates = 4 * hidden_size
        directions = 2 if bidirectional else 1
        for layer in range(num_layers):
            layer_input = input_size if layer == 0 else hidden_size * directions
            for suffix in ("", "_reverse")[:directions]:
                shapes: dict[str, tuple[int, ...]] = {
                    f"weight_ih_l{layer}{suffix}": (gates, layer_input),
                    f"weight_hh_l{layer}{suffix}": (gates, hidden_size),
                }
                if bias:
                    shapes[f"bias_ih_l{layer}{suffix}"] = (gates,)
                    shapes[f"bias_hh_l{layer}{suffix}"] = (gates,)
                for name, shape in shapes.items():
                    self.register_parameter(
                        name, rng.uniform(-bound, bound, size=shape).astype(np.float32)
                    )

    @property
    def num_directions(self) -> int:
        return 2 if self.bidirectional else 1

    def extra_repr(self) -> str:
        options = [f"{self.input_size}, {self.hidden_size}"]
        if self.num_layers != 1:
            options.append(f"num_layers={self.num_layers}")
        if not self.bias:
            options.append("bias=False")
        if self.batch_first:
            options.append("batch_first=True")
        if self.bidirectional:
            options.append("bidirectional=True")
        return ", ".join(options)

    def _parameters_changed(self) -> None:
        self._packed = None

    def _transient_state(self) -> dict[str, Any]:
        return {"_packed": None}

    def _packed_weights(self) -> list[PackedWeights]:
        packed = self._packed
        if packed is None:
            packed = []
            p = self._parameters
            for layer in range(self.num_layers):
                for suffix in ("", "_reverse")[: self.num_directions]:
                    key = f"l{layer}{suffix}"
                    packed.append(
                        pack_weights(
                            p[f"weight_ih_{key}"],
                            p[f"weight_hh_{key}"],
                            p.get(f"bias_ih_{key}"),
                            p.get(f"bias_hh_{key}"),
                        )
                    )
            self._packed = packed
        return packed

    # -- input checks -------------------------------------------------------

    def _time_major(self, x: Any) -> tuple[np.ndarray, bool]:
        """Check `x`; return a ``(T, B, input_size)`` float32 view and whether it is unbatched."""
        array = as_float_input(x, "LSTM")
        layout = "(B, T, input_size)" if self.batch_first else "(T, B, input_size)"
        if array.ndim not in (2, 3):
            raise ValueError(
                f"LSTM expects a 3-D input of shape {layout} or a 2-D unbatched input of shape "
                f"(T, input_size); got {array.ndim}-D input of shape {array.shape}"
            )
        if array.shape[-1] != self.input_size:
            raise ValueError(
                f"LSTM(input_size={self.input_size}) got input whose last dimension is "
                f"{array.shape[-1]} (shape {array.shape}); expected {layout}"
            )
        if array.ndim == 2:
            return array[:, None, :], True
        return (array.transpose(1, 0, 2) if self.batch_first else array), False

    def _initial_state(
        self, hx: Any, batch: int, unbatched: bool
    ) -> tuple[np.ndarray, np.ndarray] | None:
        if hx is None:
            return None
        if not isinstance(hx, tuple | list) or len(hx) != 2:
            raise TypeError("LSTM hx must be a tuple (h_0, c_0) or None")
        layers = self.num_layers * self.num_directions
        expected = (layers, self.hidden_size) if unbatched else (layers, batch, self.hidden_size)
        state = []
        for name, value in zip(("h_0", "c_0"), hx, strict=True):
            array = as_float_input(value, f"LSTM {name}")
            if array.shape != expected:
                raise ValueError(
                    f"LSTM {name} must have shape {expected} "
                    f"(num_layers * num_directions, {'' if unbatched else 'batch, '}hidden_size); "
                    f"got {array.shape}"
                )
            state.append(array[:, None, :] if unbatched else array)
        return state[0], state[1]

    # -- running ------------------------------------------------------------

    def forward(
        self, x: Any, hx: tuple[Any, Any] | None = None
    ) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
        """Run the LSTM over a sequence.

        `x` is ``(T, B, input_size)``, or ``(B, T, input_size)`` with
        `batch_first`, or unbatched ``(T, input_size)``. `hx` is ``(h_0, c_0)``,
        each ``(num_layers * num_directions, B, hidden_size)`` (without B when
        unbatched), or None for zeros.

        Returns ``(output, (h_n, c_n))`` as new float32 arrays: `output` has
        shape ``(T, B, num_directions * hidden_size)`` (batch first if
        `batch_first`, without B when unbatched) and holds the last layer's
        hidden state at every step; `h_n` and `c_n` have the shape of `hx`.
        """
        x_tm, unbatched = self._time_major(x)
        steps, batch, _ = x_tm.shape
        state = self._initial_state(hx, batch, unbatched)
        width = self.num_directions * self.hidden_size
        if self.batch_first and not unbatched:
            output = np.empty((batch, steps, width), np.float32)
            out_tm = output.transpose(1, 0, 2)
        else:
            output = out_tm = np.empty((steps, batch, width), np.float32)
        h_n, c_n = self._run(x_tm, out_tm, state, reverse=False)
        if unbatched:
            return output[:, 0, :], (h_n[:, 0, :], c_n[:, 0, :])
        return output, (h_n, c_n)

    if TYPE_CHECKING:  # calling a module runs forward: show type checkers its signature
        __call__ = forward

    def _run(
        self,
        x: np.ndarray,
        out: np.ndarray,
        state: tuple[np.ndarray, np.ndarray] | None = None,
        *,
        reverse: bool = False,
        accumulate: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Run on validated time-major `x`, writing the last layer's output into
        `out` (adding it to what `out` holds with `accumulate`).

        With `reverse`, computes ``flip(lstm(flip(x)))`` without copying:
        every direction runs the other way in time.
        """
        steps, batch, _ = x.shape
        hidden = self.hidden_size
        directions = self.num_directions
        layers = self.num_layers * directions
        h_n = np.empty((layers, batch, hidden), np.float32)
        c_n = np.empty((layers, batch, hidden), np.float32)
        packed = self._packed_weights()
        engine = current_engine()
        layer_input = x
        for layer in range(self.num_layers):
            last = layer == self.num_layers - 1
            layer_out = out if last else np.empty((steps, batch, directions * hidden), np.float32)
            for d in range(directions):
                k = layer * directions + d
                h_n[k], c_n[k] = run_direction(
                    packed[k],
                    layer_input,
                    layer_out[:, :, d * hidden : (d + 1) * hidden],
                    None if state is None else state[0][k],
                    None if state is None else state[1][k],
                    reverse=(d == 1) != reverse,
                    accumulate=accumulate and last,
                    engine=engine,
                )
            layer_input = layer_out
        return h_n, c_n
