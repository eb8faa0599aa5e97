"""`Module`: parameters, children, state dicts and `.npz` files.

The model is `torch.nn.Module` cut down to inference: a module owns named
float32 parameters and named child modules; `state_dict()` flattens both into
dotted keys, so weights move between aiopar and PyTorch by name.

Parameters are stored read-only. Modules such as `LSTM` keep derived copies of
their weights (transposed, gate-reordered) for speed, and a read-only array
guarantees those copies never go stale: weights change only by assignment or
`load_state_dict`, both of which the module sees.
"""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["IncompatibleKeys", "Module", "ModuleList"]


class IncompatibleKeys(NamedTuple):
    """Keys that `load_state_dict(..., strict=False)` skipped."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _to_float32(value: Any) -> np.ndarray:
    """Return `value` as a float32 ndarray; torch tensors are accepted by duck typing."""
    if hasattr(value, "detach") and hasattr(value, "cpu") and hasattr(value, "numpy"):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"expected a real numeric array, got dtype {array.dtype}")
    return np.array(array, dtype=np.float32, order="C", copy=True)


def _read_npz(path: str | os.PathLike[str], into: str) -> dict[str, np.ndarray]:
    """The arrays of the ``.npz`` archive at `path`, or a `ValueError` naming what it is instead."""
    with open(path, "rb") as f:
        head = f.read(6)
    what = None
    from_torch = False  # a file torch.save may have written
    if head.startswith(b"PK"):
        try:
            with zipfile.ZipFile(path) as archive:
                names = archive.namelist()
        except zipfile.BadZipFile:
            names = None
        if names is None:
            what = "a damaged zip archive"
        elif any(name.rpartition("/")[2] == "data.pkl" for name in names):
            what, from_torch = "a PyTorch file (written by torch.save)", True
        elif not names or not all(name.endswith(".npy") for name in names):
            what = "a zip archive of other files than .npy arrays"
    elif head.startswith(b"\x93NUMPY"):
        what = "a single .npy array (written by numpy.save), not named parameters"
    elif head.startswith(b"\x80"):
        what, from_torch = "pickled data (torch.save's legacy format, or pickle.dump)", True
    else:
        what = "not a numpy file"
    if what is None:
        try:
            with np.load(path, allow_pickle=False) as data:
                return {key: data[key] for key in data.files}
        except ValueError as exc:
            if "allow_pickle" not in str(exc):
                raise
            # numpy would advise allow_pickle=True: unpickling an untrusted file runs its code
            what = "an .npz archive holding object arrays, which only unpickling could read"
    example = os.fspath(path) if from_torch else "model.pt"
    raise ValueError(
        f"cannot load {os.fspath(path)!r} into {into}: it is {what}.\n"
        f"Module.load reads an .npz archive written by Module.save (or numpy.savez). "
        f"Weights saved by PyTorch load through torch:\n"
        f"    state_dict = torch.load({example!r}, map_location='cpu')\n"
        f"    module.load_state_dict(state_dict)"
    )


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


class Module:
    """Base class for numpy inference modules.

    Calling a module calls `forward`. Assigning an `ndarray` to a name that was
    registered with `register_parameter` replaces that parameter (same shape
    required); assigning a `Module` registers it as a child whose parameters
    appear under ``"<name>."`` in `state_dict()`.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})

    # -- attributes ---------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        if "_modules" not in self.__dict__:
            raise AttributeError(
                f"{type(self).__name__}.__init__ must call super().__init__() before "
                f"assigning attributes (assigning {name!r})"
            )
        if isinstance(value, Module):
            self._parameters.pop(name, None)
            self._modules[name] = value
            self.__dict__.pop(name, None)
        elif name in self._parameters:
            self._set_parameters({name: value})
        else:
            self._modules.pop(name, None)
            object.__setattr__(self, name, value)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: parameters and children live in dicts.
        d = self.__dict__
        if name in d.get("_parameters", {}):
            return d["_parameters"][name]
        if name in d.get("_modules", {}):
            return d["_modules"][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name: str) -> None:
        if name in self._parameters:
            del self._parameters[name]
            self._parameters_changed()
        elif name in self._modules:
            del self._modules[name]
        else:
            object.__delattr__(self, name)

    def register_parameter(self, name: str, value: Any) -> None:
        """Add a float32 parameter called `name` (stored as a read-only copy)."""
        if "." in name or not name:
            raise ValueError(f"parameter name must be non-empty and contain no '.': {name!r}")
        if name in self._modules or (name in self.__dict__ and name not in self._parameters):
            raise KeyError(f"attribute {name!r} already exists")
        self._parameters[name] = _readonly(_to_float32(value))
        self._parameters_changed()

    def _set_parameters(self, values: Mapping[str, Any]) -> None:
        """Replace existing parameters of this module (not children), checking shapes."""
        new = {}
        for name, value in values.items():
            array = _to_float32(value)
            expected = self._parameters[name].shape
            if array.shape != expected:
                raise ValueError(
                    f"parameter {name!r} of {type(self).__name__} has shape {expected}, "
                    f"got {array.shape}"
                )
            new[name] = _readonly(array)
        self._parameters.update(new)
        self._parameters_changed()

    def _parameters_changed(self) -> None:
        """Hook: called after this module's own parameters were replaced."""

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(self._transient_state())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        for array in self._parameters.values():
            array.flags.writeable = False

    def _transient_state(self) -> dict[str, Any]:
        """Attributes to reset when pickled (caches that can be rebuilt)."""
        return {}

    # -- calling ------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not define forward()")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    # -- traversal ----------------------------------------------------------

    def named_children(self) -> Iterator[tuple[str, Module]]:
        """Direct children, in registration order."""
        yield from self._modules.items()

    def children(self) -> Iterator[Module]:
        for _, child in self.named_children():
            yield child

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, Module]]:
        """This module (name `prefix`) and every descendant, depth first."""
        yield prefix, self
        for name, child in self._modules.items():
            yield from child.named_modules(f"{prefix}.{name}" if prefix else name)

    def named_parameters(
        self, prefix: str = "", recurse: bool = True
    ) -> Iterator[tuple[str, np.ndarray]]:
        """``(dotted_name, array)`` pairs: own parameters first, then each child's.

        The arrays are the live, read-only parameters, not copies.
        """
        modules = self.named_modules(prefix) if recurse else iter([(prefix, self)])
        for module_prefix, module in modules:
            for name, array in module._parameters.items():
                yield (f"{module_prefix}.{name}" if module_prefix else name), array

    def parameters(self, recurse: bool = True) -> Iterator[np.ndarray]:
        for _, array in self.named_parameters(recurse=recurse):
            yield array

    # -- state dicts --------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        """A flat ``{dotted_key: float32 array}`` dict with the keys PyTorch would use.

        Arrays are the live read-only parameters (no copy is made); copy one
        before changing it, then load it back with `load_state_dict`.
        """
        return dict(self.named_parameters())

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True
    ) -> IncompatibleKeys:
        """Replace parameters from `state_dict` (ndarrays, or torch tensors on any device).

        Values are converted to float32. Nothing is changed unless the whole
        load succeeds. A key whose shape differs always fails; with
        ``strict=True`` a missing or unexpected key fails too, otherwise those
        are returned. The `ValueError` lists every problem at once.
        """
        own = dict(self.named_parameters())
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        problems: list[str] = []
        converted: dict[str, np.ndarray] = {}
        for key, expected in own.items():
            if key not in state_dict:
                continue
            try:
                array = _to_float32(state_dict[key])
            except TypeError as exc:
                problems.append(f"  {key}: {exc}")
                continue
            if array.shape != expected.shape:
                problems.append(
                    f"  {key}: expected shape {tuple(expected.shape)}, got {tuple(array.shape)}"
                )
                continue
            converted[key] = array
        if strict:
            problems += [
                f"  missing {key}: expected shape {tuple(own[key].shape)}" for key in missing
            ]
            problems += [f"  unexpected {key}" for key in unexpected]
        if problems:
            raise ValueError(
                f"cannot load state dict into {type(self).__name__} "
                f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n"
                + "\n".join(problems)
            )
        by_module: dict[str, dict[str, np.ndarray]] = {}
        for key, array in converted.items():
            module_path, _, name = key.rpartition(".")
            by_module.setdefault(module_path, {})[name] = array
        modules = dict(self.named_modules())
        for module_path, values in by_module.items():
            modules[module_path]._set_parameters(values)
        return IncompatibleKeys(missing, unexpected)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write `state_dict()` to an uncompressed ``.npz`` file at `path`."""
        with open(path, "wb") as f:
            # numpy's stubs take every keyword for allow_pickle; these are arrays
            np.savez(f, **self.state_dict())  # type: ignore[arg-type]

    def load(self, path: str | os.PathLike[str], strict: bool = True) -> Module:
        """Load parameters from an ``.npz`` file written by `save` (or `np.savez`); returns self.

        Any other file (a PyTorch checkpoint, a ``.npy`` array, pickled data)
        raises a `ValueError` that says what the file is and how to load
        weights from it, and changes nothing. Unpickling is never attempted.
        """
        self.load_state_dict(_read_npz(path, type(self).__name__), strict=strict)
        return self

    # -- display ------------------------------------------------------------

    def extra_repr(self) -> str:
        return ""

    def __repr__(self) -> str:
        head = f"{type(self).__name__}({self.extra_repr()}"
        if not self._modules:
            return head + ")"
        lines = [head]
        for name, child in self._modules.items():
            child_repr = repr(child).replace("\n", "\n  ")
            lines.append(f"  ({name}): {child_repr}")
        return "\n".join(lines) + "\n)"


class ModuleList(Module):
    """A list of child modules, named ``"0"``, ``"1"``, ... in the state dict."""

    def __init__(self, modules: Iterable[Module] = ()) -> None:
        super().__init__()
        for module in modules:
            self.append(module)

    def append(self, module: Module) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"ModuleList holds Module instances, got {type(module).__name__}")
        self._modules[str(len(self._modules))] = module

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self) -> Iterator[Module]:
        return iter(self._modules.values())

    def __getitem__(self, index: int) -> Module:
        module: Module = list(self._modules.values())[index]
        return module
