"""The ``aiopar`` command (also ``python -m aiopar``).

``aiopar info``
    the thread budget, backends and BLAS libraries (:func:`aiopar.parallel_info`).
``aiopar demo``
    the LSTM ensemble of the TorchScript parallelism tutorial, sequential and
    forked, in rounds for about 20 s: each variant's speed-up with its spread
    over the rounds, a pair of rows at 1 BLAS thread each that isolates
    inter-op parallelism, and a verdict read from those figures.
``aiopar bench``
    runs the suites in ``benchmarks/`` and shows their tables.
``aiopar worker --scheduler ADDRESS --name NAME``
    serves as the :mod:`aiopar.rpc` peer ``NAME`` of the cluster at ``ADDRESS``.

Built on :mod:`argparse` and rich, both already at hand (the standard library
and a core dependency): the command adds no dependency. Bad input gets one
line on stderr and exit status 2, never a traceback. Each subcommand is one
``_add_<name>`` function that registers its parser and its ``run`` function.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
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
        status: int = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return status
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except SystemExit as exc:  # --help and --version end the parse
        return exc.code if isinstance(exc.code, int) else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`aiopar info | head`): stop quietly, as the
        # Python docs advise for SIGPIPE, pointing stdout at devnull so the
        # flush at exit does not raise again.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is no file descriptor (captured)
            pass
        return 1


def _build_parser() -> _Parser:
    parser = _Parser(
        prog="aiopar",
        description="TorchScript-style fork/wait parallelism for plain Python.",
    )
    parser.add_argument("--version", action="version", version=f"aiopar {aiopar.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for add in (_add_info, _add_demo, _add_bench, _add_worker):
        add(commands)
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
    """A path we can write to, checked before the demo spends its time running."""
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


def _console() -> Any:
    from rich.console import Console

    console = Console(highlight=False)
    if not console.is_terminal:
        # a file or pipe: keep table rows and sentences whole
        console.width = max(console.width, 110)
        console.soft_wrap = True
    return console


# -- info --------------------------------------------------------------------


def _add_info(commands: Any) -> None:
    info = commands.add_parser("info", help="show threads, backends and BLAS libraries")
    info.set_defaults(run=run_info)


def run_info(args: argparse.Namespace) -> int:
    import numpy  # noqa: F401 - loads BLAS, so the report names it

    print(aiopar.parallel_info())
    return 0


# -- demo --------------------------------------------------------------------

#: (seq_len, batch, input_size, hidden_size, models) of each size: the default
#: is the tutorial's model at a quarter of its width (1/16 of its FLOPs)
DEMO_SIZES = {
    "default": (50, 50, 256, 256, 4),
    "full": (50, 50, 1024, 1024, 4),  # the tutorial's sizes exactly
    "quick": (10, 4, 8, 16, 2),  # a smoke test: its times mean little
}
#: seconds of timed rounds to aim for, after the warm-up run of every row;
#: the number of rounds is what fits, within ROUNDS (--quick: QUICK_ROUNDS)
ROUND_SECONDS = {"default": 15.0, "full": 40.0}
ROUNDS = (3, 10)
QUICK_ROUNDS, QUICK_PAUSE = 2, 0.01
#: what the header promises: the rounds' budget plus the warm-up (one round),
#: measured on 2 cores
DURATION = {"default": "about 20 s", "full": "about a minute on 2 cores"}


def _add_demo(commands: Any) -> None:
    demo = commands.add_parser(
        "demo",
        help=f"run the tutorial's LSTM ensemble: sequential vs forked ({DURATION['default']})",
        description="Run the LSTM ensemble of the TorchScript parallelism tutorial "
        "sequentially, with its directions forked and with its models forked, in rounds, "
        "and show each variant's speed-up over the sequential run with its spread, the "
        f"speed-up of forking alone (1 BLAS thread each), and a verdict. Takes "
        f"{DURATION['default']}; --full runs the tutorial's sizes ({DURATION['full']}).",
    )
    demo.add_argument(
        "--backend",
        type=_backend_list,
        default=["thread"],
        metavar="NAMES",
        help="comma-separated backends to fork on (default: thread; available: "
        f"{', '.join(aiopar.available_backends())})",
    )
    size = demo.add_mutually_exclusive_group()
    size.add_argument(
        "--full", action="store_true", help=f"the tutorial's sizes (C = 1024): {DURATION['full']}"
    )
    size.add_argument("--quick", action="store_true", help="tiny sizes, 2 rounds: a smoke test")
    sizes = DEMO_SIZES["default"]
    for (flag, what), default in zip(
        (
            ("--seq-len", "time steps"),
            ("--batch", "batch size"),
            ("--input-size", "input features"),
            ("--hidden-size", "hidden units per direction"),
            ("--models", "models in the ensemble"),
        ),
        sizes,
        strict=True,
    ):
        demo.add_argument(flag, type=_positive_int, metavar="N", help=f"{what} (default {default})")
    demo.add_argument(
        "--rounds",
        type=_positive_int,
        metavar="N",
        help=f"timed rounds of every row (default: as many as fit in about "
        f"{ROUND_SECONDS['default']:.0f} s, {ROUNDS[0]} to {ROUNDS[1]})",
    )
    demo.add_argument(
        "--trace",
        type=_writable_path,
        metavar="PATH",
        help="write a Chrome trace (Trace Event JSON) of a models-forked run",
    )
    demo.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    import numpy as np

    from .nn import LSTMEnsemble
    from .nn import _measure as m

    kind = "quick" if args.quick else "full" if args.full else "default"
    given = (args.seq_len, args.batch, args.input_size, args.hidden_size, args.models)
    seq_len, batch, input_size, hidden, models = (
        g or d for g, d in zip(given, DEMO_SIZES[kind], strict=True)
    )
    backends: list[str] = args.backend
    cores = m.available_cores()
    pause = QUICK_PAUSE if args.quick else m.spin_pause()
    flops = m.ensemble_flops(models, seq_len, batch, input_size, hidden)

    out = _console()
    out.print(
        f"[bold]aiopar demo[/]: the LSTM ensemble of the TorchScript parallelism tutorial, in "
        f"numpy: {models} bidirectional LSTMs, input (T, B, C) = ({seq_len}, {batch}, "
        f"{input_size}), hidden {hidden}; {_flop_text(flops)} a run; "
        f"forks on {', '.join(backends)}; {cores} cores."
    )
    out.print(_demo_plan(kind, args.rounds, any(given)))

    ens = LSTMEnsemble(models, input_size, hidden, seed=0)
    x = np.random.default_rng(0).random((seq_len, batch, input_size), dtype=np.float32)
    prof = None
    with asyncio.Runner() as loop, _progress() as progress:
        rows = _demo_rows(ens, x, backends, loop)
        bar = progress.add_task("GEMM peak", total=None)
        peak = m.gemm_peak()
        # The warm-up starts threads and workers, gives every row's output
        # for the check, and tells how long a round may take.
        progress.update(bar, description="warm-up: one run of each row")
        start = time.perf_counter()
        outputs = []
        for row in rows:
            time.sleep(pause)
            outputs.append(row.call()[0])
        rounds = _run_rounds(
            rows,
            pause,
            progress,
            bar,
            rounds=args.rounds or (QUICK_ROUNDS if args.quick else None),
            seconds=ROUND_SECONDS.get(kind, 0.0),
            warm_up=time.perf_counter() - start,
        )
        progress.update(bar, description="GEMM peak, again")
        peaks = [peak, m.gemm_peak()]
        peak = max(peaks)  # the machine may have calmed down
        if args.trace is not None:
            progress.update(bar, description="a traced models-forked run")
            with profiler.profile() as prof:
                m.ensemble_run(ens, x, "models forked", backend=backends[0])()

    matches = [bool(np.allclose(o, outputs[0], rtol=1e-4, atol=1e-5)) for o in outputs]
    out.print(_demo_table(rows, matches, rounds, flops, peak))
    status = 0
    if all(matches):
        out.print("Every row's output matches the sequential run.")
    else:
        out.print("[bold red]Outputs differ from the sequential run (marked ✗).[/]")
        status = 1
    sequential, single, interop = rows[0], rows[-2], rows[-1]
    forked = {row.name: row.speedup() for row in rows if row.anchor is sequential}
    out.print(m.verdict(forked), style="bold")
    blas = m.Spread.paired(single.times, sequential.times)
    speedups = [s for s in (row.speedup() for row in rows) if s is not None]
    of_peak = [flops / min(row.times) / peak for row in rows]
    busy = m.busy_signs(speedups, cores, peaks, of_peak)
    out.print(m.explain(interop.speedup(), blas, cores, tasks=2 * models, busy=busy))
    if prof is not None:
        try:
            prof.export_chrome_trace(args.trace)
        except OSError as exc:
            raise UsageError(
                f"aiopar demo: cannot write the trace to {str(args.trace)!r}: {exc}"
            ) from None
        out.print(prof.rich_table())
        out.print(
            f"Trace of a models-forked run on {backends[0]}: {args.trace} "
            f"({len(prof.records)} tasks); open it in https://ui.perfetto.dev or chrome://tracing",
            soft_wrap=True,
        )
    return status


def _run_rounds(
    rows: list[Any],
    pause: float,
    progress: Any,
    bar: Any,
    *,
    rounds: int | None,
    seconds: float,
    warm_up: float,
) -> int:
    """Time rounds of `rows` and return how many ran: `rounds` if given, else as
    many as fit in `seconds` (within ROUNDS), judged from the `warm_up` at first
    and then from each round just timed, as the machine may be busy."""
    from .nn._measure import timed_round

    deadline = time.perf_counter() + seconds
    planned = rounds or _rounds_left(0, warm_up, seconds)
    done = 0
    while done < planned:
        progress.update(
            bar, description=f"round {done + 1} of {planned}", total=planned * len(rows)
        )
        start = time.perf_counter()
        for _ in timed_round(rows, pause):
            progress.advance(bar)
        done += 1
        if rounds is None:
            took, left = time.perf_counter() - start, deadline - time.perf_counter()
            planned = _rounds_left(done, took, left)
    return done


def _demo_rows(ens: Any, x: Any, backends: list[str], loop: asyncio.Runner) -> list[Any]:
    """The rows: sequential (the anchor), the forked variants on each backend,
    then the inter-op pair, sequential (its anchor) and models forked, at 1
    BLAS thread each, where only the forks can use more than one core."""
    from .nn._measure import Row, ensemble_run

    sequential = Row("sequential", ensemble_run(ens, x, "sequential"))
    rows = [sequential]
    for backend in backends:
        on = f" on {backend}" if len(backends) > 1 else ""
        for variant, runner, how in (
            ("directions forked", None, ""),
            ("models forked", None, ""),
            ("models forked", loop, " (awaited)"),
        ):
            run = ensemble_run(ens, x, variant, backend=backend, runner=runner)
            rows.append(Row(variant + on + how, run, anchor=sequential))
    single = Row("sequential, 1 BLAS thread", ensemble_run(ens, x, "sequential"), blas_threads=1)
    run = ensemble_run(ens, x, "models forked")
    rows += [single, Row("models forked, 1 BLAS thread", run, anchor=single, blas_threads=1)]
    return rows


def _progress() -> Any:
    """A progress bar on stderr that leaves no trace once done (nothing when not a terminal)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description:<30}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("left"),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )


