"""The ``aiopar`` command (also ``python -m aiopar``).

``aiopar info``
    the thread budget, backends and BLAS libraries (:func:`aiopar.parallel_info`).
``aiopar demo``
    the LSTM ensemble of the TorchScript parallelism tutorial: sequential,
    directions forked and models forked, on the chosen backends, called in a
    script and awaited in an event loop; a table of times, speedups and the
    fraction of this machine's GEMM peak; ``--trace`` writes the timeline.
``aiopar bench``
    runs the suites in ``benchmarks/`` and shows their tables.
``aiopar worker --scheduler ADDRESS --name NAME``
    serves as the :mod:`aiopar.rpc` peer ``NAME`` of the cluster at ``ADDRESS``.

Built on :mod:`argparse` and rich, both already at hand (the standard library
and a core dependency): the command adds no dependency. Bad input gets one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import aiopar

from . import profiler

__all__ = ["main"]

USAGE_ERROR = 2


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see '{self.prog} --help')")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    parser = _build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    suite_args: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, suite_args = argv[:split], argv[split + 1 :]
    try:
        args = parser.parse_args(argv)
        args.suite_args = suite_args
        if suite_args and args.command != "bench":
            raise UsageError("aiopar: only 'aiopar bench' takes arguments after '--'")
        if args.command is None:
            parser.print_help()
            return USAGE_ERROR
        return args.run(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # --help and --version end the parse
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="aiopar",
        description="TorchScript-style fork/wait parallelism for plain Python.",
    )
    parser.add_argument("--version", action="version", version=f"aiopar {aiopar.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    info = commands.add_parser("info", help="show threads, backends and BLAS libraries")
    info.set_defaults(run=run_info)

    demo = commands.add_parser(
        "demo",
        help="run the tutorial's LSTM ensemble: sequential vs forked",
        description="Run the LSTM ensemble of the TorchScript parallelism tutorial three "
        "ways (sequential, directions forked, models forked) on each backend, called "
        "from a script and awaited in an event loop, and compare the times.",
    )
    demo.add_argument(
        "--backend",
        type=_backend_list,
        default=["thread"],
        metavar="NAMES",
        help="comma-separated backends to fork on (default: thread; available: "
        f"{', '.join(aiopar.available_backends())})",
    )
    demo.add_argument("--quick", action="store_true", help="a small size, for smoke tests")
    for flag, what in (
        ("--seq-len", "time steps"),
        ("--batch", "batch size"),
        ("--input-size", "input features"),
        ("--hidden-size", "hidden units per direction"),
        ("--models", "models in the ensemble"),
        ("--repeats", "timed runs per row; the best is shown"),
    ):
        default = DEMO_SIZES[flag.strip("-").replace("-", "_")]
        demo.add_argument(flag, type=_positive_int, metavar="N", help=f"{what} (default {default})")
    demo.add_argument(
        "--trace",
        type=_writable_path,
        metavar="PATH",
        help="write a Chrome trace (Trace Event JSON) of the models-forked run",
    )
    demo.set_defaults(run=run_demo)

    bench = commands.add_parser(
        "bench",
        help="run the benchmark suites in benchmarks/",
        description="Run benchmark suites (each a script in benchmarks/) one after another "
        "with this Python, showing their tables. Arguments after '--' go to every suite.",
    )
    bench.add_argument("suites", nargs="*", metavar="SUITE", help="suite names (default: all)")
    bench.add_argument(
        "--dir",
        type=Path,
        help="the benchmarks directory (default: ./benchmarks, else the one "
        "next to the aiopar package)",
    )
    bench.set_defaults(run=run_bench)
    _add_worker_command(commands)
    return parser


# -- argument types ----------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _backend_list(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    available = aiopar.available_backends()
    if not names:
        raise argparse.ArgumentTypeError("name at least one backend")
    for name in names:
        if name not in available:
            raise argparse.ArgumentTypeError(
                f"unknown backend {name!r}; available: {', '.join(available)}"
            )
    return list(dict.fromkeys(names))


def _writable_path(text: str) -> Path:
    """A path we can write to, checked before the demo spends minutes running."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file name")
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: {exc.strerror}") from None
    if not existed:
        path.unlink()
    return path


