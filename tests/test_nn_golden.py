"""aiopar.nn against PyTorch: committed golden fixtures, and live torch when it is installed.

The fixtures come from tests/fixtures/make_golden.py (which needs torch);
these tests read them with numpy only.
"""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

import numpy as np
import pytest

from aiopar.nn import LSTM, LSTMEnsemble, _engine, set_lstm_engine

FIXTURES = Path(__file__).resolve().parent / "fixtures"
LSTM_FIXTURES = sorted(FIXTURES.glob("lstm_*.npz"))
TOLERANCE = 1e-5


def load_fixture(path: Path) -> tuple[dict, dict[str, np.ndarray], dict[str, np.ndarray]]:
    with np.load(path) as data:
        items = {k: data[k] for k in data.files}
    config = {k.removeprefix("config."): v.item() for k, v in items.items() if k[:7] == "config."}
    params = {k.removeprefix("param."): v for k, v in items.items() if k.startswith("param.")}
    rest = {k: v for k, v in items.items() if "." not in k}
    return config, params, rest


def max_error(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape
    return float(np.abs(a.astype(np.float64) - b).max(initial=0.0))


def test_fixtures_are_present() -> None:
    assert len(LSTM_FIXTURES) >= 10
    assert (FIXTURES / "ensemble.npz").exists()


@pytest.mark.parametrize("path", LSTM_FIXTURES, ids=lambda p: p.stem)
def test_lstm_matches_torch_fixture(path: Path) -> None:
    config, params, data = load_fixture(path)
    lstm = LSTM(**config)
    lstm.load_state_dict(params)
    hx = (data["h0"], data["c0"]) if "h0" in data else None
    output, (h_n, c_n) = lstm(data["x"], hx)
    assert max_error(output, data["output"]) <= TOLERANCE
    assert max_error(h_n, data["h_n"]) <= TOLERANCE
    assert max_error(c_n, data["c_n"]) <= TOLERANCE


@pytest.mark.parametrize(
    ("fork_models", "fork_directions"), list(itertools.product([False, True], repeat=2))
)
def test_ensemble_matches_torch_fixture(fork_models: bool, fork_directions: bool) -> None:
    config, params, data = load_fixture(FIXTURES / "ensemble.npz")
    ens = LSTMEnsemble(**config, fork_models=fork_models, fork_directions=fork_directions)
    ens.load_state_dict(params)
    assert max_error(ens(data["x"]), data["output"]) <= TOLERANCE


# -- live parity, on each engine ----------------------------------------------


@pytest.fixture(params=["numpy", "onednn"])
def engine(request):
    """Run the test on each LSTM engine (oneDNN: when onednn-cpu-gomp is installed)."""
    if set_lstm_engine(request.param) != request.param:
        pytest.skip(f"the {request.param} engine does not load here")
    yield request.param
    _engine._preference, _engine._choice = None, None


def _tutorial_modules():
    spec = importlib.util.spec_from_file_location("make_golden", FIXTURES / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("num_layers", "bias", "batch_first", "bidirectional"),
    list(itertools.product([1, 2], [True, False], [False, True], [False, True])),
)
def test_lstm_matches_live_torch(engine, num_layers, bias, batch_first, bidirectional) -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(num_layers * 8 + bias * 4 + batch_first * 2 + bidirectional)
    reference = torch.nn.LSTM(7, 16, num_layers, bias, batch_first, 0.0, bidirectional)
    lstm = LSTM(7, 16, num_layers, bias, batch_first, bidirectional)
    lstm.load_state_dict(reference.state_dict())  # tensors, not arrays
    d = (2 if bidirectional else 1) * num_layers
    x = torch.randn((10, 9, 7) if batch_first else (9, 10, 7))
    hx = (torch.randn(d, 10, 16), torch.randn(d, 10, 16))
    with torch.no_grad():
        for args in ((x,), (x, hx), (x[0] if batch_first else x[:, 0],)):
            want, (want_h, want_c) = reference(*args)
            got, (h, c) = lstm(*args)
            assert max_error(got, want.numpy()) <= TOLERANCE
            assert max_error(h, want_h.numpy()) <= TOLERANCE
            assert max_error(c, want_c.numpy()) <= TOLERANCE


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize(("fork_models", "fork_directions"), [(False, False), (True, True)])
def test_tutorial_ensemble_matches_scripted_torch(engine, fork_models, fork_directions) -> None:
    torch = pytest.importorskip("torch")
    tutorial = _tutorial_modules()
    torch.manual_seed(0)
    scripted = torch.jit.script(tutorial.LSTMEnsemble(4, 16, 16))
    ens = LSTMEnsemble(4, 16, 16, fork_models=fork_models, fork_directions=fork_directions)
    ens.load_state_dict({k: v.numpy() for k, v in scripted.state_dict().items()})
    x = torch.rand(12, 5, 16)
    with torch.no_grad():
        want = scripted(x).numpy()
    assert max_error(ens(x.numpy()), want) <= TOLERANCE
