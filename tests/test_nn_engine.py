"""The LSTM engines and how the engine is chosen (parity with torch on each
engine is in test_nn_golden.py).

The oneDNN rows need the ``onednn-cpu-gomp`` wheel (``pip install
aiopar[onednn]``) and skip without it; the choice tests need nothing: they
stand in for a missing or broken library.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import run_python

import aiopar
from aiopar.nn import (
    LSTM,
    BidirectionalRecurrentLSTM,
    _engine,
    _onednn,
    lstm_engine,
    set_lstm_engine,
)

TOLERANCE = 1e-5
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def onednn_loads() -> bool:
    try:
        _onednn.load()
    except _onednn.OneDNNError:
        return False
    return True


@pytest.fixture(autouse=True)
def engine_chosen_afresh():
    """Every test starts with no choice made (the environment's preference) and leaves none."""
    _engine._preference, _engine._choice = None, None
    _engine._decided.clear()
    yield
    _engine._preference, _engine._choice = None, None
    _engine._decided.clear()


ENGINES = [
    "numpy",
    pytest.param(
        "onednn",
        marks=pytest.mark.skipif(not onednn_loads(), reason="onednn-cpu-gomp not installed"),
    ),
]


# -- both engines ------------------------------------------------------------------


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("engine", ENGINES)
def test_saturated_gates_reach_their_limits_silently(engine) -> None:
    # exp overflows to inf on the way: the gates are then exactly 0 or 1, and
    # numpy's overflow warning is not the user's business.
    set_lstm_engine(engine)
    lstm = LSTM(3, 4, seed=0)
    x = np.array([[[1e4, -1e4, 0.0]], [[-1e4, 1e4, 0.0]], [[0.0, 0.0, 0.0]]], np.float32)
    out, (_, c_n) = lstm(x)
    assert np.isfinite(out).all() and np.isfinite(c_n).all()
    assert (np.abs(out) <= 1).all()


@pytest.mark.skipif(not onednn_loads(), reason="onednn-cpu-gomp not installed")
def test_onednn_matches_numpy_at_the_tutorial_hidden_size() -> None:
    # The golden tests run small layers; this one has the tutorial's hidden
    # size and batch (50 rows, padded to 52), so oneDNN's kernel runs its
    # full and partial blocks.
    assert set_lstm_engine("onednn") == "onednn"
    lstm = LSTM(64, 1024, bidirectional=True, seed=5)
    x = np.random.default_rng(5).standard_normal((4, 50, 64)).astype(np.float32)
    got, (h, c) = lstm(x)
    set_lstm_engine("numpy")
    want, (want_h, want_c) = lstm(x)
    for a, b in ((got, want), (h, want_h), (c, want_c)):
        np.testing.assert_allclose(a, b, rtol=0, atol=TOLERANCE)


# -- oneDNN's kernel ---------------------------------------------------------------

#: the CPU flags of oneDNN's avx512_core, the least ISA of its packed (brgemm) f32 matmul
AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return {flag for line in text.splitlines() if line.startswith("flags") for flag in line.split()}


def packed_kernel_expected() -> str | None:
    """Why the packed-kernel test cannot run here, or None if it can."""
    if not onednn_loads():
        return "onednn-cpu-gomp not installed"
    flags = cpu_flags()
    if flags is None:
        return "no /proc/cpuinfo to read the CPU's flags from"
    missing = AVX512_CORE - flags
    if missing:
        return f"the CPU lacks {', '.join(sorted(missing))}: oneDNN has no packed kernel for it"
    return None


@pytest.mark.skipif(packed_kernel_expected() is not None, reason=str(packed_kernel_expected()))
def test_onednn_gets_its_packed_kernel_on_avx512() -> None:
    # oneDNN's generic gemm:jit kernel is no faster than OpenBLAS: on an
    # AVX-512 CPU the step must get a brgemm one, at the tutorial's shape
    # (52 padded rows, hidden 1024) as at the self-test's.
    assert set_lstm_engine("onednn") == "onednn"
    line = next(ln for ln in aiopar.parallel_info().splitlines() if "LSTM engine" in ln)
    assert "gemm:jit" not in line and ", brg:" in line, line
    assert _onednn.load().matmul(52, 1024, 4096, accumulate=True).implementation.startswith("brg:")


@pytest.mark.skipif(packed_kernel_expected() is not None, reason=str(packed_kernel_expected()))
def test_onednn_runs_the_input_projection_with_its_packed_kernel(monkeypatch) -> None:
    # The projection of a whole direction (T*B rows) is half the ensemble's
    # work: where oneDNN is the engine, its primitive runs it, not numpy, on
    # the one intra-op thread each of the ensemble's forks has.
    assert set_lstm_engine("onednn") == "onednn"
    aiopar.set_num_threads(1)
    projected: list[tuple[int, int]] = []
    real_project = _onednn.OneDNN.project

    def project(self, weights, ws, x, out):
        projected.append(x.shape)
        real_project(self, weights, ws, x, out)

    def numpy_project(weights, ws, x, out):
        raise AssertionError("numpy ran the projection")

    monkeypatch.setattr(_onednn.OneDNN, "project", project)
    monkeypatch.setattr(_engine, "numpy_project", numpy_project)
    try:
        lstm = LSTM(1024, 1024, bidirectional=True, seed=1)
        lstm(np.ones((3, 50, 1024), np.float32))
    finally:
        aiopar.set_num_threads(None)
    assert projected == [(150, 1024), (150, 1024)]
    kernel = _onednn.load().matmul(150, 1024, 4096, bias=True).implementation
    assert kernel.startswith("brg:"), kernel


@pytest.mark.skipif(packed_kernel_expected() is not None, reason=str(packed_kernel_expected()))
def test_numpy_runs_the_projection_where_more_intra_op_threads_are_free(monkeypatch) -> None:
    # oneDNN's primitives run on one thread; outside forks numpy's BLAS
    # spreads the projection over every intra-op thread (a single LSTM call
    # was 1.25x slower in wall time on one thread).
    assert set_lstm_engine("onednn") == "onednn"
    projected: list[tuple[int, int]] = []
    real_project = _engine.numpy_project

    def numpy_project(weights, ws, x, out):
        projected.append(x.shape)
        real_project(weights, ws, x, out)

    monkeypatch.setattr(_engine, "numpy_project", numpy_project)
    aiopar.set_num_threads(2)
    try:
        LSTM(64, 64, seed=1)(np.ones((3, 5, 64), np.float32))
    finally:
        aiopar.set_num_threads(None)
    assert projected == [(15, 64)]


@pytest.mark.skipif(packed_kernel_expected() is not None, reason=str(packed_kernel_expected()))
def test_onednn_is_the_default_where_it_has_its_packed_kernel(monkeypatch) -> None:
    monkeypatch.delenv(_engine.ENV_VAR, raising=False)
    assert lstm_engine() == "onednn"
    assert "LSTM engine: onednn (oneDNN 3" in aiopar.parallel_info()


# -- the choice -----------------------------------------------------------------


def test_numpy_is_the_default_without_onednn(monkeypatch) -> None:
    def absent() -> str:
        raise _onednn.OneDNNError("onednn-cpu-gomp is not installed (pip install aiopar[onednn])")

    monkeypatch.setattr(_onednn, "library_path", absent)
    _onednn.load.cache_clear()
    try:
        assert lstm_engine() == "numpy"
        assert "LSTM engine: numpy (oneDNN not used: onednn-cpu-gomp is not installed" in (
            aiopar.parallel_info()
        )
        assert LSTM(4, 6, seed=0)(np.ones((3, 2, 4), np.float32))[0].shape == (3, 2, 6)
    finally:
        _onednn.load.cache_clear()


@pytest.mark.skipif(not onednn_loads(), reason="onednn-cpu-gomp not installed")
def test_a_failing_self_test_leaves_numpy_running(monkeypatch, caplog) -> None:
    real_step = _onednn.OneDNN.step

    def wrong_step(self, weights, ws):
        step = real_step(self, weights, ws)

        def off_by_a_little(proj_t):
            step(proj_t)
            ws.gates[:1, :1] += 1e-3

        return off_by_a_little

    monkeypatch.setattr(_onednn.OneDNN, "step", wrong_step)
    with caplog.at_level("DEBUG", logger="aiopar"):
        assert set_lstm_engine("onednn") == "numpy"
    assert "self-test differs from numpy" in caplog.text
    assert "self-test differs from numpy" in aiopar.parallel_info()


@pytest.mark.skipif(not onednn_loads(), reason="onednn-cpu-gomp not installed")
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("layout", ["time-major", "batch-first", "strided"])
def test_onednn_projection_equals_numpy(bias, layout) -> None:
    # The projection alone, on inputs of any strides, with and without the
    # bias the primitive adds.
    from aiopar.nn import _recurrence

    rng = np.random.default_rng(7)
    steps, batch, features, hidden = 5, 6, 40, 24

    def uniform(*shape: int) -> np.ndarray:
        return rng.uniform(-0.2, 0.2, shape).astype(np.float32)

    weights = _recurrence.pack_weights(
        uniform(4 * hidden, features),
        uniform(4 * hidden, hidden),
        uniform(4 * hidden) if bias else None,
        uniform(4 * hidden) if bias else None,
    )
    base = rng.standard_normal((batch, steps, 2 * features)).astype(np.float32)
    x = {
        "time-major": np.ascontiguousarray(base[:, :, :features].transpose(1, 0, 2)),
        "batch-first": base[:, :, :features].transpose(1, 0, 2),
        "strided": base[:, :, ::2].transpose(1, 0, 2),
    }[layout]
    x2d = x.reshape(steps * batch, features)
    onednn = _onednn.load()
    for _ in range(2):  # the second run reuses the workspace's memory, pointed at new arrays
        want = np.empty((steps * batch, 4 * hidden), np.float32)
        _recurrence.numpy_project(weights, _recurrence.Workspace(), x2d, want)
        with _recurrence.workspace() as ws:
            ws.fit(steps, batch, hidden)
            got = ws.proj[: want.size].reshape(want.shape)
            onednn.project(weights, ws, x2d, got)
            np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE)
        x2d = x2d * 0.5


