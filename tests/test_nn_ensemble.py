"""The tutorial's BidirectionalRecurrentLSTM and LSTMEnsemble, forked and not, sync and async."""

from __future__ import annotations

import gc
import pickle

import anyio
import numpy as np
import pytest
from helpers import run_python

import aiopar
from aiopar.nn import LSTM, BidirectionalRecurrentLSTM, LSTMEnsemble
from aiopar.nn.ensemble import _wait_every

T, B, C = 6, 3, 5
FORK_VARIANTS = [(False, False), (False, True), (True, False), (True, True)]


def uniform01(*shape: int, seed: int = 0) -> np.ndarray:
    """Float32 samples of U[0, 1), reproducible by seed."""
    return np.random.default_rng(seed).random(shape, dtype=np.float32)


def test_state_dict_keys_are_the_tutorials() -> None:
    keys = list(LSTMEnsemble(2, C, C).state_dict())
    expected = [
        f"models.{m}.cell_{d}.{kind}_{mat}_l0"
        for m in range(2)
        for d in "fb"
        for kind in ("weight", "bias")
        for mat in ("ih", "hh")
    ]
    assert sorted(keys) == sorted(expected)
    assert keys[:4] == [
        "models.0.cell_f.weight_ih_l0",
        "models.0.cell_f.weight_hh_l0",
        "models.0.cell_f.bias_ih_l0",
        "models.0.cell_f.bias_hh_l0",
    ]


def test_models_get_different_weights_and_seeds_repeat() -> None:
    ens = LSTMEnsemble(2, C, C, seed=3)
    a, b = ens.models[0], ens.models[1]
    assert not np.array_equal(a.cell_f.weight_hh_l0, b.cell_f.weight_hh_l0)
    assert not np.array_equal(a.cell_f.weight_hh_l0, a.cell_b.weight_hh_l0)
    again = LSTMEnsemble(2, C, C, seed=3)
    for (k, v), (k2, v2) in zip(ens.state_dict().items(), again.state_dict().items(), strict=True):
        assert k == k2
        np.testing.assert_array_equal(v, v2)


@pytest.mark.parametrize("fork", [False, True])
def test_bidirectional_is_cat_of_forward_and_flipped_backward(fork) -> None:
    model = BidirectionalRecurrentLSTM(C, 4, fork=fork, seed=0)
    x = uniform01(T, B, C)
    out_f, _ = model.cell_f(x)
    out_b, _ = model.cell_b(np.flip(x, 0))
    expected = np.concatenate([out_f, np.flip(out_b, 0)], axis=2)
    out = model(x)
    assert out.shape == (T, B, 8)
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_bidirectional_accepts_unbatched_input() -> None:
    model = BidirectionalRecurrentLSTM(C, 4, fork=False, seed=0)
    x = uniform01(T, C)
    np.testing.assert_array_equal(model(x), model(x[:, None])[:, 0])


def test_bidirectional_checks_its_input() -> None:
    with pytest.raises(ValueError, match="last dimension is 2"):
        BidirectionalRecurrentLSTM(C, 4)(uniform01(T, B, 2))
    with pytest.raises(TypeError, match="floating-point"):
        BidirectionalRecurrentLSTM(C, 4)(np.ones((T, B, C), np.int64))


def test_ensemble_is_the_sum_of_its_models() -> None:
    ens = LSTMEnsemble(3, C, 4, seed=1, fork_models=False, fork_directions=False)
    x = uniform01(T, B, C)
    expected = np.stack([m(x) for m in ens.models]).sum(0)
    np.testing.assert_allclose(ens(x), expected, atol=1e-6)


@pytest.mark.parametrize(("fork_models", "fork_directions"), FORK_VARIANTS)
@pytest.mark.parametrize("backend", ["inline", "thread"])
def test_forked_variants_give_identical_results(fork_models, fork_directions, backend) -> None:
    ens = LSTMEnsemble(3, C, 12, seed=2, fork_models=False, fork_directions=False)
    x = uniform01(T, 11, C)
    expected = ens(x)
    ens.fork_models, ens.fork_directions = fork_models, fork_directions
    with aiopar.use_backend(backend):
        np.testing.assert_array_equal(ens(x), expected)


def test_fork_directions_property_sets_every_model() -> None:
    ens = LSTMEnsemble(2, C, 4, fork_directions=False)
    assert ens.fork_directions is False
    ens.fork_directions = True
    assert all(m.fork for m in ens.models)


def test_forked_ensemble_runs_on_the_process_backend() -> None:
    ens = LSTMEnsemble(2, C, 4, seed=4, fork_models=False, fork_directions=False)
    x = uniform01(T, B, C)
    expected = ens(x)
    ens.fork_models = ens.fork_directions = True
    with aiopar.use_backend("process"):
        np.testing.assert_allclose(ens(x), expected, atol=1e-6)


