"""A worker's jobs in flight count the bytes queued behind the running one,
which bound what the pool sends ahead (prefetch) to a busy worker."""

from __future__ import annotations

import types
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from aiopar.backends._process_handle import Inflight
from aiopar.backends._process_pickle import Packed


def job(size: int) -> Any:
    return types.SimpleNamespace(packed=Packed(b"x" * size, [], None, None))


operations = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 5000)),
        st.tuples(st.sampled_from(["popleft", "remove", "clear"]), st.integers(0, 20)),
    ),
    max_size=40,
)


@given(operations)
def test_queued_bytes_are_those_behind_the_first(ops: list[tuple[str, int]]) -> None:
    inflight = Inflight()
    model: list[Any] = []
    for op, n in ops:
        if op == "append":
            item = job(n)
            inflight.append(item)
            model.append(item)
        elif op == "clear":
            inflight.clear()
            model.clear()
        elif model:
            if op == "popleft":
                assert inflight.popleft() is model.pop(0)
            else:
                item = model.pop(n % len(model))
                inflight.remove(item)
        assert list(inflight) == model
        assert inflight.queued_bytes == sum(len(j.packed.payload) for j in model[1:])
