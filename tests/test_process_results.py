"""Results are unpickled off the manager thread when that may take long, so
a result slow to unpickle holds up its own future only."""

from __future__ import annotations

import collections
import gc
import os
import pickle
import struct
import threading
import weakref

import process_helpers
import pytest
from helpers import eventually
from process_helpers import FileGate, add, make_token, run_script, slow_to_load

from aiopar.backends._process_results import calls_no_code

nothing_left_behind = process_helpers.nothing_left_behind
own_pool = process_helpers.own_pool


def test_a_result_slow_to_unpickle_holds_up_only_its_own_future(own_pool, tmp_path):
    backend = own_pool(2)
    gate = FileGate(tmp_path / "gate")
    slow = backend.fork(slow_to_load, gate.path)
    try:
        eventually(lambda: os.path.exists(gate.path + ".loading"))  # it is being unpickled
        quick = [backend.fork(add, i, 1) for i in range(4)]
        assert [future.wait(timeout=20) for future in quick] == [1, 2, 3, 4]
        assert not slow.done()
    finally:
        gate.open()
    assert slow.wait(timeout=20).gate == gate.path


@pytest.mark.parametrize(
    ("value", "quick"),
    [
        (1, True),
        ([1, "two", b"three", (4.0, None)], True),
        ({"a": [1]}, True),
        (range(3), False),
        (os.urandom(8192), False),
        # Plain data whose bytes hold an opcode's value (0x93, STACK_GLOBAL;
        # 0x82, EXT1): read opcode by opcode, it names no global.
        (struct.unpack("<d", b"\x93" * 8)[0], True),
        (0x82, True),
        ([struct.unpack("<d", b"\x84" * 8)[0], "x"], True),
        (collections.OrderedDict(a=struct.unpack("<d", b"\x93" * 8)[0]), False),
        ([b"\x93" * 300], False),  # too long to read: the longer way
    ],
)
def test_the_manager_unpickles_only_small_plain_data_itself(value, quick):
    assert calls_no_code(pickle.dumps(value, protocol=5)) is quick


def test_a_done_callback_on_an_unpickler_thread_may_shut_the_backend_down(tmp_path):
    # As one on the manager thread may: shutdown(wait=True) there cannot
    # wait for the manager, which waits for that callback's thread.
    done = run_script(
        tmp_path,
        """
        import threading
        from aiopar.backends.process import ProcessBackend

        backend = ProcessBackend(1)
        future = backend.fork(range, 3)  # unpickled off the manager thread
        returned = threading.Event()
        future.add_done_callback(lambda f: (backend.shutdown(wait=True), returned.set()))
        assert returned.wait(timeout=30), "shutdown in the callback did not return"
        backend.shutdown()
        print("shut down", list(future.wait(timeout=30)))
        """,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "shut down [0, 1, 2]\n"


def test_a_result_arrives_when_no_thread_can_be_started_to_unpickle_it(own_pool, monkeypatch):
    # As while the interpreter finalizes: the manager unpickles it itself.
    backend = own_pool(1)
    assert backend.fork(add, 1).wait(timeout=60) == 1  # the manager is up
    start = threading.Thread.start

    def refuse_unpicklers(thread):
        if thread.name.endswith("-unpickler"):
            raise RuntimeError("can't create new thread at interpreter shutdown")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse_unpicklers)
    assert backend.fork(range, 3).wait(timeout=20) == range(3)
    with pytest.raises(ZeroDivisionError):
        backend.fork(divmod, 1, 0).wait(timeout=20)


def test_a_result_is_held_by_its_future_alone(own_pool):
    # Once the future is gone, so is its value: no thread of the pool keeps
    # it (concurrent.futures' test_free_reference asks this of map).
    backend = own_pool(2)
    forked = [backend.fork(make_token) for _ in range(4)]
    for futures in (forked, backend.map(make_token, range(10))):
        for i in range(len(futures)):
            ref = weakref.ref(futures[i].wait(timeout=30))
            futures[i] = None
            gc.collect()
            assert ref() is None, i
