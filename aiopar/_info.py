"""``parallel_info``: the parallel settings in words, for people and bug reports."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Iterable
from typing import Any

from . import _budget, _config, _parallel
from ._budget import budget, cores
from .backends import Backend, available_backends

__all__ = ["add_info_lines", "parallel_info"]

#: what modules above the core add to the report (aiopar.nn: its LSTM engine)
_more_lines: list[Callable[[], Iterable[str]]] = []


def add_info_lines(source: Callable[[], Iterable[str]]) -> None:
    """Have `parallel_info` show the lines `source()` returns, called at each report.

    The core imports none of the modules that use it (``aiopar.lowlevel``
    hands it to plugins and ``aiopar.nn``): they register themselves when
    imported.
    """
    if source not in _more_lines:
        _more_lines.append(source)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def parallel_info() -> str:
    """A report of the parallel settings, for people and bug reports.

    Lists the backends (available and current), the interop workers, the
    intra-op threads and how they were decided, the BLAS/OpenMP libraries
    threadpoolctl sees with their thread counts and, for OpenBLAS and BLIS,
    the CPU kernels they chose (and who set a count when it was not aiopar,
    such as a ``threadpool_limits`` block in some thread),
    the environment variables that set thread counts (and any that are set
    but ignored), and a warning line for each setting that oversubscribes
    the cores.
    """
    n_cores = cores()
    interop = _budget.get_num_interop_threads()
    lines = [f"aiopar on {n_cores} cores (Python {platform.python_version()}, {sys.platform})"]
    backend = _config.scoped_or_default()
    current = backend.name if backend is not None else "thread"
    lines.append(f"backends: {', '.join(available_backends())} (current: {current})")
    if backend is not None:
        workers = f"{backend.max_workers} on the current {backend.name!r} backend"
    else:
        workers = f"{interop} (the thread backend's default)"
    lines.append(f"interop workers: {workers}; get_num_interop_threads() = {interop}")

    intra = budget.target()
    if budget.explicit is not None:
        how = f"set by {budget.explicit_from}, kept whatever runs"
    else:
        how = f"budget: cores // running tasks, {budget.running} running now"
    lines.append(f"intra-op threads: {intra} ({how})")
    helpers = max(intra - 1, 0)
    lines.append(
        f"parallel_for: up to {_plural(intra, 'thread')} (the caller + "
        f"{_plural(helpers, 'helper')}; {_parallel.helper_count()} started)"
    )

    libraries = budget.libraries()
    lines.append("libraries (threadpoolctl):" if libraries else "libraries: none loaded")
    for lib in libraries:
        layer = lib.get("threading_layer")
        held = ""
        if "aiopar_count" in lib:
            thread = lib["held_in"]
            held = ", set outside aiopar by " + (
                "the library's own API or threadpoolctl"
                if thread is None
                else f"threadpoolctl in thread {thread!r}"
            )
        # The kernels OpenBLAS and BLIS chose for this CPU: a library that
        # does not recognise a CPU falls back to older, slower ones.
        kernels = lib.get("architecture")
        lines.append(
            f"  {lib['internal_api']} {lib.get('version') or '?'} ({lib['user_api']}"
            f"{', ' + layer if layer else ''}{f', {kernels} kernels' if kernels else ''}): "
            f"{_plural(lib['num_threads'], 'thread')}{held}, {os.path.basename(lib['filepath'])}"
        )
        if held:
            until = f"it is back to {lib['aiopar_count']}, the count the budget gave it"
            if lib["held_in"] is not None:
                block = "that threadpool_limits block ends"
                back = lib["num_threads"] == lib["aiopar_count"]
                until = block if back else f"{block} and {until}"
            lines.append(f"    aiopar leaves it alone until {until}")
    lines.append(
        "environment: "
        + ", ".join(f"{name}={os.environ.get(name, 'unset')}" for name in _budget.THREAD_ENV_VARS)
    )
    for source in _more_lines:
        lines.extend(source())
    lines.extend(f"note: {why}" for why in budget.env_ignored)
    lines.extend(f"note: {why}" for why in _older_kernels(libraries, _cpu_flags()))
    lines.extend(f"WARNING: {w}" for w in _oversubscription(libraries, backend))
    return "\n".join(lines)


#: what OpenBLAS's SkylakeX kernels need of the CPU
_AVX512_FLAGS = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def _cpu_flags() -> frozenset[str]:
    """The instruction-set flags of this CPU (Linux), else an empty set."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def _older_kernels(libraries: list[dict[str, Any]], flags: frozenset[str]) -> list[str]:
    """A sentence for an OpenBLAS that runs kernels without AVX-512 on a CPU
    that has it: ``OPENBLAS_CORETYPE`` chose them, or OpenBLAS did not
    recognise the CPU."""
    if not _AVX512_FLAGS.issubset(flags):
        return []
    coretype = os.environ.get("OPENBLAS_CORETYPE")
    notes = []
    for lib in libraries:
        kernels = lib.get("architecture")
        if lib["internal_api"] != "openblas" or kernels not in ("Haswell", "Zen", "Sandybridge"):
            continue
        if coretype:
            why = f"OPENBLAS_CORETYPE={coretype} chose them; unset, OpenBLAS picks its own"
        else:
            why = (
                "it did not recognise the CPU; OPENBLAS_CORETYPE=SkylakeX, set before numpy "
                "is imported, selects its AVX-512 kernels"
            )
        notes.append(
            f"OpenBLAS runs its {kernels} kernels, without AVX-512, on a CPU that has "
            f"AVX-512 ({why}); matrix products may take twice as long"
        )
    return notes


def _oversubscription(libraries: list[dict[str, Any]], backend: Backend | None) -> list[str]:
    n_cores = cores()
    warnings = []
    workers = _budget.get_num_interop_threads()
    if backend is not None and backend.name == "thread":
        workers = backend.max_workers
    if budget.explicit is not None and workers * budget.explicit > n_cores:
        warnings.append(
            f"{workers} interop workers x {budget.explicit} intra-op threads "
            f"({budget.explicit_from}) = {workers * budget.explicit} threads on {n_cores} cores: "
            f"forked tasks that use BLAS or parallel_for at the same time will oversubscribe; "
            f"set_num_threads(None) restores the automatic budget"
        )
    for lib in libraries:
        if lib["num_threads"] > n_cores:
            warnings.append(
                f"{lib['internal_api']} uses {lib['num_threads']} threads on {n_cores} cores"
            )
    return warnings
