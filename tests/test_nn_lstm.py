"""aiopar.nn.LSTM: torch.nn.LSTM shapes, names and semantics, and its input checks."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from aiopar.nn import LSTM

T, B, F, H = 5, 3, 4, 6


def standard_normal(*shape: int, seed: int = 0) -> np.ndarray:
    """Float32 samples of N(0, 1), reproducible by seed."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(
    ("num_layers", "bias", "batch_first", "bidirectional"),
    list(itertools.product([1, 2], [True, False], [False, True], [False, True])),
)
def test_shapes_for_every_option(num_layers, bias, batch_first, bidirectional) -> None:
    lstm = LSTM(F, H, num_layers, bias, batch_first, bidirectional, seed=0)
    d = 2 if bidirectional else 1
    x = standard_normal(B, T, F) if batch_first else standard_normal(T, B, F)
    output, (h_n, c_n) = lstm(x)
    assert output.shape == ((B, T, d * H) if batch_first else (T, B, d * H))
    assert h_n.shape == c_n.shape == (d * num_layers, B, H)
    assert output.dtype == h_n.dtype == c_n.dtype == np.float32
    assert output.flags.c_contiguous

    # Unbatched input ignores batch_first, as in torch.
    output, (h_n, c_n) = lstm(standard_normal(T, F))
    assert output.shape == (T, d * H)
    assert h_n.shape == c_n.shape == (d * num_layers, H)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_parameter_names_and_shapes_match_torch(bidirectional) -> None:
    lstm = LSTM(F, H, num_layers=2, bidirectional=bidirectional)
    d = 2 if bidirectional else 1
    expected = {}
    for layer in range(2):
        for suffix in ["", "_reverse"][:d]:
            width = F if layer == 0 else d * H
            expected[f"weight_ih_l{layer}{suffix}"] = (4 * H, width)
            expected[f"weight_hh_l{layer}{suffix}"] = (4 * H, H)
            expected[f"bias_ih_l{layer}{suffix}"] = (4 * H,)
            expected[f"bias_hh_l{layer}{suffix}"] = (4 * H,)
    assert {k: v.shape for k, v in lstm.state_dict().items()} == expected
    assert list(lstm.state_dict()) == list(expected)  # torch's order too


def test_no_bias_has_no_bias_parameters() -> None:
    assert all("bias" not in k for k in LSTM(F, H, bias=False).state_dict())


def test_init_is_uniform_within_one_over_sqrt_hidden_and_seeded() -> None:
    lstm = LSTM(30, 100, seed=7)
    values = np.concatenate([p.ravel() for p in lstm.parameters()])
    bound = 1 / np.sqrt(100)
    assert values.min() >= -bound and values.max() <= bound
    assert abs(values.mean()) < 0.01 * bound * 10
    assert abs(values.std() - bound / np.sqrt(3)) < 0.01
    same = LSTM(30, 100, seed=7)
    other = LSTM(30, 100, seed=8)
    np.testing.assert_array_equal(lstm.weight_ih_l0, same.weight_ih_l0)
    assert not np.array_equal(lstm.weight_ih_l0, other.weight_ih_l0)


def test_gate_order_is_i_f_g_o() -> None:
    # With zero weights each gate is its bias: i=sigmoid(b_i), f, g=tanh(b_g), o.
    lstm = LSTM(1, 1, seed=0)
    b = np.array([0.3, -0.2, 0.7, 1.1], np.float32)  # i, f, g, o
    lstm.load_state_dict(
        {
            "weight_ih_l0": np.zeros((4, 1)),
            "weight_hh_l0": np.zeros((4, 1)),
            "bias_ih_l0": b,
            "bias_hh_l0": np.zeros(4),
        }
    )

    def sigmoid(v):
        return 1 / (1 + np.exp(-v))

    c1 = sigmoid(b[0]) * np.tanh(b[2])
    h1 = sigmoid(b[3]) * np.tanh(c1)
    c2 = sigmoid(b[1]) * c1 + sigmoid(b[0]) * np.tanh(b[2])
    h2 = sigmoid(b[3]) * np.tanh(c2)
    output, (_h_n, c_n) = lstm(np.zeros((2, 1), np.float32))
    np.testing.assert_allclose(output[:, 0], [h1, h2], atol=1e-6)
    np.testing.assert_allclose(c_n[0, 0], c2, atol=1e-6)