def _rounds_left(done: int, round_seconds: float, seconds_left: float) -> int:
    """How many rounds to run in all, `done` of them run, if one takes `round_seconds`
    and the budget has `seconds_left`: as many as fit, within ROUNDS."""
    low, high = ROUNDS
    fit = done + int(max(seconds_left, 0.0) / max(round_seconds, 1e-9))
    return max(done, low, min(high, fit))


def _flop_text(flops: float) -> str:
    return f"{flops / 1e9:.1f} GFLOP" if flops >= 1e8 else f"{flops / 1e6:.2f} MFLOP"


def _demo_plan(kind: str, rounds: int | None, resized: bool) -> str:
    """What the demo is about to do, and how long it takes."""
    if kind == "quick":
        return (
            f"--quick: tiny sizes and {rounds or QUICK_ROUNDS} rounds, "
            f"a smoke test whose times mean little."
        )
    if rounds:
        what = f"{rounds} rounds"
    else:
        low, high = ROUNDS
        what = f"rounds ({low} to {high}, as many as fit in about {ROUND_SECONDS[kind]:.0f} s)"
    plan = f"one warm-up run of each row, then {what} of every row in turn"
    if rounds or resized:
        return f"Plan: {plan}; the progress bar shows the time left."
    if kind == "full":
        return f"The tutorial's sizes take {DURATION[kind]}: {plan}."
    return f"Takes {DURATION[kind]}: {plan}. --full runs the tutorial's sizes ({DURATION['full']})."


