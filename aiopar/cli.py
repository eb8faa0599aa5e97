"""The ``aiopar`` command (also ``python -m aiopar``).

``aiopar info``
    the thread budget, backends and BLAS libraries (:func:`aiopar.parallel_info`).
``aiopar demo``
    the LSTM ensemble of the TorchScript parallelism tutorial, sequential and
    forked, in rounds (:mod:`aiopar._demo` runs and reports them).
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
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from rich.console import Console
from rich.table import Table

import aiopar

from . import _demo

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


def _console() -> Console:
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


def _add_demo(commands: Any) -> None:
    duration = _demo.DURATION
    demo = commands.add_parser(
        "demo",
        help=f"run the tutorial's LSTM ensemble: sequential vs forked ({duration['default']})",
        description="Run the LSTM ensemble of the TorchScript parallelism tutorial "
        "sequentially, with its directions forked and with its models forked, in rounds, "
        "and show each variant's speed-up over the sequential run with its spread, wall "
        "and CPU time, the speed-up of forking alone (1 BLAS thread each), and a verdict, "
        f"or none if the machine was busy. Takes {duration['default']}; --full runs the "
        f"tutorial's sizes ({duration['full']}).",
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
        "--full", action="store_true", help=f"the tutorial's sizes (C = 1024): {duration['full']}"
    )
    size.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny sizes, {_demo.QUICK_ROUNDS} rounds: a smoke test ({duration['quick']})",
    )
    for (flag, what), default in zip(
        (
            ("--seq-len", "time steps"),
            ("--batch", "batch size"),
            ("--input-size", "input features"),
            ("--hidden-size", "hidden units per direction"),
            ("--models", "models in the ensemble"),
        ),
        _demo.SIZES["default"],
        strict=True,
    ):
        demo.add_argument(flag, type=_positive_int, metavar="N", help=f"{what} (default {default})")
    low, high = _demo.ROUNDS
    demo.add_argument(
        "--rounds",
        type=_positive_int,
        metavar="N",
        help=f"timed rounds of every row (default: as many as fit in about "
        f"{_demo.ROUND_SECONDS['default']:.0f} s, {low} to {high})",
    )
    demo.add_argument(
        "--trace",
        type=_writable_path,
        metavar="PATH",
        help="write a Chrome trace (Trace Event JSON) of a models-forked run",
    )
    demo.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    kind = "quick" if args.quick else "full" if args.full else "default"
    given = (args.seq_len, args.batch, args.input_size, args.hidden_size, args.models)
    sizes = _demo.Sizes(*(g or d for g, d in zip(given, _demo.SIZES[kind], strict=True)))
    demo = _demo.Demo(kind, sizes, args.backend, args.rounds, args.trace, resized=any(given))
    try:
        return _demo.run(demo, _console())
    except _demo.TraceError as exc:
        raise UsageError(f"aiopar demo: {exc}") from None


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
    worker.add_argument(
        "--scheduler", required=True, metavar="ADDRESS", help="tcp://host:port (tls:// with TLS)"
    )
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
    worker.add_argument(
        "--run-tasks",
        action="store_true",
        help="also run the dask tasks of the scheduler's clients, as an ordinary worker "
        "(default: calls only)",
    )
    tls = worker.add_argument_group(
        "TLS (as dask worker's; what is not given comes from dask's distributed.comm.tls "
        "configuration)"
    )
    pem = {"type": _pem_file, "metavar": "PEM"}
    tls.add_argument("--tls-ca-file", **pem, help="CA certificate(s) to trust")
    tls.add_argument("--tls-cert", **pem, help="this peer's certificate")
    tls.add_argument("--tls-key", **pem, help="this peer's private key")
    worker.set_defaults(run=run_worker)


def _pem_file(text: str) -> str:
    if not os.path.isfile(text) or not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file this user can read")
    return text


def run_worker(args: argparse.Namespace) -> int:
    from .rpc import RpcBackendOptions
    from .rpc.agent import TlsFiles, serve_peer

    options = RpcBackendOptions(num_worker_threads=args.nthreads, run_tasks=args.run_tasks)
    tls = TlsFiles(args.tls_ca_file, args.tls_cert, args.tls_key)
    try:
        serve_peer(args.scheduler, args.name, args.rank, options, tls=tls)
    except (RuntimeError, ValueError, OSError) as exc:
        raise UsageError(f"aiopar worker: {exc}") from exc
    return 0