@pytest.mark.skipif(not onednn_loads(), reason="onednn-cpu-gomp not installed")
@pytest.mark.parametrize("refused", ["project", "step"])
def test_a_shape_onednn_refuses_runs_on_numpy(monkeypatch, refused) -> None:
    # On one intra-op thread, where oneDNN runs both GEMMs.
    assert set_lstm_engine("onednn") == "onednn"
    lstm = LSTM(5, 7, seed=3)
    x = np.random.default_rng(0).standard_normal((4, 3, 5)).astype(np.float32)
    aiopar.set_num_threads(1)
    try:
        expected = lstm(x)[0]

        def refuse(*args):
            raise _onednn.OneDNNError("no primitive for this shape")

        monkeypatch.setattr(_onednn.OneDNN, refused, refuse)
        np.testing.assert_allclose(lstm(x)[0], expected, atol=TOLERANCE)
    finally:
        aiopar.set_num_threads(None)


@pytest.mark.skipif(not onednn_loads(), reason="onednn-cpu-gomp not installed")
def test_auto_keeps_onednn_only_for_a_packed_kernel(monkeypatch) -> None:
    monkeypatch.setattr(_engine, "_self_test", lambda onednn: "gemm:jit:f32")
    assert set_lstm_engine("auto") == "numpy"
    assert "only its generic kernel gemm:jit:f32" in aiopar.parallel_info()
    monkeypatch.setattr(_engine, "_self_test", lambda onednn: "brg:avx512_core")
    _engine._decided.clear()
    assert set_lstm_engine("auto") == "onednn"
    assert "LSTM engine: onednn (oneDNN 3" in aiopar.parallel_info()