# -- info --------------------------------------------------------------------


def run_info(args: argparse.Namespace) -> int:
    import numpy  # noqa: F401 - loads BLAS, so the report names it

    parallel_info: Callable[[], str] | None = getattr(aiopar, "parallel_info", None)
    print(parallel_info() if parallel_info is not None else _basic_info())
    return 0


def _basic_info() -> str:
    """What we can say without :func:`aiopar.parallel_info`."""
    import numpy  # noqa: F401 - loads BLAS so threadpoolctl can see it
    import threadpoolctl

    from . import _config

    lines = [
        f"aiopar {aiopar.__version__}",
        f"cores: {_config.cores()}",
        f"interop threads: {aiopar.get_num_interop_threads()}",
        f"backends: {', '.join(aiopar.available_backends())}",
    ]
    for lib in threadpoolctl.threadpool_info():
        lines.append(
            f"{lib['user_api']}: {lib['internal_api']} {lib.get('version') or ''}, "
            f"{lib['num_threads']} threads ({lib['filepath']})"
        )
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        lines.append(f"{var}={os.environ.get(var, '(unset)')}")
    return "\n".join(lines)


# -- demo --------------------------------------------------------------------

#: the tutorial's sizes exactly (T, B, C = 50, 50, 1024; 4 models): about a
#: minute on two cores; --quick, or smaller --input-size/--hidden-size, is faster
DEMO_SIZES = {
    "seq_len": 50,
    "batch": 50,
    "input_size": 1024,
    "hidden_size": 1024,
    "models": 4,
    "repeats": 2,
}
QUICK_SIZES = {
    "seq_len": 10,
    "batch": 4,
    "input_size": 8,
    "hidden_size": 16,
    "models": 2,
    "repeats": 1,
}

#: the tutorial's three variants: (label, fork_models, fork_directions)
VARIANTS = (
    ("sequential", False, False),
    ("directions forked", False, True),
    ("models forked", True, True),
)


@dataclass
class _Row:
    variant: str
    backend: str
    mode: str
    seconds: float
    matches: bool