def test_modules_pickle_without_their_caches() -> None:
    ens = LSTMEnsemble(2, C, 4, seed=5)
    x = uniform01(T, B, C)
    y = ens(x)  # builds the packed-weight caches
    copy = pickle.loads(pickle.dumps(ens))
    assert copy.models[0].cell_f._packed is None
    assert not copy.models[0].cell_f.weight_ih_l0.flags.writeable
    np.testing.assert_array_equal(copy(x), y)


def test_forked_errors_reach_the_caller() -> None:
    ens = LSTMEnsemble(2, C, 4, fork_models=True)
    with pytest.raises(ValueError, match="input_size=5"):
        ens(uniform01(T, B, C + 1))


@pytest.mark.parametrize("fork_models", [True, False])
def test_a_wrong_input_leaves_stderr_clean(fork_models) -> None:
    # Once the ValueError, and no "nobody retrieved its exception" for the siblings.
    done = run_python(
        f"""
        import gc
        import numpy as np
        from aiopar.nn import LSTMEnsemble
        ens = LSTMEnsemble(4, 8, 16, fork_models={fork_models})
        try:
            ens(np.zeros((5, 2, 9), np.float32))
        except ValueError as error:
            print(error)
        gc.collect()
        """
    )
    assert done.returncode == 0, done.stderr
    assert "input_size=8" in done.stdout
    assert done.stderr == ""


def test_wait_every_waits_for_all_and_retrieves_every_failure(caplog) -> None:
    def fail(n: int) -> int:
        raise ValueError(f"failure {n}")

    futures = [aiopar.fork(fail, 0), aiopar.fork(lambda: 1), aiopar.fork(fail, 2)]
    with pytest.raises(ValueError, match="failure 0"):
        _wait_every(futures)
    assert all(future.done() for future in futures)
    del futures
    gc.collect()
    assert "nobody retrieved" not in caplog.text


@pytest.mark.anyio
async def test_await_fork_of_the_ensemble(anyio_backend) -> None:
    ens = LSTMEnsemble(2, C, 8, seed=6, fork_models=False, fork_directions=False)
    inputs = [uniform01(T, B, C, seed=s) for s in range(4)]
    expected = [ens(x) for x in inputs]
    ens.fork_models = ens.fork_directions = True
    results: dict[int, np.ndarray] = {}

    async def serve(i: int) -> None:
        results[i] = await aiopar.fork(ens, inputs[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(inputs)):
            tg.start_soon(serve, i)
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(results[i], want)


@pytest.mark.anyio
async def test_await_fork_raises_input_errors(anyio_backend) -> None:
    ens = LSTMEnsemble(1, C, 4)
    with pytest.raises(TypeError, match="floating-point"):
        await aiopar.fork(ens, np.ones((T, B, C), np.int32))


@pytest.mark.parametrize("workers", [1, 2, 3, 5, 8])
def test_streams_for_any_worker_count_give_the_sequential_sum(workers) -> None:
    # The default variant runs one stream per worker; streams that share a
    # half of the output add theirs at the end.
    ens = LSTMEnsemble(4, C, 6, seed=7, fork_models=False, fork_directions=False)
    x = uniform01(T, 9, C)
    expected = ens(x)
    ens.fork_models = ens.fork_directions = True
    with aiopar.use_backend(aiopar.get_backend("thread", max_workers=workers)):
        got = ens(x)
    if workers <= 2:  # one stream per half: added in model order, bit for bit
        np.testing.assert_array_equal(got, expected)
    else:
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_a_stream_that_fails_leaves_the_other_finished_and_raises(monkeypatch, caplog) -> None:
    ens = LSTMEnsemble(2, C, 4, seed=8)
    ran: list[str] = []
    real_run = LSTM._run

    def run(self, x, out, state=None, *, reverse=False, accumulate=False):
        if self is ens.models[1].cell_f:
            raise RuntimeError("cell_f of model 1 failed")
        ran.append("b" if reverse else "f")
        return real_run(self, x, out, state, reverse=reverse, accumulate=accumulate)

    monkeypatch.setattr(LSTM, "_run", run)
    with pytest.raises(RuntimeError, match="cell_f of model 1 failed"):
        ens(uniform01(T, B, C))
    assert sorted(ran) == ["b", "b", "f"]  # the backward stream ran to its end
    gc.collect()
    assert "nobody retrieved" not in caplog.text


def test_inline_and_openmp_backends_run_the_streams() -> None:
    ens = LSTMEnsemble(3, C, 5, seed=9, fork_models=False, fork_directions=False)
    x = uniform01(T, B, C)
    expected = ens(x)
    ens.fork_models = ens.fork_directions = True
    for backend in ("inline", "openmp"):
        with aiopar.use_backend(backend):
            np.testing.assert_allclose(ens(x), expected, rtol=1e-6, atol=1e-6)