def test_set_lstm_engine_numpy_forces_numpy() -> None:
    assert set_lstm_engine("numpy") == "numpy"
    assert "LSTM engine: numpy (set_lstm_engine('numpy'))" in aiopar.parallel_info()


def test_set_lstm_engine_refuses_an_unknown_engine() -> None:
    with pytest.raises(ValueError, match=r"'auto', 'numpy', 'onednn', got 'mkl'"):
        set_lstm_engine("mkl")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("numpy", "numpy (AIOPAR_LSTM_ENGINE=numpy)"),
        ("fastest", "numpy (AIOPAR_LSTM_ENGINE=fastest is not one of auto, numpy, onednn"),
    ],
)
def test_the_environment_variable_chooses(value, said) -> None:
    done = run_python(
        """
        import aiopar, aiopar.nn
        print(aiopar.nn.lstm_engine())
        print(aiopar.parallel_info())
        """,
        env={**os.environ, "AIOPAR_LSTM_ENGINE": value},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "numpy"
    assert f"LSTM engine: {said}" in done.stdout


def test_parallel_info_says_nothing_of_nn_until_it_is_imported() -> None:
    done = run_python("import aiopar; print(aiopar.parallel_info())")
    assert done.returncode == 0, done.stderr
    assert "LSTM engine" not in done.stdout


def test_a_child_forked_while_a_lock_was_held_runs_an_lstm() -> None:
    # Another thread may be lending a workspace or choosing the engine when
    # os.fork() happens: the child must not inherit those locks held.
    done = run_python(
        """
        import os
        import numpy as np
        from aiopar.nn import LSTM, _engine, _recurrence, set_lstm_engine
        lstm = LSTM(4, 6, seed=0)
        with _recurrence._spare_lock, _engine._lock:
            pid = os.fork()
            if pid == 0:
                set_lstm_engine("numpy")
                lstm(np.ones((3, 2, 4), np.float32))
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
        """,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0"


@pytest.mark.skipif(not onednn_loads(), reason="onednn-cpu-gomp not installed")
def test_workspaces_serve_an_engine_loaded_anew() -> None:
    # Workspaces outlive the oneDNN instance they last served: one loaded
    # anew (here by load.cache_clear()) ran on the old one's stream and
    # memory, which oneDNN refused (dnnl_primitive_execute: status 2).
    x = np.random.default_rng(0).random((5, 2, 3)).astype(np.float32)
    model = BidirectionalRecurrentLSTM(3, 4, fork=True, seed=0)
    set_lstm_engine("onednn")
    expected = [model(x) for _ in range(3)]  # two workspaces of this shape, spare
    _onednn.load.cache_clear()
    _engine._preference, _engine._choice = None, None
    _engine._decided.clear()
    assert set_lstm_engine("onednn") == "onednn"
    for want in expected:
        np.testing.assert_allclose(model(x), want, atol=TOLERANCE)
