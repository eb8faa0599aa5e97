"""The LSTM's GEMMs through oneDNN's matmul primitive, called with ctypes.

OpenBLAS packs the 16 MB recurrent weight again on every step; oneDNN's
matmul takes it once, reordered into the layout it picks for this CPU
(``format_tag_any``), and folds the step's input projection in with a sum
post-op. Its packed (brgemm) kernels ran that step at 98-99 GFLOP per
CPU-second on an AVX-512 CPU, against 55-68 for OpenBLAS. The input
projection of a whole direction (``x @ W_ih^T``, T*B rows) runs through the
same kind of primitive, its weights reordered once too and the bias added
by the primitive.

The library comes from the ``onednn-cpu-gomp`` wheel (``pip install
aiopar[onednn]``): its ``libdnnl.so.3`` is found through
``importlib.metadata`` and loaded with `ctypes.CDLL`, no compiler involved.
Everything version-dependent is resolved at load time: the format tags by
name (``dnnl_fmt_tag2str``); the other enums used are fixed by the C API of
oneDNN 3 (``DNNL_ARG_*``, ``dnnl_query_exec_arg_md``), which `load` checks.

Primitives are made for one OpenMP thread, under a one-thread OpenMP limit in
the thread that makes them: they run in streams of one thread each. The
scratchpad is the caller's (``dnnl_scratchpad_mode_user``), one per
workspace and primitive, so a primitive runs on whichever thread picks up
its stream.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._recurrence import PackedWeights, Step, Workspace

__all__ = ["DISTRIBUTION", "OneDNN", "OneDNNError", "load"]

#: the wheel that provides the library
DISTRIBUTION = "onednn-cpu-gomp"

# C API constants of oneDNN 3 (dnnl_types.h, dnnl_common_types.h).
_SUCCESS = 0
_F32 = 3  # dnnl_f32
_CPU = 1  # dnnl_cpu
_IN_ORDER = 1  # dnnl_stream_in_order
_SCRATCHPAD_USER = 1  # dnnl_scratchpad_mode_user
_QUERY_IMPL_INFO_STR = 8  # dnnl_query_impl_info_str
_QUERY_EXEC_ARG_MD = 255  # dnnl_query_exec_arg_md
_ARG_SRC, _ARG_DST, _ARG_WEIGHTS, _ARG_BIAS, _ARG_SCRATCHPAD = 1, 17, 33, 41, 80

#: primitives kept per engine, by shape: the step's and each sequence length's projection
_MATMULS = 32

_Handle = ctypes.c_void_p
_Dims = ctypes.c_int64 * 12


class OneDNNError(RuntimeError):
    """oneDNN could not be loaded, or one of its calls failed."""


class _Version(ctypes.Structure):
    _fields_ = (
        ("major", ctypes.c_int),
        ("minor", ctypes.c_int),
        ("patch", ctypes.c_int),
        ("hash", ctypes.c_char_p),
        ("cpu_runtime", ctypes.c_uint),
        ("gpu_runtime", ctypes.c_uint),
    )


class _ExecArg(ctypes.Structure):
    _fields_ = (("arg", ctypes.c_int), ("memory", _Handle))


def library_path() -> str:
    """Where the installed ``onednn-cpu-gomp`` wheel put ``libdnnl.so.3``."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise OneDNNError(f"{DISTRIBUTION} is not installed (pip install aiopar[onednn])") from None
    for file in dist.files or ():
        if file.name == "libdnnl.so.3":
            return str(dist.locate_file(file))
    raise OneDNNError(f"{DISTRIBUTION} is installed but holds no libdnnl.so.3")


_SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "dnnl_version": (ctypes.POINTER(_Version), []),
    "dnnl_fmt_tag2str": (ctypes.c_char_p, [ctypes.c_int]),
    "dnnl_engine_create": (ctypes.c_int, [ctypes.POINTER(_Handle), ctypes.c_int, ctypes.c_size_t]),
    "dnnl_stream_create": (ctypes.c_int, [ctypes.POINTER(_Handle), _Handle, ctypes.c_uint]),
    "dnnl_stream_destroy": (ctypes.c_int, [_Handle]),
    "dnnl_memory_desc_create_with_tag": (
        ctypes.c_int,
        [ctypes.POINTER(_Handle), ctypes.c_int, _Dims, ctypes.c_int, ctypes.c_int],
    ),
    "dnnl_memory_desc_clone": (ctypes.c_int, [ctypes.POINTER(_Handle), _Handle]),
    "dnnl_memory_desc_destroy": (ctypes.c_int, [_Handle]),
    "dnnl_memory_desc_get_size": (ctypes.c_size_t, [_Handle]),
    "dnnl_memory_desc_equal": (ctypes.c_int, [_Handle, _Handle]),
    "dnnl_memory_create": (ctypes.c_int, [ctypes.POINTER(_Handle), _Handle, _Handle, _Handle]),
    "dnnl_memory_destroy": (ctypes.c_int, [_Handle]),
    "dnnl_memory_set_data_handle": (ctypes.c_int, [_Handle, _Handle]),
    "dnnl_primitive_attr_create": (ctypes.c_int, [ctypes.POINTER(_Handle)]),
    "dnnl_primitive_attr_destroy": (ctypes.c_int, [_Handle]),
    "dnnl_primitive_attr_set_scratchpad_mode": (ctypes.c_int, [_Handle, ctypes.c_int]),
    "dnnl_primitive_attr_set_post_ops": (ctypes.c_int, [_Handle, _Handle]),
    "dnnl_post_ops_create": (ctypes.c_int, [ctypes.POINTER(_Handle)]),
    "dnnl_post_ops_destroy": (ctypes.c_int, [_Handle]),
    "dnnl_post_ops_append_sum": (
        ctypes.c_int,
        [_Handle, ctypes.c_float, ctypes.c_int32, ctypes.c_int],
    ),
    "dnnl_matmul_primitive_desc_create": (
        ctypes.c_int,
        [ctypes.POINTER(_Handle), _Handle, _Handle, _Handle, _Handle, _Handle, _Handle],
    ),
    "dnnl_reorder_primitive_desc_create": (
        ctypes.c_int,
        [ctypes.POINTER(_Handle), _Handle, _Handle, _Handle, _Handle, _Handle],
    ),
    "dnnl_primitive_desc_query": (ctypes.c_int, [_Handle, ctypes.c_int, ctypes.c_int, _Handle]),
    "dnnl_primitive_desc_query_md": (_Handle, [_Handle, ctypes.c_int, ctypes.c_int]),
    "dnnl_primitive_desc_destroy": (ctypes.c_int, [_Handle]),
    "dnnl_primitive_create": (ctypes.c_int, [ctypes.POINTER(_Handle), _Handle]),
    "dnnl_primitive_destroy": (ctypes.c_int, [_Handle]),
    "dnnl_primitive_execute": (
        ctypes.c_int,
        [_Handle, _Handle, ctypes.c_int, ctypes.POINTER(_ExecArg)],
    ),
}