def _demo_table(
    rows: list[Any], matches: list[bool], rounds: int, flops: float, peak: float
) -> Any:
    from rich import box
    from rich.table import Table

    table = Table(
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        caption=f"speed-up per round: the anchor's time / the row's (above 1x: faster); "
        f"its median and range over {rounds} rounds. float32 GEMM peak: "
        f"{peak / 1e9:.0f} GFLOP/s.",
        caption_justify="left",
    )
    table.add_column("row", no_wrap=True)
    table.add_column("best", justify="right")
    table.add_column("speed-up", justify="right")
    table.add_column("range", justify="right")
    table.add_column("of peak", justify="right")
    for row, ok in zip(rows, matches, strict=True):
        if row.anchor is None and row is not rows[0]:
            table.add_row("[dim italic]inter-op alone, on thread:[/]")
        spread = row.speedup()
        if spread is None:
            speedup, spread_text = "[dim]anchor[/]", ""
        else:
            style = {"faster": "green", "slower": "red", "level": ""}[spread.outcome]
            speedup = f"[{style}]{spread}[/]" if style else str(spread)
            spread_text = spread.range
        best = min(row.times)
        table.add_row(
            row.name + ("" if ok else " ✗"),
            f"{best * 1e3:.1f} ms" if best < 1 else f"{best:.2f} s",
            speedup,
            spread_text,
            f"{flops / best / peak:.0%}",
        )
    return table


