"""What the ranks of test_torch_rpc run: the rank processes' entry points,
and the functions and classes of torch's rpc_test.py, on numpy arrays.

Everything here travels by name, so the rank processes import it from this
module (the tests directory is on their path). Names follow torch's.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import pickle
import sys
import threading
import time
from collections import namedtuple
from pathlib import Path

import numpy as np
import psutil

import aiopar
from aiopar import rpc

WORLD_SIZE = 4
TESTS_DIR = str(Path(__file__).resolve().parent)
# The network interface of 127.0.0.1, where the ranks' gloo process groups
# (test_deadlock) talk: on loopback, as the ranks' clusters.
LOOPBACK_INTERFACE = next(
    name
    for name, addresses in psutil.net_if_addrs().items()
    if any(address.address == "127.0.0.1" for address in addresses)
)
# How long a rank process serves at most: a test module that dies without
# shutting down leaves no rank behind for longer than this.
SERVE_LIMIT = 240.0


def worker_name(rank: int) -> str:
    return f"worker{rank}"


def options(address: str, **kw) -> rpc.RpcBackendOptions:
    """The options every rank joins with: few threads, for a 2-core machine."""
    kw.setdefault("num_worker_threads", 8)
    return rpc.RpcBackendOptions(init_method=address, **kw)


def rank_command(entry: str, *args: object) -> list[str]:
    """The command that runs ``torch_rpc_helpers.<entry>(*args)`` in a fresh interpreter."""
    call = f"import torch_rpc_helpers as h; h.{entry}(*{tuple(args)!r})"
    return [sys.executable, "-c", call]


def rank_env() -> dict[str, str]:
    """This environment with the tests directory first on the path, and gloo on loopback."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME=LOOPBACK_INTERFACE)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (TESTS_DIR, env.get("PYTHONPATH")) if p)
    return env


# -- the rank processes' entry points ----------------------------------------------


def serve_rank(rank: int, address: str) -> None:
    """Rank ``rank`` of the module's world: join, serve until every peer has
    called shutdown (the graceful barrier), leave."""
    rpc.init_rpc(
        worker_name(rank),
        backend=rpc.BackendType.TENSORPIPE,
        rank=rank,
        world_size=WORLD_SIZE,
        rpc_backend_options=options(address),
    )
    rpc.shutdown(timeout=SERVE_LIMIT)
    print(f"rank {rank} done", flush=True)


