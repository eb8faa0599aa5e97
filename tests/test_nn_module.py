"""aiopar.nn.Module: parameters, children, state dicts, npz files."""

from __future__ import annotations

import numpy as np
import pytest

from aiopar.nn import LSTM, LSTMEnsemble, Module, ModuleList


class Affine(Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_parameter("weight", np.ones((2, 3)))
        self.register_parameter("bias", np.zeros(2))

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x @ self.weight.T + self.bias


class Stack(Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = Affine()
        self.layers = ModuleList([Affine(), Affine()])


def test_call_runs_forward() -> None:
    out = Affine()(np.ones((4, 3), np.float32))
    assert out.shape == (4, 2)
    assert np.all(out == 3)


def test_parameters_are_float32_and_read_only() -> None:
    m = Affine()
    assert m.weight.dtype == np.float32
    with pytest.raises(ValueError, match="read-only"):
        m.weight[0, 0] = 5


def test_named_parameters_and_state_dict_keys_nest_with_dots() -> None:
    m = Stack()
    assert list(m.state_dict()) == [
        "first.weight",
        "first.bias",
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ]
    assert [name for name, _ in m.named_parameters()] == list(m.state_dict())
    assert len(list(m.parameters())) == 6
    assert [name for name, _ in m.named_modules()] == [
        "",
        "first",
        "layers",
        "layers.0",
        "layers.1",
    ]


def test_assigning_a_parameter_checks_its_shape() -> None:
    m = Affine()
    m.weight = np.full((2, 3), 2.0)
    assert m.weight.dtype == np.float32 and np.all(m.weight == 2)
    with pytest.raises(ValueError, match=r"\(2, 3\)"):
        m.weight = np.zeros((3, 3))


def test_state_dict_round_trip_between_two_modules() -> None:
    a, b = LSTM(3, 4, num_layers=2, seed=1), LSTM(3, 4, num_layers=2, seed=2)
    x = np.random.default_rng(0).standard_normal((5, 2, 3)).astype(np.float32)
    assert not np.allclose(a(x)[0], b(x)[0])
    result = b.load_state_dict({k: v.copy() for k, v in a.state_dict().items()})
    assert result.missing_keys == [] and result.unexpected_keys == []
    np.testing.assert_array_equal(a(x)[0], b(x)[0])


def test_load_state_dict_casts_and_accepts_tensor_like_values() -> None:
    class FakeTensor:  # what load_state_dict needs from a torch tensor
        def __init__(self, array: np.ndarray) -> None:
            self.array = array

        def detach(self) -> FakeTensor:
            return self

        def cpu(self) -> FakeTensor:
            return self

        def numpy(self) -> np.ndarray:
            return self.array

    m = Affine()
    m.load_state_dict({"weight": FakeTensor(np.full((2, 3), 7.0)), "bias": [1, 2]})
    assert m.weight.dtype == np.float32
    assert np.all(m.weight == 7) and list(m.bias) == [1, 2]


def test_strict_load_lists_every_missing_unexpected_and_misshaped_key() -> None:
    m = Stack()
    state = {k: v.copy() for k, v in m.state_dict().items()}
    del state["first.bias"]
    del state["layers.1.weight"]
    state["layers.0.weight"] = np.zeros((5, 5))
    state["extra.thing"] = np.zeros(1)
    before = {k: v.copy() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError) as info:
        m.load_state_dict(state)
    message = str(info.value)
    assert "4 problems" in message
    assert "missing first.bias: expected shape (2,)" in message
    assert "missing layers.1.weight: expected shape (2, 3)" in message
    assert "layers.0.weight: expected shape (2, 3), got (5, 5)" in message
    assert "unexpected extra.thing" in message
    # Nothing was loaded.
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])


def test_non_strict_load_reports_missing_and_unexpected_but_not_bad_shapes() -> None:
    m = Affine()
    result = m.load_state_dict({"weight": np.full((2, 3), 3.0), "other": np.zeros(1)}, strict=False)
    assert result.missing_keys == ["bias"]
    assert result.unexpected_keys == ["other"]
    assert np.all(m.weight == 3)
    with pytest.raises(ValueError, match="weight: expected shape"):
        m.load_state_dict({"weight": np.zeros(6)}, strict=False)


def test_load_state_dict_refuses_non_numeric_values() -> None:
    with pytest.raises(ValueError, match="bias: expected a real numeric array"):
        Affine().load_state_dict({"weight": np.zeros((2, 3)), "bias": np.array(["a", "b"])})


def test_load_state_dict_updates_derived_lstm_weights() -> None:
    lstm = LSTM(3, 4, seed=0)
    x = np.ones((2, 1, 3), np.float32)
    before = lstm(x)[0]
    lstm.load_state_dict({k: np.zeros_like(v) for k, v in lstm.state_dict().items()})
    after = lstm(x)[0]
    assert not np.allclose(before, after)
    np.testing.assert_array_equal(after, 0)