def reference_lstm(lstm: LSTM, x: np.ndarray, h0=None, c0=None):
    """Textbook float64 single-layer unidirectional LSTM, torch formulas."""
    w_ih, w_hh = lstm.weight_ih_l0.astype(np.float64), lstm.weight_hh_l0.astype(np.float64)
    b = (lstm.bias_ih_l0 + lstm.bias_hh_l0).astype(np.float64) if lstm.bias else 0.0
    h = np.zeros((x.shape[1], lstm.hidden_size)) if h0 is None else h0.astype(np.float64)
    c = np.zeros_like(h) if c0 is None else c0.astype(np.float64)
    outs = []
    for x_t in x.astype(np.float64):
        i, f, g, o = np.split(x_t @ w_ih.T + h @ w_hh.T + b, 4, axis=1)
        i, f, o = (1 / (1 + np.exp(-v)) for v in (i, f, o))
        c = f * c + i * np.tanh(g)
        h = o * np.tanh(c)
        outs.append(h)
    return np.stack(outs), h, c


@pytest.mark.parametrize("batch", [1, 3, 8, 9, 50])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_textbook_formulas_for_any_batch(batch, with_state) -> None:
    # Batches above 8 are padded internally; the padding must not leak.
    lstm = LSTM(F, H, seed=1)
    x = standard_normal(T, batch, F)
    h0, c0 = (
        (standard_normal(1, batch, H, seed=2), standard_normal(1, batch, H, seed=3))
        if with_state
        else (None, None)
    )
    if with_state:
        output, (h_n, c_n) = lstm(x, (h0, c0))
        ref_out, ref_h, ref_c = reference_lstm(lstm, x, h0[0], c0[0])
    else:
        output, (h_n, c_n) = lstm(x)
        ref_out, ref_h, ref_c = reference_lstm(lstm, x)
    np.testing.assert_allclose(output, ref_out, atol=1e-5)
    np.testing.assert_allclose(h_n[0], ref_h, atol=1e-5)
    np.testing.assert_allclose(c_n[0], ref_c, atol=1e-5)


def test_reverse_direction_is_the_flipped_forward_pass() -> None:
    lstm = LSTM(F, H, bidirectional=True, seed=3)
    single = LSTM(F, H, seed=0)
    single.load_state_dict(
        {
            k.removesuffix("_reverse"): v
            for k, v in lstm.state_dict().items()
            if k.endswith("_reverse")
        }
    )
    x = standard_normal(T, B, F)
    output, (h_n, _) = lstm(x)
    out_b, (h_b, _) = single(x[::-1])
    np.testing.assert_allclose(output[:, :, H:], out_b[::-1], atol=1e-6)
    np.testing.assert_allclose(h_n[1], h_b[0], atol=1e-6)


def test_batch_first_is_a_transpose() -> None:
    a, b = LSTM(F, H, num_layers=2, seed=4), LSTM(F, H, num_layers=2, batch_first=True, seed=4)
    x = standard_normal(T, B, F)
    out_a, (h_a, _c_a) = a(x)
    out_b, (h_b, _c_b) = b(np.ascontiguousarray(x.transpose(1, 0, 2)))
    np.testing.assert_allclose(out_b.transpose(1, 0, 2), out_a, atol=1e-6)
    np.testing.assert_allclose(h_b, h_a, atol=1e-6)


def test_unbatched_equals_batch_of_one() -> None:
    lstm = LSTM(F, H, num_layers=2, bidirectional=True, seed=5)
    x = standard_normal(T, F)
    h0, c0 = standard_normal(4, H, seed=1), standard_normal(4, H, seed=2)
    out, (h_n, _c_n) = lstm(x, (h0, c0))
    out1, (h1, _c1) = lstm(x[:, None], (h0[:, None], c0[:, None]))
    np.testing.assert_array_equal(out, out1[:, 0])
    np.testing.assert_array_equal(h_n, h1[:, 0])


def test_empty_sequence_returns_the_initial_state() -> None:
    lstm = LSTM(F, H, seed=0)
    h0, c0 = standard_normal(1, B, H), standard_normal(1, B, H, seed=1)
    output, (h_n, c_n) = lstm(np.zeros((0, B, F), np.float32), (h0, c0))
    assert output.shape == (0, B, H)
    np.testing.assert_array_equal(h_n, h0)
    np.testing.assert_array_equal(c_n, c0)


