"""How the process backend pickles a call: big buffers leave the pickle."""

from __future__ import annotations

import numpy as np
import pytest

from aiopar._shm import SegmentPool
from aiopar.backends import _process_pickle as pickling


class Holder:
    def __init__(self, array):
        self.array = array


@pytest.mark.parametrize(
    "where",
    ["argument", "strided", "fortran", "closure", "global", "object", "nested", "result"],
)
def test_arrays_anywhere_leave_the_pickle(where):
    segments = SegmentPool()
    a = np.arange(1_000_000, dtype=np.float64)  # 8 MB
    shared = {"__name__": "__main__"}
    exec("def read_global():\n    return A.sum()\n", shared)
    shared["A"] = a
    calls = {
        "argument": (np.sum, (a,)),
        "strided": (np.sum, (np.arange(2_000_000.0)[::2],)),
        "fortran": (np.sum, (np.asfortranarray(a.reshape(1000, 1000)),)),
        "closure": (lambda: a.sum(), ()),
        "global": (shared["read_global"], ()),
        "object": (len, (Holder(a),)),
        "nested": (len, ([{"k": (a,)}],)),
    }
    try:
        if where == "result":
            packed = pickling.pack(np.arange(2_000_000.0)[::2], segments, by_value=False)
        else:
            fn, args = calls[where]
            packed = pickling.pack_call(fn, args, {}, segments)
        assert len(packed.payload) < pickling.LARGE_BUFFER
        assert packed.segment is not None and sum(packed.lengths) >= a.nbytes
        packed.discard()
    finally:
        segments.close()