def barrier(directory: str | Path, rank: int, world_size: int, timeout: float = 60) -> None:
    """A barrier through files, for tests whose peers must meet when rpc is down."""
    Path(directory).mkdir(exist_ok=True)
    Path(directory, f"rank{rank}").touch()
    deadline = time.monotonic() + timeout
    while not all(Path(directory, f"rank{r}").exists() for r in range(world_size)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the barrier in {directory} timed out")
        time.sleep(0.02)


def join(rank: int, address: str, world_size: int, **kw) -> None:
    rpc.init_rpc(
        worker_name(rank),
        rank=rank,
        world_size=world_size,
        rpc_backend_options=options(address, **kw),
    )


def lifecycle_reinit(rank: int, address: str, world_size: int) -> None:
    join(rank, address, world_size)
    try:
        join(rank, address, world_size)
    except RuntimeError as exc:
        assert "already" in str(exc), exc
    else:
        raise AssertionError("a second init_rpc did not raise")
    rpc.shutdown()


def lifecycle_init_rpc_twice(rank: int, address: str, world_size: int, directory: str) -> None:
    join(rank, address, world_size)
    rpc.shutdown()
    barrier(Path(directory, "down"), rank, world_size)
    join(rank, address, world_size)
    # init_rpc's world_size counts the ranks that joined before, so the second
    # one returns before the other rank is back: meet first (torch's waits)
    barrier(Path(directory, "up"), rank, world_size)
    dst = worker_name((rank + 1) % world_size)
    assert np.array_equal(rpc.rpc_sync(dst, np.add, args=(np.ones((2, 2)), 1)), np.ones((2, 2)) + 1)
    assert np.array_equal(rpc.rpc_sync(dst, foo_add, args=()), np.full(1, 2.0))
    rpc.shutdown()


def lifecycle_shutdown_followed_by_rpc(rank: int, address: str, world_size: int) -> None:
    join(rank, address, world_size)
    n = rank + 1
    dst = worker_name(n % world_size)
    ret = rpc.rpc_sync(dst, np.add, args=(np.ones((n, n)), np.ones((n, n))))
    assert np.array_equal(ret, np.ones((n, n)) * 2)
    rpc.shutdown()
    try:
        rpc.rpc_sync(dst, np.add, args=(np.ones((n, n)), np.ones((n, n))))
    except RuntimeError as exc:
        assert str(exc).startswith("RPC has not been initialized"), exc
    else:
        raise AssertionError("rpc_sync after shutdown did not raise")


def lifecycle_local_shutdown(rank: int, address: str, world_size: int) -> None:
    join(rank, address, world_size)
    rpc.shutdown(graceful=False)


def lifecycle_local_shutdown_with_rpc(
    rank: int, address: str, world_size: int, directory: str
) -> None:
    join(rank, address, world_size)
    n = rank + 1
    ret = rpc.rpc_sync(worker_name(n % world_size), np.add, args=(np.ones((n, n)), np.ones((n, n))))
    assert np.array_equal(ret, np.ones((n, n)) * 2)
    barrier(directory, rank, world_size)  # every call has its reply
    rpc.shutdown(graceful=False)


def lifecycle_use_rref_after_shutdown(rank: int, address: str, world_size: int) -> None:
    join(rank, address, world_size)
    n = rank + 1
    rref = rpc.remote(worker_name(n % world_size), np.add, args=(np.ones((n, n)), np.ones((n, n))))
    rpc.shutdown(graceful=True)
    try:
        rref.to_here()
    except RuntimeError as exc:
        assert "RPC has not been initialized" in str(exc), exc
    else:
        raise AssertionError("to_here after shutdown did not raise")


def lifecycle_duplicate_name(rank: int, address: str) -> None:
    """Join under the name rank 0 has: init_rpc must refuse it."""
    try:
        rpc.init_rpc("worker0", rank=rank, world_size=2, rpc_backend_options=options(address))
    except ValueError as exc:
        print(f"ValueError: {exc}", flush=True)
    else:
        rpc.shutdown(graceful=False)
        raise AssertionError("a duplicate name was accepted")


def lifecycle_leave_at_once(rank: int, address: str, world_size: int) -> None:
    """Join, and leave without waiting for anyone."""
    join(rank, address, world_size)
    rpc.shutdown(graceful=False)


# -- bodies that test_torch_rpc runs on every rank ------------------------------------
#
# torch's harness runs a test body on every rank; one whose assertions name
# the caller's rank, or that branches on it, runs here as a function of the
# rank, sent to each rank (test_torch_rpc.on_every_rank).


def raised(exc_type: type[BaseException], fn, *args, **kwargs) -> BaseException:
    """The ``exc_type`` exception that ``fn(*args, **kwargs)`` raises
    (pytest.raises for the rank processes, which do not import pytest)."""
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        return exc
    raise AssertionError(f"{fn!r} raised no {exc_type.__name__}")


def worker_id_body(rank: int) -> None:
    peer_rank = (rank + 1) % WORLD_SIZE
    self_worker_info = rpc.get_worker_info()
    peer_worker_info = rpc.get_worker_info(worker_name(peer_rank))
    assert self_worker_info.name == worker_name(rank), self_worker_info
    assert self_worker_info.id == rank, self_worker_info
    assert peer_worker_info.name == worker_name(peer_rank), peer_worker_info
    assert peer_worker_info.id == peer_rank, peer_worker_info
    assert rpc.get_worker_info(peer_rank) == peer_worker_info  # by id too
    # aiopar: ValueError listing the peers (torch: RuntimeError)
    error = raised(ValueError, rpc.get_worker_info, "WorkerUnknown")
    assert "no rpc peer called 'WorkerUnknown'" in str(error), error
    assert all(worker_name(r) in str(error) for r in range(WORLD_SIZE)), error


def local_value_not_on_owner_body(rank: int) -> None:
    next_rank = (rank + 1) % WORLD_SIZE
    rref = rpc.remote(worker_name(next_rank), np.add, args=(np.ones(1), np.ones(1)))
    # torch's message names the RRef, this peer and the owner, each with its
    # id; aiopar's names the RRef (its owner and id) and this peer
    error = raised(RuntimeError, rref.local_value)
    assert str(error) == (
        f"local_value() is for the owner of RRef(owner={worker_name(next_rank)}, id={rref._id}), "
        f"and this peer is '{worker_name(rank)}': call to_here() to copy it here"
    ), error
    assert not rref.is_owner()


def rref_str_body(rank: int) -> None:
    # aiopar: RRef(owner=<name>, id=<id>) (torch: OwnerRRef(...)/UserRRef(...),
    # with the ids of the RRef and of this copy)
    rref1 = rpc.RRef(rank)
    assert str(rref1) == f"RRef(owner={worker_name(rank)}, id={rref1._id})", rref1
    next_name = worker_name((rank + 1) % WORLD_SIZE)
    rref2 = rpc.remote(next_name, np.add, args=(np.ones((2, 2)), 1))
    assert str(rref2) == f"RRef(owner={next_name}, id={rref2._id})", rref2
    assert len({rref1._id, rref2._id, rpc.RRef(rank)._id}) == 3


def owner_equality_body(rank: int) -> None:
    a = rpc.RRef(40)
    b = rpc.RRef(50)
    next_name = worker_name((rank + 1) % WORLD_SIZE)
    other_a = rpc.remote(next_name, np.add, args=(np.ones(1), 1))
    other_b = rpc.remote(next_name, np.add, args=(np.ones(1), 1))
    other_a.to_here()  # to ensure clean termination
    other_b.to_here()

    assert a.owner() != 23
    assert other_a.owner() == other_b.owner()
    assert a.owner() != other_a.owner()
    assert other_a.owner() == other_a.owner()
    assert a.owner() == a.owner()
    assert a.owner() == b.owner()
    assert a.owner() == rpc.get_worker_info()
    x = {}
    x[a.owner()] = a
    x[other_a.owner()] = other_a
    assert x[a.owner()] is a
    assert x[b.owner()] is a
    assert x[other_a.owner()] is other_a
    assert x[other_b.owner()] is other_a
    assert len(x) == 2
    # and the names (not in torch's test)
    assert a.owner_name() == worker_name(rank)
    assert other_a.owner_name() == next_name


def raise_in_user_func_body(rank: int) -> None:
    fut = rpc.rpc_async(worker_name((rank + 1) % WORLD_SIZE), raise_func)
    error = raised(ValueError, fut.wait)
    assert str(error) == expected_err, error


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_RPC_LOGGER = logging.getLogger("aiopar.rpc")
_capture: tuple[_Records, int] | None = None


def capture_rpc_log() -> None:
    """Record what this process logs on the ``aiopar.rpc`` logger, at every
    level, until :func:`captured_rpc_log` (torch's test captures stderr)."""
    global _capture
    assert _capture is None, "capturing already"
    _capture = (_Records(), _RPC_LOGGER.level)
    _RPC_LOGGER.addHandler(_capture[0])
    _RPC_LOGGER.setLevel(logging.DEBUG)


def captured_rpc_log() -> list[tuple[int, str]]:
    """Stop recording; what was logged: (level, message and traceback) each."""
    global _capture
    assert _capture is not None, "not capturing"
    (handler, level), _capture = _capture, None
    _RPC_LOGGER.removeHandler(handler)
    _RPC_LOGGER.setLevel(level)
    return [(record.levelno, handler.format(record)) for record in handler.records]


def has_gloo() -> bool:
    """Whether torch is installed here, with gloo process groups."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_gloo_available()


def add_once_exists(path: str, x, y):
    """``x + y``, once ``path`` exists (test_deadlock's slow call)."""
    deadline = time.monotonic() + 15
    while not Path(path).exists():
        assert time.monotonic() < deadline, f"{path} was never made"
        time.sleep(0.01)
    return x + y


def deadlock_body(rank: int, store: str) -> None:
    """torch's test_deadlock (torch issue 45089) on ranks 1 and 2: rank 1
    waits for a call to rank 2 while rank 2 starts a gloo process group,
    which waits for rank 1. torch's call sleeps so that rank 2 gets there;
    this one returns once rank 2's store file exists, which rank 2 makes
    as it starts the group, so rank 2 is seen to serve it from there."""
    import torch.distributed as dist

    if rank == 1:
        dst1 = worker_name((rank + 1) % WORLD_SIZE)
        x = np.ones(2)
        y = np.ones(2)
        ret = rpc.rpc_async(dst1, add_once_exists, args=(store, x, y), timeout=15).wait()
        assert np.array_equal(ret, x + y), ret

    assert not dist.is_initialized()
    dist.init_process_group(
        backend="gloo",
        init_method=Path(store).as_uri(),
        rank=rank - 1,
        world_size=2,
        timeout=datetime.timedelta(seconds=30),  # an error, not a hang, if a rank is missing
    )
    dist.destroy_process_group()  # (torch's harness ends the process instead)


VALUE_FUTURE: concurrent.futures.Future = concurrent.futures.Future()


def reset_value() -> None:
    global VALUE_FUTURE
    VALUE_FUTURE = concurrent.futures.Future()


def set_value(value):
    VALUE_FUTURE.set_result(value)


def wait_for_value_future():
    return VALUE_FUTURE.result(timeout=30)


def expected_src_body(rank: int) -> int:
    """torch's test_expected_src on one rank: tell the next rank who calls,
    and return who called this one."""
    rpc.rpc_sync(worker_name((rank + 1) % WORLD_SIZE), set_value, args=(rank,))
    return VALUE_FUTURE.result(timeout=30)


# -- torch's rpc_test.py functions, on numpy arrays -------------------------------------


def foo_add():
    return np.add(np.ones(1), np.ones(1))


def remove_foo_add() -> None:
    """Make this process's module lose ``foo_add`` (test_function_not_on_callee)."""
    del sys.modules[__name__].foo_add


def restore_foo_add() -> None:
    sys.modules[__name__].foo_add = foo_add_kept


foo_add_kept = foo_add


def return_callee_id() -> int:
    return rpc.get_worker_info().id


def my_function(a, b, c):
    return a + b + c


def my_tensor_function(a, b):
    return a + b


def my_sleep_func(seconds=1):
    time.sleep(seconds)
    return np.multiply(1, 1)


def delayed_add(a, b, seconds=0.05):
    time.sleep(seconds)
    return a + b


def no_result():
    print("do nothing")


def raise_or_inc(value):
    if value.size == 2:
        raise ValueError("Expected error")
    return value + 1


def nested_rpc(dst):
    return rpc.rpc_sync(dst, np.add, args=(np.ones((2, 2)), 1))


NESTED_HOPS = 0
_hops_lock = threading.Lock()


def multi_layer_nested_async_rpc(dst, world_size, ttl):
    # returns at once, but makes further calls: the hops are counted, so the
    # test can see that every one of them ran
    global NESTED_HOPS
    if ttl > 0:
        with _hops_lock:
            NESTED_HOPS += 1
        current_dst = worker_name(dst)
        next_dst = (dst + 1) % world_size
        rpc.rpc_async(
            current_dst, multi_layer_nested_async_rpc, args=(next_dst, world_size, ttl - 1)
        )
        return 0


def nested_hops(reset: bool = False) -> int:
    global NESTED_HOPS
    with _hops_lock:
        hops = NESTED_HOPS
        if reset:
            NESTED_HOPS = 0
    return hops


def nested_rref(dst):
    return (
        rpc.remote(dst, np.add, args=(np.ones((2, 2)), 1)),
        rpc.remote(dst, np.add, args=(np.ones((2, 2)), 2)),
    )


def nested_remote(dst):
    rref = rpc.remote(dst, np.add, args=(np.ones((2, 2)), 3))
    return rref.to_here()


def rref_forward_chain(dst, world_size, rref, ttl):
    if ttl > 0:
        current_dst = worker_name(dst)
        next_dst = (dst + 1) % world_size
        ret_rref = rpc.remote(
            current_dst, rref_forward_chain, args=(next_dst, world_size, rref, ttl - 1)
        )
        return [ret_rref]
    return rref.to_here()


def rpc_return_rref(dst):
    return rpc.remote(dst, np.add, args=(np.ones((2, 2)), 1))


def light_rpc():
    return 0


def heavy_rpc(tensor):
    for i in range(1, 100):
        tensor *= i
        tensor /= i + 1
    return 0


expected_err = "Expected error"


def raise_func():
    raise ValueError(expected_err)


expected_err_escape = "\nFirst line of error \n next line of error \n last line of error"


def raise_func_escape():
    raise ValueError(expected_err_escape)


global_rref = None


def set_global_rref(rref):
    global global_rref
    global_rref = rref


def clear_global_rref():
    global global_rref
    global_rref = None


def check_rref_confirmed(rref):
    return rref.confirmed_by_owner()


def add_rref_to_value(rref, value):
    return rref.to_here() + value


def my_rref_function(rref_a, rref_b):
    return rref_a.to_here() + rref_b.to_here()


def add_use_future_cb(to, x, y, z):
    out = concurrent.futures.Future()

    def callback(fut):
        out.set_result(fut.wait() + z)

    fut = rpc.rpc_async(to, np.add, args=(x, y))
    fut.then(callback)
    return out.result(timeout=30)


def add_use_future_set_result(to, x, y, z):
    out = aiopar.Future()
    fut = rpc.rpc_async(to, np.add, args=(x, y))
    fut.then(lambda fut: out.set_result(fut.wait() + z))
    return out.wait(timeout=30)


def add_use_future_nested_cb(to, x, y, z):
    out = aiopar.Future()

    def callback(fut1):
        fut2 = rpc.rpc_async(to, np.add, args=(fut1.wait(), z))
        fut2.then(lambda fut2: out.set_result(fut2.wait()))

    fut1 = rpc.rpc_async(to, np.add, args=(x, y))
    fut1.then(callback)
    return out.wait(timeout=30)


def fail_on_fut(fut):
    pass


@rpc.functions.async_execution
def async_raise_func():
    raise RuntimeError("Expected error")


@rpc.functions.async_execution
def async_wrong_type():
    return np.zeros((2, 2))


@rpc.functions.async_execution
def async_add(to, x, y):
    return rpc.rpc_async(to, np.add, args=(x, y))


@rpc.functions.async_execution
def async_add_with_future_ctor(to, x, y, z):
    fut = aiopar.Future()
    rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut1: fut.set_result(fut1.wait() + z))
    return fut


@rpc.functions.async_execution
def async_add_chained(to, x, y, z):
    return rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_add_chained_multi(to, x, num, step):
    fut = rpc.rpc_async(to, np.add, args=(x, 0))
    for _ in range(num):
        fut = fut.then(lambda fut: fut.wait() + step)
    return fut


@rpc.functions.async_execution
def async_add_nested(to, x, y, z):
    return rpc.rpc_async(to, async_add, args=(to, x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def async_add_multi_fanout(to, x, num, step):
    futs = []
    for i in range(num):
        if i == 0:
            futs.append(rpc.rpc_async(to, np.add, args=(x, step)))
        else:
            futs.append(rpc.rpc_async(to, np.add, args=(0, step)))

    lock = threading.Lock()
    state = {"cnt": 0, "ret": np.zeros_like(x)}
    ret_future = aiopar.Future()

    def inc_and_set(fut):
        with lock:
            state["cnt"] += 1
            state["ret"] += fut.wait()
            if state["cnt"] >= len(futs):
                ret_future.set_result(state["ret"])

    for fut in futs:
        fut.then(inc_and_set)

    return ret_future


class AsyncExecutionClass:
    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to, x, y, z):
        return rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to, x, y, z):
        ret_fut = aiopar.Future()
        rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut: ret_fut.set_result(fut.wait() + z))
        return ret_fut

    @rpc.functions.async_execution
    def bound_async_add(self, to, x, y, z):
        return rpc.rpc_async(to, np.add, args=(x, y)).then(lambda fut: fut.wait() + z)