# -- bench -------------------------------------------------------------------

#: suites run first, in this order; any other benchmarks/*.py follow by name
SUITE_ORDER = ("overhead", "threads", "process", "lstm")

#: seconds each suite took at its default rounds, measured in one `aiopar bench`
#: run on 2 cores shared with other work (the whole run: about 10 minutes)
SUITE_SECONDS = {"overhead": 30, "threads": 250, "process": 25, "lstm": 285, "fork_cost": 8}


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def bench_plan(chosen: Sequence[str], suite_args: Sequence[str]) -> str:
    """What `aiopar bench` is about to run and how long it takes, from SUITE_SECONDS."""
    known = [name for name in chosen if name in SUITE_SECONDS]
    total = sum(SUITE_SECONDS[name] for name in known)
    parts = ", ".join(f"{name} ~{_duration(SUITE_SECONDS[name])}" for name in known)
    plan = f"Running {len(chosen)} suite{'s' if len(chosen) != 1 else ''}: {', '.join(chosen)}."
    if known:
        plan += f" On 2 cores at their default rounds they took about {_duration(total)} ({parts})"
        unknown = len(chosen) - len(known)
        plan += f", plus {unknown} not timed yet." if unknown else "."
    if "--rounds" in suite_args:
        plan += " --rounds changes that: each suite's time grows with its rounds."
    else:
        plan += " Fewer rounds take less: aiopar bench -- --rounds 1."
    return plan


def _suites_found() -> str:
    """The suites `aiopar bench` would run from here, for its --help."""
    try:
        directory = _benchmarks_dir(None)
    except UsageError:
        return "none found: no benchmarks/ directory here or next to the package"
    names = _suite_order({p.stem: p for p in directory.glob("*.py") if not p.name.startswith("_")})
    timed = [f"{n} (~{_duration(SUITE_SECONDS[n])})" if n in SUITE_SECONDS else n for n in names]
    return ", ".join(timed) or f"none in {directory}"


def _suite_order(found: dict[str, Path]) -> list[str]:
    order = [name for name in SUITE_ORDER if name in found]
    return order + sorted(set(found) - set(order))


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


def _add_bench(commands: Any) -> None:
    bench = commands.add_parser(
        "bench",
        help="run the benchmark suites in benchmarks/",
        description="Run benchmark suites (each a script in benchmarks/) one after another "
        "with this Python, showing their tables. Arguments after '--' go to every suite "
        "('-- --rounds 1' for a quicker run). All of them take about "
        f"{_duration(sum(SUITE_SECONDS.values()))} on 2 cores; it says so before it starts.",
    )
    bench.add_argument(
        "suites",
        nargs="*",
        metavar="SUITE",
        help=f"suite names (default: all). Suites here, with their time at default "
        f"rounds on 2 cores: {_suites_found()}",
    )
    bench.add_argument(
        "--dir",
        type=Path,
        help="the benchmarks directory (default: ./benchmarks, else the one "
        "next to the aiopar package)",
    )
    bench.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from rich.table import Table

    directory = _benchmarks_dir(args.dir)
    found = {p.stem: p for p in directory.glob("*.py") if not p.name.startswith("_")}
    order = _suite_order(found)
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
    out.print(bench_plan(chosen, args.suite_args))
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


def _add_worker(commands: Any) -> None:
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
        "--rank",
        type=int,
        metavar="N",
        help="this peer's rank, counted by init_rpc's world_size (default: none; "
        "the peer's id is then negative)",
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