def run_demo(args: argparse.Namespace) -> int:
    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from .nn import LSTMEnsemble

    defaults = QUICK_SIZES if args.quick else DEMO_SIZES
    size = {key: getattr(args, key) or default for key, default in defaults.items()}
    seq_len, batch, input_size, hidden = (
        size["seq_len"],
        size["batch"],
        size["input_size"],
        size["hidden_size"],
    )
    models, repeats, backends = size["models"], size["repeats"], args.backend
    out = _console()
    out.print(
        f"LSTM ensemble: {models} bidirectional LSTMs, input ({seq_len}, {batch}, "
        f"{input_size}), hidden {hidden}; best of {repeats}"
    )
    out.print(
        "sync: ens(x) in this thread; await: await aiopar.fork(ens, x) in an asyncio loop",
        style="dim",
    )

    ens = LSTMEnsemble(models, input_size, hidden, seed=0)
    x = np.random.default_rng(0).random((seq_len, batch, input_size), dtype=np.float32)
    # per model and direction, every step: x @ W_ih.T and h @ W_hh.T, 4 gates
    flops = models * 2 * seq_len * 2 * batch * 4 * hidden * (input_size + hidden)

    # Sequential code forks nothing, so called in this thread it needs no
    # backend; awaited, the whole ensemble is one task on each backend.
    runs = [("sequential", "-", "sync")] + [
        (variant, backend, mode)
        for backend in backends
        for variant, _, _ in VARIANTS
        for mode in ("sync", "await")
        if (variant, mode) != ("sequential", "sync")
    ]
    with (
        Progress(
            TextColumn("{task.description:<40}"),
            BarColumn(),
            MofNCompleteColumn(),
            console=Console(stderr=True),
            transient=True,
        ) as progress,
        asyncio.Runner() as loop,
    ):
        bar = progress.add_task("GEMM peak", total=len(runs) * (repeats + 1) + 2)
        peak_n, peak_seconds = (512, 0.1) if args.quick else (2048, 1.0)
        peak = _gemm_peak(peak_n, peak_seconds)
        progress.advance(bar)

        def timed(variant: str, backend: str, mode: str) -> tuple[Any, float]:
            """One run: its output and seconds, measured where the call happens."""
            progress.update(bar, description=f"{variant} · {backend} · {mode}")
            # The BLAS threads of the run before spin for up to about 0.2 s
            # after their last call, and would slow this one down.
            time.sleep(0.05 if args.quick else 0.3)
            _, fork_models, fork_directions = next(v for v in VARIANTS if v[0] == variant)
            ens.fork_models, ens.fork_directions = fork_models, fork_directions
            with aiopar.use_backend(backend if backend != "-" else "inline"):
                if mode == "sync":
                    start = time.perf_counter()
                    result = ens(x)
                    seconds = time.perf_counter() - start
                else:
                    # the Runner's own context predates use_backend: pass ours
                    context = contextvars.copy_context()
                    result, seconds = loop.run(_timed_await(ens, x), context=context)
            progress.advance(bar)
            return result, seconds

        # One warm-up run each (threads and workers started, weights packed),
        # then rounds over all rows in turn, so drift on a shared machine
        # hits every row alike; the best round of each row counts.
        outputs = [timed(*run)[0] for run in runs]
        best = [float("inf")] * len(runs)
        for _ in range(repeats):
            for i, run in enumerate(runs):
                best[i] = min(best[i], timed(*run)[1])
        progress.update(bar, description="GEMM peak, again")
        peak = max(peak, _gemm_peak(peak_n, peak_seconds))  # the machine may have calmed down
        progress.advance(bar)
        rows = [
            _Row(*run, seconds, bool(np.allclose(out, outputs[0], rtol=1e-4, atol=1e-5)))
            for run, seconds, out in zip(runs, best, outputs, strict=True)
        ]

        prof = None
        if args.trace is not None:
            progress.update(bar, description="trace of models forked")
            ens.fork_models = ens.fork_directions = True
            with aiopar.use_backend(backends[0]), profiler.profile() as prof:
                ens(x)

    out.print(_results_table(rows, flops, peak))
    status = 0
    if all(row.matches for row in rows):
        out.print("Every variant's output matches the sequential run.")
    else:
        out.print("[bold red]Outputs differ from the sequential run (marked ✗).[/]")
        status = 1
    if prof is not None:
        try:
            prof.export_chrome_trace(args.trace)
        except OSError as exc:
            raise UsageError(
                f"aiopar demo: cannot write the trace to {str(args.trace)!r}: {exc}"
            ) from None
        out.print(prof.rich_table())
        out.print(
            f"Trace of the models-forked run on {backends[0]}: {args.trace} "
            f"({len(prof.records)} tasks); open it in https://ui.perfetto.dev or chrome://tracing",
            soft_wrap=True,
        )
    return status


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = max(console.width, 110)  # a file or pipe: keep table rows whole
    return console