def return_future():
    return aiopar.Future()


TensorClass = namedtuple("TensorClass", ["tensors"])


class MyPickleClass:
    """Runs a function while it is unpickled (torch's runs an rpc UDF there)."""

    def __init__(self):
        self.t = None

    def __getstate__(self):
        return (my_tensor_function, (np.ones((2, 2)), np.ones((2, 2))))

    def __setstate__(self, obj):
        func, args = obj
        self.t = func(*args)

    def set(self, val):
        self.t = val


class SlowPickleClass:
    def __init__(self, t):
        self.t = t

    def __getstate__(self):
        time.sleep(self.t)
        return (self.t,)

    def __setstate__(self, obj):
        self.t = obj[0]
        time.sleep(self.t)


class MyClass:
    def __init__(self, a, delay=False):
        self.a = a
        # delay initialization to simulate errors if specified
        if delay:
            time.sleep(0.5)

    def my_instance_method(self, b):
        return self.a + b

    @classmethod
    def my_class_method(cls, d, e):
        return d + e

    @staticmethod
    def my_static_method(f):
        return f > 10

    def increment_value(self, increment):
        self.a += increment

    def get_value(self):
        return self.a

    def my_slow_method(self, my_tensor_arg):
        time.sleep(1)
        return np.add(self.a, my_tensor_arg)


