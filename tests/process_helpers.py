"""What the process backend's tests share: fixtures that check nothing is left
behind, pools, waiting and script helpers, and functions that workers run
(they import them from here, by name)."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from helpers import python

import aiopar
from aiopar.backends.process import ProcessBackend


def child_pids() -> set[int]:
    """Live (not yet reaped) child processes of this process."""
    me = str(os.getpid())
    children = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me:  # fields: state, ppid, ...
            children.add(int(entry))
    return children


def shared_memory() -> set[str]:
    # Semaphores are left out: aiopar makes none, and other programs on the
    # machine (multiprocessing's locks) come and go meanwhile.
    return {name for name in os.listdir("/dev/shm") if not name.startswith("sem.")}


@pytest.fixture(autouse=True)
def nothing_left_behind():
    """Every test leaves /dev/shm, the process table and the threads as it found them."""
    shm_before = shared_memory()
    children_before = child_pids()
    threads_before = set(threading.enumerate())
    yield
    assert shared_memory() - shm_before == set()
    assert not multiprocessing.active_children()
    deadline = time.monotonic() + 5
    while child_pids() - children_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child_pids() - children_before == set()
    leaked = [
        t for t in threading.enumerate() if t not in threads_before and t.name.startswith("aiopar-")
    ]
    for thread in leaked:
        thread.join(timeout=5)
    assert not [t for t in leaked if t.is_alive()]


@pytest.fixture(scope="module")
def pool():
    """A two-worker pool shared by the tests that do not break or stop it."""
    backend = ProcessBackend(2)
    # Start both workers now, so no test sees them as processes it started.
    aiopar.wait_all([backend.fork(sleep_then, 0.2, None) for _ in range(2)])
    yield backend
    backend.shutdown()


@pytest.fixture
def own_pool():
    """A one-worker pool of the test's own (to kill, cancel or shut down)."""
    backends = []

    def make(max_workers: int = 1, **options) -> ProcessBackend:
        backend = ProcessBackend(max_workers, **options)
        backends.append(backend)
        return backend

    yield make
    for backend in backends:
        backend.shutdown(cancel_pending=True)


def script_env() -> dict[str, str]:
    """The environment for a script that imports what this process does."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def run_script(tmp_path, source: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    return python(str(script), timeout=timeout, env=script_env(), cwd=tmp_path)


def exited(pid: int) -> bool:
    """Whether ``pid`` is gone or a zombie (its new parent may never reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


class FileGate:
    """A gate that tasks in worker processes wait at (:func:`until_opened`)
    until the test opens it: a file that appears."""

    def __init__(self, path: os.PathLike[str] | str) -> None:
        self.path = os.fspath(path)

    def open(self, *_: object) -> None:
        """Open the gate; the arguments of a done-callback are ignored."""
        with open(self.path, "w"):
            pass


# -- helpers that run in workers ---------------------------------------------


def until_opened(gate: str, value=None):
    """Run until the :class:`FileGate` at path ``gate`` is open; return ``value``."""
    while not os.path.exists(gate):
        time.sleep(0.005)
    return value


def die_once_opened(gate: str):
    until_opened(gate)
    os.kill(os.getpid(), signal.SIGKILL)


def add(a, b=0):
    return a + b


def pid_and_backend():
    return os.getpid(), aiopar.get_backend().name


def nested_fork():
    inner = aiopar.fork(pid_and_backend)
    return os.getpid(), inner.wait()


def explicit_process_fork():
    # Even asking for the process backend inside a worker stays in the worker.
    return aiopar.get_backend("process").fork(os.getpid).wait()


def kill_self(sig: int = signal.SIGKILL):
    os.kill(os.getpid(), sig)
    time.sleep(10)


def sleep_then_die(seconds: float):
    time.sleep(seconds)
    os.kill(os.getpid(), signal.SIGKILL)


def exit_now(code: int):
    os._exit(code)


def segfault():
    ctypes.string_at(0)


def sleep_then(seconds: float, value):
    time.sleep(seconds)
    return value


def fail_deep():
    def inner_helper():
        raise ValueError("the task failed on purpose")

    inner_helper()


def return_lock():
    return threading.Lock()


class Unpicklable(Exception):
    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def raise_unpicklable():
    raise Unpicklable("carries a lock")


def double(a):
    return a * 2


def echo(a):
    return a


class Scaler:
    def __init__(self, factor):
        self.factor = factor

    def scale(self, x):
        return x * self.factor

    def __call__(self, x):
        return x * self.factor


def square(x):
    return x * x


def fail_on_three(x):
    if x == 3:
        raise ValueError(f"item {x} failed on purpose")
    return x


def lock_on_three(x):
    return threading.Lock() if x == 3 else x


def touch_and_return(directory, x):
    with open(os.path.join(directory, str(x)), "w"):
        pass
    return x


def die_on(x, doomed):
    if x == doomed:
        os.kill(os.getpid(), signal.SIGKILL)
    return x


def meet(directory: str, count: int, timeout: float = 60.0):
    """Say this task started (a file named after the worker's pid and the
    time), then wait until ``count`` tasks have; return (the pid, whether
    they all did within ``timeout``)."""
    with open(os.path.join(directory, f"{os.getpid()}-{time.time_ns()}"), "w"):
        pass
    deadline = time.monotonic() + timeout
    while len(os.listdir(directory)) < count:
        if time.monotonic() > deadline:
            return os.getpid(), False
        time.sleep(0.005)
    return os.getpid(), True


class SlowToLoad:
    """A value whose unpickling says it started (a file ``gate + '.loading'``)
    and then waits at the :class:`FileGate` at path ``gate``."""

    def __init__(self, gate: str):
        self.gate = gate

    def __setstate__(self, state):
        self.__dict__.update(state)
        FileGate(self.gate + ".loading").open()
        until_opened(self.gate)


def slow_to_load(gate: str) -> SlowToLoad:
    return SlowToLoad(gate)


class Token:
    """A value a weak reference can watch."""


def make_token(_=None) -> Token:
    return Token()
