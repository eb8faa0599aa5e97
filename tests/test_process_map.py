"""ProcessBackend.map: a chunk travels to its worker as one message and comes
back as one, with an outcome per item."""

from __future__ import annotations

import os
import threading

import process_helpers
import pytest
from helpers import eventually
from process_helpers import (
    FileGate,
    die_on,
    fail_on_three,
    lock_on_three,
    sleep_then,
    square,
    touch_and_return,
    until_opened,
)

import aiopar
from aiopar.backends import _process_wire as wire
from aiopar.backends.process import RemoteTraceback

# The shared fixtures; nothing_left_behind checks every test (autouse).
nothing_left_behind = process_helpers.nothing_left_behind
pool = process_helpers.pool
own_pool = process_helpers.own_pool


def test_a_chunk_is_one_message_each_way(own_pool):
    backend = own_pool(1)
    assert backend.fork(abs, -1).wait() == 1  # the worker is up
    channel = backend._pool.workers[0].channel
    sent, received = [], []
    send, recv = channel.send, channel.recv

    def recording_send(kind, *args, **kwargs):
        sent.append(kind)
        send(kind, *args, **kwargs)

    def recording_recv():
        frame = recv()
        received.append(None if frame is None else frame.kind)
        return frame

    channel.send, channel.recv = recording_send, recording_recv
    futures = backend.map(square, range(1000), chunksize=250)
    assert aiopar.wait_all(futures) == [x * x for x in range(1000)]
    assert sent == [wire.CHUNK] * 4
    assert received == [wire.RESULT] * 4


def test_an_item_s_failure_fails_its_future_only(pool):
    futures = pool.map(fail_on_three, range(6), chunksize=6)
    assert [f.wait(timeout=30) for i, f in enumerate(futures) if i != 3] == [0, 1, 2, 4, 5]
    with pytest.raises(ValueError, match="item 3 failed on purpose") as info:
        futures[3].wait()
    assert isinstance(info.value.__cause__, RemoteTraceback)
    assert "fail_on_three" in info.value.__cause__.tb
    assert "_process_worker" not in info.value.__cause__.tb  # starts at the user's code


def test_an_item_whose_value_does_not_pickle_fails_alone(pool):
    futures = pool.map(lock_on_three, range(5), chunksize=5)
    with pytest.raises(TypeError, match=r"lock_on_three returned a _thread\.lock"):
        futures[3].wait(timeout=30)
    assert [f.wait() for i, f in enumerate(futures) if i != 3] == [0, 1, 2, 4]


def test_items_that_do_not_pickle_fail_at_map(pool):
    with pytest.raises(TypeError, match=r"the arguments of item 1 \(a builtins\.tuple\)"):
        pool.map(square, [1, threading.Lock()])


def test_an_item_cancelled_before_its_chunk_is_sent_is_skipped(own_pool, tmp_path):
    backend = own_pool(1, prefetch=0)
    gate = FileGate(tmp_path / "gate")
    items = tmp_path / "items"
    items.mkdir()
    running = backend.fork(until_opened, gate.path, "first")  # holds the one worker
    eventually(running.running)
    futures = backend.map(touch_and_return, [str(items)] * 4, range(4), chunksize=4)
    assert futures[2].cancel()
    gate.open()
    assert running.wait(timeout=30) == "first"
    assert [f.wait(timeout=30) for i, f in enumerate(futures) if i != 2] == [0, 1, 3]
    assert futures[2].cancelled()
    assert sorted(os.listdir(items)) == ["0", "1", "3"]  # item 2 never ran


def test_a_sent_chunk_can_no_longer_be_cancelled(own_pool):
    backend = own_pool(1)
    futures = backend.map(sleep_then, [0.2, 0.0], ["a", "b"], chunksize=2)
    eventually(futures[0].running)
    assert not futures[1].cancel()
    assert aiopar.wait_all(futures) == ["a", "b"]


def test_shutdown_that_cancels_the_queue_cancels_a_queued_chunk_s_items(own_pool, tmp_path):
    backend = own_pool(1, prefetch=0)
    gate = FileGate(tmp_path / "gate")
    running = backend.fork(until_opened, gate.path, "ran")
    eventually(running.running)
    queued = backend.map(square, range(10), chunksize=5)
    queued[-1].add_done_callback(gate.open)  # the task ends once shutdown has cancelled them
    backend.shutdown(cancel_pending=True)
    assert running.value() == "ran"
    assert all(f.cancelled() for f in queued)


def test_a_worker_that_dies_fails_the_items_of_its_chunk_only(own_pool):
    backend = own_pool(1)
    doomed = backend.map(die_on, range(4), [2] * 4, chunksize=4)
    later = backend.map(square, range(4), chunksize=2)
    for future in doomed:
        with pytest.raises(aiopar.BrokenWorkerError, match="SIGKILL"):
            future.wait(timeout=30)
    assert aiopar.wait_all(later) == [0, 1, 4, 9]


def test_aiopar_map_on_the_process_backend(pool):
    with aiopar.use_backend(pool):
        futures = aiopar.map(square, range(100))
    assert aiopar.wait_all(futures) == [x * x for x in range(100)]