def test_save_and_load_npz(tmp_path) -> None:
    a = LSTMEnsemble(2, 3, 4, seed=0, fork_models=False, fork_directions=False)
    b = LSTMEnsemble(2, 3, 4, seed=1, fork_models=False, fork_directions=False)
    path = tmp_path / "ens.npz"
    a.save(path)
    with np.load(path) as data:
        assert sorted(data.files) == sorted(a.state_dict())
    assert b.load(path) is b
    x = np.random.default_rng(0).random((4, 2, 3), dtype=np.float32)
    np.testing.assert_array_equal(a(x), b(x))


def test_load_npz_with_wrong_architecture_names_the_problem(tmp_path) -> None:
    path = tmp_path / "lstm.npz"
    LSTM(3, 4).save(path)
    with pytest.raises(ValueError, match=r"weight_ih_l0: expected shape \(20, 3\), got \(16, 3\)"):
        LSTM(3, 5).load(path)


def test_module_list() -> None:
    items = ModuleList([Affine()])
    items.append(Affine())
    assert len(items) == 2 and isinstance(items[1], Affine)
    assert [type(m) for m in items] == [Affine, Affine]
    with pytest.raises(TypeError, match="Module instances"):
        items.append(object())  # type: ignore[arg-type]


def test_repr_shows_the_tree() -> None:
    text = repr(LSTMEnsemble(1, 3, 4, fork_models=False))
    assert "(models): ModuleList(" in text
    assert "(cell_f): LSTM(3, 4)" in text


def test_subclass_must_call_super_init() -> None:
    class Broken(Module):
        def __init__(self) -> None:
            self.x = 1

    with pytest.raises(AttributeError, match="super"):
        Broken()


def test_forward_must_be_defined() -> None:
    with pytest.raises(NotImplementedError, match="Module does not define forward"):
        Module()()


def _load_error(module: Module, path) -> str:
    before = {k: v.copy() for k, v in module.state_dict().items()}
    with pytest.raises(ValueError) as info:
        module.load(path)
    for k, v in module.state_dict().items():  # nothing was loaded
        np.testing.assert_array_equal(v, before[k])
    message = str(info.value)
    assert "allow_pickle" not in message  # numpy's advice to unpickle is not passed on
    assert "Module.load reads an .npz archive written by Module.save" in message
    assert len(message.splitlines()) == 4
    return message


def test_load_a_pytorch_file_says_so_and_shows_how(tmp_path) -> None:
    import zipfile

    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as archive:  # the layout torch.save writes
        for name in ("model/data.pkl", "model/byteorder", "model/data/0", "model/version"):
            archive.writestr(name, b"")
    message = _load_error(Affine(), path)
    assert message.startswith(f"cannot load {str(path)!r} into Affine: it is a PyTorch file")
    assert f"state_dict = torch.load({str(path)!r}, map_location='cpu')" in message
    assert "module.load_state_dict(state_dict)" in message
    assert "data/0" not in message  # no listing of the archive's keys


def test_the_two_lines_for_a_real_pytorch_file_work(tmp_path) -> None:
    torch = pytest.importorskip("torch")
    source = LSTMEnsemble(2, 3, 4, seed=0)
    path = tmp_path / "model.pt"
    torch.save({k: torch.from_numpy(v.copy()) for k, v in source.state_dict().items()}, path)
    module = LSTMEnsemble(2, 3, 4, seed=1)
    message = _load_error(module, path)
    exec("\n".join(line.strip() for line in message.splitlines()[2:]))  # the two lines
    for key, value in source.state_dict().items():
        np.testing.assert_array_equal(module.state_dict()[key], value)


@pytest.mark.parametrize(
    ("content", "what"),
    [
        (b"junk, not an array", "it is not a numpy file"),
        (b"", "it is not a numpy file"),
        (b"\x80\x02}q\x00.", "it is pickled data"),
        (b"PK\x03\x04 truncated", "it is a damaged zip archive"),
    ],
)
def test_load_a_file_of_another_kind_says_what_it_is(tmp_path, content, what) -> None:
    path = tmp_path / "junk.npz"
    path.write_bytes(content)
    assert what in _load_error(Affine(), path)


def test_load_npy_zip_and_object_arrays_say_what_they_are(tmp_path) -> None:
    import zipfile

    np.save(tmp_path / "one.npy", np.zeros(3))
    assert "a single .npy array" in _load_error(Affine(), tmp_path / "one.npy")
    with zipfile.ZipFile(tmp_path / "other.zip", "w") as archive:
        archive.writestr("readme.txt", "hello")
    assert "other files than .npy arrays" in _load_error(Affine(), tmp_path / "other.zip")
    np.savez(tmp_path / "objects.npz", weight=np.array([{}], dtype=object))
    assert "object arrays" in _load_error(Affine(), tmp_path / "objects.npz")


def test_load_a_missing_file() -> None:
    with pytest.raises(FileNotFoundError):
        Affine().load("no-such-file.npz")