async def _timed_await(ens: Any, x: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    result = await aiopar.fork(ens, x)
    return result, time.perf_counter() - start


def _gemm_peak(n: int, seconds: float) -> float:
    """FLOP/s of a float32 n x n matrix product with BLAS's default threads.

    The best of as many products as fit in ``seconds`` (at least 5): on a
    busy machine a multi-threaded product often waits for a core, and only
    the fastest run shows what the hardware can do.
    """
    import numpy as np

    rng = np.random.default_rng(1)
    a = rng.random((n, n), dtype=np.float32)
    b = rng.random((n, n), dtype=np.float32)
    a @ b
    best = float("inf")
    deadline = time.perf_counter() + seconds
    runs = 0
    while runs < 5 or time.perf_counter() < deadline:
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
        runs += 1
    return 2 * n**3 / best


def _results_table(rows: list[_Row], flops: float, peak: float) -> Any:
    from rich.table import Table

    baseline = rows[0].seconds
    table = Table(
        title=f"GEMM peak on this machine: {peak / 1e9:.1f} GFLOP/s (float32)",
        title_justify="left",
    )
    table.add_column("variant")
    table.add_column("backend")
    table.add_column("mode")
    table.add_column("time", justify="right")
    table.add_column("speedup", justify="right")
    table.add_column("of GEMM peak", justify="right")
    for row in rows:
        speedup = baseline / row.seconds
        style = "green" if speedup > 1.05 else "red" if speedup < 0.95 else ""
        table.add_row(
            row.variant + ("" if row.matches else " ✗"),
            row.backend,
            row.mode,
            f"{row.seconds * 1e3:.2f} ms",
            f"[{style}]{speedup:.2f}x[/]" if style else f"{speedup:.2f}x",
            f"{flops / row.seconds / peak:.1%}",
        )
    return table


# -- bench -------------------------------------------------------------------

#: suites run first, in this order; any other benchmarks/*.py follow by name
SUITE_ORDER = ("overhead", "threads", "process", "lstm")


def _benchmarks_dir(given: Path | None) -> Path:
    if given is not None:
        if not given.is_dir():
            raise UsageError(f"aiopar bench: --dir {str(given)!r} is not a directory")
        return given
    for candidate in (
        Path.cwd() / "benchmarks",
        Path(__file__).resolve().parents[1] / "benchmarks",
    ):
        if candidate.is_dir():
            return candidate
    raise UsageError(
        "aiopar bench: no benchmarks/ directory here or next to the aiopar package; "
        "run from a source checkout or pass --dir"
    )


def run_bench(args: argparse.Namespace) -> int:
    from rich.table import Table

    directory = _benchmarks_dir(args.dir)
    found = {p.stem: p for p in directory.glob("*.py") if not p.name.startswith("_")}
    order = [name for name in SUITE_ORDER if name in found]
    order += sorted(set(found) - set(order))
    for name in args.suites:
        if name.removesuffix(".py") not in found:
            raise UsageError(
                f"aiopar bench: no suite {name!r} in {directory}; "
                f"available: {', '.join(order) or '(none)'}"
            )
    chosen = [name.removesuffix(".py") for name in args.suites] or order
    if not chosen:
        raise UsageError(f"aiopar bench: {directory} holds no benchmark suites")

    out = _console()
    summary = Table(title="benchmark suites", title_justify="left")
    summary.add_column("suite")
    summary.add_column("result")
    summary.add_column("time", justify="right")
    failed = 0
    for name in chosen:
        out.rule(f"[bold]{name}[/]  ({found[name]})")
        sys.stdout.flush()
        start = time.perf_counter()
        returncode = subprocess.call([sys.executable, str(found[name]), *args.suite_args])
        elapsed = time.perf_counter() - start
        ok = returncode == 0
        failed += not ok
        summary.add_row(
            name, "ok" if ok else f"[red]failed (exit {returncode})[/]", f"{elapsed:.1f} s"
        )
    out.print(summary)
    return 1 if failed else 0


# -- aiopar worker ------------------------------------------------------------


def _add_worker_command(commands: Any) -> None:
    worker = commands.add_parser(
        "worker",
        help="serve as an aiopar.rpc peer of a cluster",
        description="Join the cluster whose scheduler is at ADDRESS as the aiopar.rpc peer "
        "NAME, and serve calls until interrupted or the scheduler goes away. Needs an rpc "
        "engine (pip install aiopar-dask).",
    )
    worker.add_argument("--scheduler", required=True, metavar="ADDRESS", help="tcp://host:port")
    worker.add_argument("--name", required=True, help="this peer's unique name")
    worker.add_argument(
        "--rank", type=int, metavar="N", help="this peer's id (default: the smallest free one)"
    )
    worker.add_argument(
        "--nthreads", type=_positive_int, default=16, metavar="N", help="calls run at once"
    )
    worker.set_defaults(run=run_worker)


def run_worker(args: argparse.Namespace) -> int:
    from .rpc import RpcBackendOptions
    from .rpc.agent import serve_peer

    options = RpcBackendOptions(num_worker_threads=args.nthreads)
    try:
        serve_peer(args.scheduler, args.name, args.rank, options)
    except (RuntimeError, ValueError, OSError) as exc:
        raise UsageError(f"aiopar worker: {exc}") from exc
    return 0
