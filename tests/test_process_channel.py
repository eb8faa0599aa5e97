"""A worker whose socket carries anything but the frames it owes is a broken
worker: its tasks fail with BrokenWorkerError saying what it sent, a new
worker replaces it, and the rest of the pool carries on.

A task writes to its own worker's socket to send the parent what no sound
worker would. Each case runs in a script of its own: before the pool
handled this, its manager thread hung or died, and the script's waits
would have hung too.
"""

from __future__ import annotations

import process_helpers
import pytest
from process_helpers import run_script

nothing_left_behind = process_helpers.nothing_left_behind

SCRIPT = """
import gc, os, pickle, time
os.mkdir("met")
import aiopar
from aiopar import BrokenWorkerError
from aiopar.backends import _process_wire as wire
from aiopar.backends._process_pickle import Packed
from aiopar.backends import _process_pool
from aiopar.backends.process import ProcessBackend
from process_helpers import meet

_process_pool.STALL_TIMEOUT = 1.0


def scribble(what):
    channel = next(o for o in gc.get_objects() if isinstance(o, wire.Channel))
    if what == "unknown job":
        channel.send(wire.RESULT, 10**9, Packed(pickle.dumps(42), [], None, None))
    elif what == "huge header":
        header = wire._HEADER.pack(wire.RESULT, 0, 0, 0, 1, 0, 0, 2**62, 0, 0)
        os.write(channel.fileno(), header)
    elif what == "cut short":
        header = wire._HEADER.pack(wire.RESULT, 0, 0, 0, 1, 0, 0, 100, 0, 0)
        os.write(channel.fileno(), header + bytes(10))
    else:
        os.write(channel.fileno(), os.urandom(200))
    time.sleep(60)  # the parent kills this worker long before


backend = ProcessBackend(2, prefetch=0)
for future in [backend.fork(meet, os.getcwd() + "/met", 2) for _ in range(2)]:
    assert future.wait(timeout=60)[1]  # both workers are up
backend._pool.prefetch = 2  # from now on tasks queue on the workers
workers = {worker.pid for worker in backend._pool.workers}
other = backend.fork(time.sleep, 1.0)  # on the other worker, runs to the end
broken = backend.fork(scribble, WHAT)
behind = [backend.fork(os.getpid) for _ in range(3)]  # queued, some on the broken worker
try:
    broken.wait(timeout=30)
except BrokenWorkerError as exc:
    print("broken:", exc)
assert other.wait(timeout=30) is None
for future in behind:
    try:
        future.wait(timeout=30)
    except BrokenWorkerError as exc:
        print("behind:", exc)
os.mkdir("met-again")
after = [backend.fork(meet, os.getcwd() + "/met-again", 2) for _ in range(2)]
outcomes = [future.wait(timeout=60) for future in after]
assert all(met for _, met in outcomes), "two workers again"
assert {pid for pid, _ in outcomes} - workers, "a new worker replaced the broken one"
assert all(f.done() for f in [broken, other, *behind])
backend.shutdown()
print("carried on")
"""


@pytest.mark.parametrize(
    ("what", "words"),
    [
        ("unknown job", "a frame of kind 2 about job 1000000000, where it runs job"),
        ("huge header", "announcing 4611686018427387904 bytes"),
        ("random bytes", "a header"),
        ("cut short", "a frame cut short: nothing more of it came for 1.0 s"),
    ],
)
def test_a_worker_whose_socket_carries_what_it_does_not_owe_is_broken(tmp_path, what, words):
    done = run_script(tmp_path, SCRIPT.replace("WHAT", repr(what)), timeout=90)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "carried on", done.stdout
    broken = [line for line in lines if line.startswith("broken:")]
    assert len(broken) == 1 and words in broken[0], done.stdout
    assert "was killed: its socket carried" in broken[0]
    assert "killing" in done.stderr and "whose socket carried" in done.stderr
