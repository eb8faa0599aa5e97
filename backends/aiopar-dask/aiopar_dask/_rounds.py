"""Each job its own rendezvous on a shared scheduler: the rounds of ranks that meet there.

A scheduler may serve one job after another (one that the user keeps
running). The ranked peers that meet there form rounds, kept in the
scheduler's metadata: each round's members (rank -> the peer's token), the
world size they gave, and those that said they leave (shutdown's barrier).
A ranked peer joins the current round unless it is complete (ranks 0 to
``world_size - 1`` have all joined it) or none of its members is on the
scheduler any more (a job that ended, or gave up); then it opens the next.
So ``init_rpc`` waits for the ranks of its own job, never counting those
of an earlier one (a rank that joined this round and left counts, as
torch's rendezvous counts it), and ``shutdown`` waits for the members of
its round only. Rounds are entered under a dask lock, :data:`LOCK`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["LOCK", "POLL", "enter", "leaving", "polls", "present", "staying", "wait_for_ranks"]

LOCK = "aiopar-rpc-ranks"  # the dask lock under which ids are chosen and rounds entered
_ROUNDS = "aiopar-rpc-rounds"  # metadata: {round: {"world_size", "members", "leaving"}}
_CURRENT = "aiopar-rpc-round"  # metadata: the current round
POLL = 0.05  # seconds before the first new look at the scheduler while waiting for peers


async def enter(scheduler: Any, token: str, rank: int, world_size: int | None) -> str:
    """Make the peer ``token`` rank ``rank`` of the current round, or of the
    next if the current one is complete or has no member left on the
    scheduler; return the round. The caller holds :data:`LOCK`. Raises
    ValueError if the round's members gave another ``world_size``."""
    current = await scheduler.get_metadata(keys=[_CURRENT], default=None)
    found = None if current is None else await _round(scheduler, current)
    if (
        found is None
        or _complete(found)
        or not set(found["members"].values()) & await _on(scheduler)
    ):
        current = "0" if current is None else str(int(current) + 1)
        found = {"world_size": None, "members": {}, "leaving": {}}
        await scheduler.set_metadata(keys=[_ROUNDS, current], value=found)
        await scheduler.set_metadata(keys=[_CURRENT], value=current)
    if world_size is not None:
        if found["world_size"] not in (None, world_size):
            members = ", ".join(sorted(found["members"], key=int))
            raise ValueError(
                f"the ranks of this job that joined so far ({members}) gave world_size "
                f"{found['world_size']}, and this one {world_size}: give every rank the same"
            )
        await scheduler.set_metadata(keys=[_ROUNDS, current, "world_size"], value=world_size)
    await scheduler.set_metadata(keys=[_ROUNDS, current, "members", str(rank)], value=token)
    return str(current)


async def wait_for_ranks(scheduler: Any, current: str, world_size: int, timeout: float) -> None:
    """Return once ranks 0 to ``world_size - 1`` have each joined round
    ``current``; TimeoutError naming the ranks that did not after
    ``timeout`` seconds (0: no limit)."""
    missing: list[int] = []
    async for _ in polls(time.monotonic() + timeout if timeout else None):
        found = await _round(scheduler, current)
        missing = [r for r in range(world_size) if str(r) not in found["members"]]
        if not missing:
            return
    raise TimeoutError(
        f"init_rpc waited {timeout:g} s for ranks 0 to {world_size - 1} to join, and "
        f"{_ranks(missing)} did not"
    )


async def leaving(scheduler: Any, current: str, token: str) -> None:
    """Say that the peer ``token`` of round ``current`` leaves (shutdown's barrier)."""
    await scheduler.set_metadata(keys=[_ROUNDS, current, "leaving", token], value=1)


async def present(scheduler: Any, current: str) -> set[str]:
    """The members of round ``current`` on the scheduler whose processes called ``init_rpc``."""
    found = await _round(scheduler, current)
    return set(found["members"].values()) & await _on(scheduler, joined=True)


async def staying(scheduler: Any, current: str) -> list[int]:
    """The ranks of the members of round ``current`` on the scheduler whose
    processes called ``init_rpc`` and have not said they leave."""
    found = await _round(scheduler, current)
    joined = await _on(scheduler, joined=True)
    return sorted(
        int(rank)
        for rank, token in found["members"].items()
        if token in joined and token not in found["leaving"]
    )


async def _round(scheduler: Any, current: str) -> dict[str, Any]:
    found: dict[str, Any] = await scheduler.get_metadata(keys=[_ROUNDS, current], default=None)
    return found


def _complete(found: dict[str, Any]) -> bool:
    size = found["world_size"]
    return size is not None and all(str(r) in found["members"] for r in range(size))


async def _on(scheduler: Any, joined: bool = False) -> set[str]:
    """The tokens of the peers on the scheduler (with ``joined``, of those
    whose processes called ``init_rpc``)."""
    identity = await scheduler.identity(n_workers=-1)
    return {
        w["aiopar_token"]
        for w in identity["workers"].values()
        if "aiopar_token" in w and (w.get("aiopar_joined") or not joined)
    }


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:10])) + (", ..." if len(ranks) > 10 else "")
    return f"rank {shown}" if len(ranks) == 1 else f"ranks {shown}"


async def polls(deadline: float | None) -> AsyncIterator[None]:
    """Look again at the scheduler until ``deadline``, more and more rarely
    (from 50 ms to 1 s apart), so a thousand waiting peers do not flood it."""
    delay = POLL
    while deadline is None or time.monotonic() < deadline:
        yield
        await asyncio.sleep(delay)
        delay = min(2 * delay, 1.0)