def test_input_is_not_modified() -> None:
    lstm = LSTM(F, H, seed=0)
    x = standard_normal(T, B, F)
    h0, c0 = standard_normal(1, B, H), standard_normal(1, B, H, seed=1)
    copies = [x.copy(), h0.copy(), c0.copy()]
    lstm(x, (h0, c0))
    for before, after in zip(copies, [x, h0, c0], strict=True):
        np.testing.assert_array_equal(before, after)


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_other_float_dtypes_are_cast_to_float32(dtype) -> None:
    lstm = LSTM(F, H, seed=0)
    x = standard_normal(T, B, F)
    out, _ = lstm(x.astype(dtype))
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, lstm(x.astype(dtype).astype(np.float32))[0])


def test_strided_input_views_work() -> None:
    lstm = LSTM(F, H, seed=0)
    x = standard_normal(2 * T, B, 2 * F)
    view = x[::2, :, ::2]
    np.testing.assert_array_equal(lstm(view)[0], lstm(np.ascontiguousarray(view))[0])


def test_nan_propagates() -> None:
    lstm = LSTM(F, H, seed=0)
    x = standard_normal(T, B, F)
    x[2, 1, 0] = np.nan
    output, _ = lstm(x)
    assert not np.isnan(output[:2]).any()
    assert np.isnan(output[2:, 1]).all()
    assert not np.isnan(output[:, [0, 2]]).any()


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.bool_])
def test_integer_and_bool_input_is_refused_with_a_hint(dtype) -> None:
    with pytest.raises(TypeError, match=r"floating-point array, got dtype .*astype\(np.float32\)"):
        LSTM(F, H)(np.ones((T, B, F), dtype))


def test_complex_input_is_refused() -> None:
    with pytest.raises(TypeError, match="complex64"):
        LSTM(F, H)(np.ones((T, B, F), np.complex64))


@pytest.mark.parametrize("shape", [(F,), (1, T, B, F)])
def test_wrong_rank_names_the_expected_shapes(shape) -> None:
    with pytest.raises(
        ValueError, match=rf"3-D input of shape \(T, B, input_size\).*got {len(shape)}-D"
    ):
        LSTM(F, H)(np.zeros(shape, np.float32))


def test_wrong_rank_message_follows_batch_first() -> None:
    with pytest.raises(ValueError, match=r"\(B, T, input_size\)"):
        LSTM(F, H, batch_first=True)(np.zeros(F, np.float32))


def test_wrong_feature_size_names_both_sizes() -> None:
    with pytest.raises(
        ValueError, match=rf"LSTM\(input_size={F}\) got input whose last dimension is 7"
    ):
        LSTM(F, H)(np.zeros((T, B, 7), np.float32))


def test_wrong_hx_shape_names_the_expected_shape() -> None:
    lstm = LSTM(F, H, num_layers=2)
    with pytest.raises(
        ValueError, match=rf"h_0 must have shape \(2, {B}, {H}\).*got \(1, {B}, {H}\)"
    ):
        lstm(standard_normal(T, B, F), (standard_normal(1, B, H), standard_normal(2, B, H)))
    with pytest.raises(ValueError, match=rf"c_0 must have shape \(2, {H}\)"):
        lstm(standard_normal(T, F), (standard_normal(2, H), standard_normal(2, 1, H)))
    with pytest.raises(TypeError, match=r"tuple \(h_0, c_0\)"):
        lstm(standard_normal(T, B, F), standard_normal(2, B, H))


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((0, 4), "input_size"),
        ((4, 0), "hidden_size"),
        ((4, 4, 0), "num_layers"),
        ((4.5, 4), "input_size"),
    ],
)
def test_bad_constructor_arguments(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        LSTM(*args)


def test_torch_style_positional_dropout_is_refused_not_read_as_bidirectional():
    with pytest.raises(TypeError, match="no dropout"):
        LSTM(10, 20, 2, True, False, 0.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="batch_first must be True or False"):
        LSTM(10, 20, batch_first=1)  # type: ignore[arg-type]