def _aligned_floats(size: int) -> np.ndarray:
    """At least `size` bytes of float32 starting on a 64-byte boundary, as
    oneDNN's kernels load them (numpy aligns large arrays to 16 bytes)."""
    floats = -(-size // 4)
    raw = np.empty(floats + 16, np.float32)
    start = (-raw.ctypes.data % 64) // 4
    return raw[start : start + floats]


class _Owned:
    """A oneDNN object destroyed with its last Python reference."""

    __slots__ = ("__weakref__", "handle")

    def __init__(self, handle: _Handle, destroy: Any) -> None:
        self.handle = handle
        weakref.finalize(self, destroy, handle)


@dataclass(frozen=True, slots=True, eq=False)
class _Matmul:
    """A primitive for one shape, all dense row-major but W: ``dst = src @ W``
    (``+=`` with `accumulate`, ``+ bias`` with a bias), `src` ``(m, k)``."""

    primitive: _Owned
    src_md: _Owned
    dst_md: _Owned
    bias_md: _Owned | None
    weights_md: _Owned  # the layout oneDNN picked for W
    scratchpad_md: _Owned
    scratchpad_bytes: int
    implementation: str


@dataclass(frozen=True, slots=True)
class _Weights:
    """One of a direction's weights, `source`, in a layout a `_Matmul` of
    `owner`'s picked (oneDNN memory belongs to the engine that made it)."""

    owner: OneDNN
    source: np.ndarray
    md: _Owned
    memory: _Owned
    buffer: np.ndarray


@dataclass(frozen=True, slots=True)
class _Buffers:
    """oneDNN memory for the source and destination of `matmul` in one
    workspace (pointed at the arrays of each use), and its scratchpad and
    stream, for `matmul` (and the engine that made it) only."""

    matmul: _Matmul
    stream: _Owned
    src: _Owned
    dst: _Owned
    scratchpad: _Owned
    scratchpad_buffer: np.ndarray


class OneDNN:
    """The loaded library: `project` and `step` are an engine for `run_direction`."""

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
        except OSError as error:
            raise OneDNNError(f"cannot load {path}: {error}") from None
        for name, (restype, argtypes) in _SIGNATURES.items():
            try:
                function = getattr(lib, name)
            except AttributeError:
                raise OneDNNError(f"{path} has no {name}: not oneDNN 3") from None
            function.restype, function.argtypes = restype, argtypes
        self.lib = lib
        version = lib.dnnl_version().contents
        self.version = f"{version.major}.{version.minor}.{version.patch}"
        if version.major != 3:
            raise OneDNNError(f"oneDNN {self.version} found; aiopar uses the C API of oneDNN 3")
        self.tags = self._format_tags("any", "ab")
        engine = _Handle()
        self._check(lib.dnnl_engine_create(ctypes.byref(engine), _CPU, 0), "dnnl_engine_create")
        self.engine = engine
        self._matmuls: dict[tuple[int, int, int, bool, bool], _Matmul] = {}
        self._lock = threading.Lock()

    def _format_tags(self, *names: str) -> dict[str, int]:
        """The values of format tags `names` in this build, found by name."""
        found: dict[str, int] = {}
        value = 0
        while len(found) < len(names) and value < 10_000:
            text = self.lib.dnnl_fmt_tag2str(value)
            if text is None:
                break
            name = text.decode()
            if name in names:
                found.setdefault(name, value)
            value += 1
        missing = set(names) - set(found)
        if missing:
            raise OneDNNError(f"oneDNN {self.version} names no format tag {sorted(missing)}")
        return found

    def _check(self, status: int, call: str) -> None:
        if status != _SUCCESS:
            raise OneDNNError(f"oneDNN {self.version}: {call} failed with status {status}")

    def _new(self, create: Any, *args: Any, destroy: str, call: str) -> _Owned:
        handle = _Handle()
        self._check(create(ctypes.byref(handle), *args), call)
        return _Owned(handle, getattr(self.lib, destroy))

    def _md(self, dims: tuple[int, ...], tag: str) -> _Owned:
        return self._new(
            self.lib.dnnl_memory_desc_create_with_tag,
            len(dims),
            _Dims(*dims),
            _F32,
            self.tags[tag],
            destroy="dnnl_memory_desc_destroy",
            call="memory_desc_create",
        )

    def _stream(self) -> _Owned:
        return self._new(
            self.lib.dnnl_stream_create,
            self.engine,
            _IN_ORDER,
            destroy="dnnl_stream_destroy",
            call="dnnl_stream_create",
        )

    def _primitive(self, descriptor: _Owned) -> _Owned:
        return self._new(
            self.lib.dnnl_primitive_create,
            descriptor.handle,
            destroy="dnnl_primitive_destroy",
            call="dnnl_primitive_create",
        )

    def _memory(self, md: _Owned | _Handle, buffer: np.ndarray) -> _Owned:
        handle = md.handle if isinstance(md, _Owned) else md
        return self._new(
            self.lib.dnnl_memory_create,
            handle,
            self.engine,
            buffer.ctypes.data,
            destroy="dnnl_memory_destroy",
            call="dnnl_memory_create",
        )

    def _execute(self, primitive: _Owned, stream: _Owned, args: list[tuple[int, _Owned]]) -> None:
        array = (_ExecArg * len(args))(*(_ExecArg(arg, mem.handle) for arg, mem in args))
        self._check(
            self.lib.dnnl_primitive_execute(primitive.handle, stream.handle, len(args), array),
            "dnnl_primitive_execute",
        )

    def matmul(
        self, m: int, k: int, n: int, *, accumulate: bool = False, bias: bool = False
    ) -> _Matmul:
        """The primitive for ``(m, k) @ (k, n)``, adding to its destination
        with `accumulate`, and a bias with `bias` (made once per shape; the
        last _MATMULS shapes are kept)."""
        key = (m, k, n, accumulate, bias)
        made = self._matmuls.get(key)
        if made is None:
            with self._lock:
                made = self._matmuls.get(key)
                if made is None:
                    made = self._make_matmul(m, k, n, accumulate=accumulate, bias=bias)
                    if len(self._matmuls) >= _MATMULS:  # the oldest goes: runs hold their own
                        del self._matmuls[next(iter(self._matmuls))]
                    self._matmuls[key] = made
        return made

    def _make_matmul(self, m: int, k: int, n: int, *, accumulate: bool, bias: bool) -> _Matmul:
        from threadpoolctl import threadpool_limits

        lib = self.lib
        src = self._md((m, k), "ab")
        weights = self._md((k, n), "any")
        # Dense, as the gates are: with a row stride of its own, oneDNN 3.2
        # passes over its packed (brgemm) kernels for the generic gemm:jit.
        dst = self._md((m, n), "ab")
        bias_md = self._md((1, n), "ab") if bias else None
        attr = self._new(
            lib.dnnl_primitive_attr_create, destroy="dnnl_primitive_attr_destroy", call="attr"
        )
        if accumulate:
            post_ops = self._new(
                lib.dnnl_post_ops_create, destroy="dnnl_post_ops_destroy", call="po"
            )
            self._check(
                lib.dnnl_post_ops_append_sum(post_ops.handle, 1.0, 0, 0),
                "dnnl_post_ops_append_sum",
            )
            self._check(
                lib.dnnl_primitive_attr_set_post_ops(attr.handle, post_ops.handle), "post_ops"
            )
        self._check(
            lib.dnnl_primitive_attr_set_scratchpad_mode(attr.handle, _SCRATCHPAD_USER),
            "dnnl_primitive_attr_set_scratchpad_mode",
        )
        # The thread count of a primitive is fixed when it is made: one.
        with threadpool_limits(limits=1, user_api="openmp"):
            descriptor = self._new(
                lib.dnnl_matmul_primitive_desc_create,
                self.engine,
                src.handle,
                weights.handle,
                None if bias_md is None else bias_md.handle,
                dst.handle,
                attr.handle,
                destroy="dnnl_primitive_desc_destroy",
                call="dnnl_matmul_primitive_desc_create",
            )
            primitive = self._primitive(descriptor)
        info = ctypes.c_char_p()
        self._check(
            lib.dnnl_primitive_desc_query(
                descriptor.handle, _QUERY_IMPL_INFO_STR, 0, ctypes.addressof(info)
            ),
            "dnnl_primitive_desc_query",
        )
        picked = self._new(
            lib.dnnl_memory_desc_clone,
            lib.dnnl_primitive_desc_query_md(descriptor.handle, _QUERY_EXEC_ARG_MD, _ARG_WEIGHTS),
            destroy="dnnl_memory_desc_destroy",
            call="dnnl_memory_desc_clone",
        )
        scratchpad = self._new(
            lib.dnnl_memory_desc_clone,
            lib.dnnl_primitive_desc_query_md(
                descriptor.handle, _QUERY_EXEC_ARG_MD, _ARG_SCRATCHPAD
            ),
            destroy="dnnl_memory_desc_destroy",
            call="dnnl_memory_desc_clone",
        )
        return _Matmul(
            primitive,
            src,
            dst,
            bias_md,
            picked,
            scratchpad,
            int(lib.dnnl_memory_desc_get_size(scratchpad.handle)),
            (info.value or b"?").decode(),
        )

    def _weights(self, packed: PackedWeights, source: np.ndarray, matmul: _Matmul) -> _Weights:
        """`source`, one of `packed`'s weights, in `matmul`'s layout, reordered
        once per weight and layout."""
        cached: list[_Weights] = packed.engine_data if isinstance(packed.engine_data, list) else []
        for entry in cached:
            if (
                entry.owner is self
                and entry.source is source
                and self.lib.dnnl_memory_desc_equal(entry.md.handle, matmul.weights_md.handle)
            ):
                return entry
        lib = self.lib
        plain_md = self._md(source.shape, "ab")
        size = int(lib.dnnl_memory_desc_get_size(matmul.weights_md.handle))
        buffer = _aligned_floats(size)
        reorder_pd = self._new(
            lib.dnnl_reorder_primitive_desc_create,
            plain_md.handle,
            self.engine,
            matmul.weights_md.handle,
            self.engine,
            None,
            destroy="dnnl_primitive_desc_destroy",
            call="dnnl_reorder_primitive_desc_create",
        )
        reorder = self._primitive(reorder_pd)
        plain = np.ascontiguousarray(source)
        memory = self._memory(matmul.weights_md, buffer)
        self._execute(
            reorder, self._stream(), [(_ARG_SRC, self._memory(plain_md, plain)), (_ARG_DST, memory)]
        )
        entry = _Weights(self, source, matmul.weights_md, memory, buffer)
        packed.engine_data = [*cached, entry]
        return entry

    def _buffers(
        self, ws: Workspace, matmul: _Matmul, src: np.ndarray, dst: np.ndarray
    ) -> _Buffers:
        """`matmul`'s memory in `ws`, pointed at `src` and `dst` (dense arrays
        of its shapes). Made once per workspace and primitive: workspaces
        outlive the engine they last served, which is loaded anew after a
        failure or a ``load.cache_clear()``, and a stream of another engine
        is refused."""
        made_in_ws = ws.engine_data if isinstance(ws.engine_data, dict) else {}
        made = made_in_ws.get(matmul)
        if made is None:
            scratchpad = _aligned_floats(matmul.scratchpad_bytes)
            made = _Buffers(
                matmul,
                self._stream(),
                self._memory(matmul.src_md, src),
                self._memory(matmul.dst_md, dst),
                self._memory(matmul.scratchpad_md, scratchpad),
                scratchpad,
            )
            if len(made_in_ws) >= _MATMULS:
                made_in_ws = {}
            made_in_ws[matmul] = made
            ws.engine_data = made_in_ws
        else:
            for memory, array in ((made.src, src), (made.dst, dst)):
                self._check(
                    self.lib.dnnl_memory_set_data_handle(memory.handle, array.ctypes.data),
                    "dnnl_memory_set_data_handle",
                )
        return made

    def project(self, packed: PackedWeights, ws: Workspace, x: np.ndarray, out: np.ndarray) -> None:
        """Set `out` to ``x @ W_ih^T`` plus the bias, in one primitive call
        (`x` is copied first if it is not dense and row-major)."""
        rows, features = x.shape
        bias = packed.bias
        matmul = self.matmul(rows, features, out.shape[1], bias=bias is not None)
        weights = self._weights(packed, packed.w_ih_t, matmul)
        src = np.ascontiguousarray(x)
        buffers = self._buffers(ws, matmul, src, out)
        args = [
            (_ARG_SRC, buffers.src),
            (_ARG_WEIGHTS, weights.memory),
            (_ARG_DST, buffers.dst),
            (_ARG_SCRATCHPAD, buffers.scratchpad),
        ]
        if bias is not None and matmul.bias_md is not None:
            args.append((_ARG_BIAS, self._memory(matmul.bias_md, bias)))
        self._execute(matmul.primitive, buffers.stream, args)

    def step(self, packed: PackedWeights, ws: Workspace) -> Step:
        """The recurrent step of `packed` in `ws`: copy the projection into
        the gates, then add ``h @ W_hh^T`` to them in one primitive call."""
        rows, hidden = ws.h.shape
        matmul = self.matmul(rows, hidden, 4 * hidden, accumulate=True)
        weights = self._weights(packed, packed.w_hh_t, matmul)
        buffers = self._buffers(ws, matmul, ws.h, ws.gates)
        batch = ws.tanh_c.shape[0]
        live = ws.gates[:batch]
        args = (_ExecArg * 4)(
            _ExecArg(_ARG_SRC, buffers.src.handle),
            _ExecArg(_ARG_WEIGHTS, weights.memory.handle),
            _ExecArg(_ARG_DST, buffers.dst.handle),
            _ExecArg(_ARG_SCRATCHPAD, buffers.scratchpad.handle),
        )  # a zero-sized scratchpad is a memory of a zero descriptor: oneDNN accepts it
        execute, primitive, stream = (
            self.lib.dnnl_primitive_execute,
            matmul.primitive.handle,
            buffers.stream.handle,
        )
        copyto = np.copyto
        keep = (weights, buffers, matmul)  # alive while the step is

        def step(proj_t: np.ndarray, keep: object = keep) -> None:
            copyto(live, proj_t)
            status = execute(primitive, stream, 4, args)
            if status != _SUCCESS:
                self._check(status, "dnnl_primitive_execute")

        return step


@functools.cache
def load() -> OneDNN:
    """The oneDNN of the installed ``onednn-cpu-gomp`` wheel, loaded once;
    `OneDNNError` if there is none (asked again at the next call)."""
    return OneDNN(library_path())