def _call_method_on_rref(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def get_rref_list(values):
    return [rpc.RRef(MyClass(a)) for a in values]


def run_nested_pickle(pickle_cls_instance, tensor):
    return pickle_cls_instance.t + tensor


def build_complex_tensors():
    a = np.ones((3, 3))
    b = [a, a]
    c = [b, b]
    d = [a, b]
    e = {"a": d}  # torch keys it by the tensor; arrays are not hashable
    return [a, b, c, d, e]


def my_complex_tensor_function(list_input, tensor_class_input, dict_input):
    res = list_input[0]
    for t in list_input:
        res += t
    for v in dict_input.values():
        res += v
    complex_tensors = tensor_class_input.tensors
    return (res, complex_tensors[0], complex_tensors[1], complex_tensors[2])


def non_cont_test(t_view, t_cont):
    """What the callee got: whether the view still is one, and the values."""
    return (t_view.flags.c_contiguous, np.array_equal(t_view, t_cont), t_view)


timed_out_rpc_event = threading.Event()


def timed_out_rpc():
    timed_out_rpc_event.wait(timeout=30)


def release_timed_out_rpc():
    timed_out_rpc_event.set()


def reset_timed_out_rpc():
    timed_out_rpc_event.clear()


def pickled_size(obj) -> int:
    return len(pickle.dumps(obj))


def owns(rref_id: str) -> bool:
    """Whether this peer still holds the value of the RRef ``rref_id``."""
    from aiopar.rpc import _rref

    with _rref._owned_lock:
        return rref_id in _rref._owned
