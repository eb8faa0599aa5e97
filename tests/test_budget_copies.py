"""The places where the hot path spells out a function to save its call,
each against its original: Slot.first_task and Slot.end_spell count tokens
as Budget.take and Budget.give_back do, Slot.blocked learns as Slot._waits
does, _interrupt.acquire tells the main thread as on_main_thread does, and
the thread pool's idle path looks for queued work as _backlog does.
(tests/test_task.py does the same for the task's claim.)"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from aiopar import _budget, _budget_slots, _interrupt
from aiopar._budget import budget
from aiopar._budget_slots import Slot


@pytest.fixture
def ledger(monkeypatch):
    """The budget's count with nothing applied to the libraries: follow()
    and the per-thread libraries only record that they were called."""
    monkeypatch.setattr(budget, "tokens", type(budget.tokens)())
    monkeypatch.setattr(budget, "per_thread", [])
    monkeypatch.setattr(budget, "crowded_at", -1.0)
    monkeypatch.setattr(_budget_slots, "hook", _budget_slots.Occupancy())
    follows: list[bool] = []
    monkeypatch.setattr(budget, "follow", lambda *, now=False: follows.append(now))
    return follows


def _state(follows: list[bool]) -> tuple[Any, ...]:
    return len(budget.tokens), budget.crowded_at, list(follows)


def _each_budget_state(monkeypatch) -> list[Callable[[], None]]:
    """Ways to set the budget up: tokens held, the count applied or not,
    an explicit count or not."""

    def setup(tokens: int, applied: int | None, explicit: int | None) -> Callable[[], None]:
        def apply() -> None:
            budget.tokens.clear()
            budget.tokens.extend([None] * tokens)
            monkeypatch.setattr(budget, "applied", applied)
            monkeypatch.setattr(budget, "explicit", explicit)
            budget.crowded_at = -1.0

        return apply

    cores = _budget.cores()
    return [
        setup(tokens, applied, explicit)
        for tokens in (0, 1, 2, cores + 3)
        for applied in (None, 1, cores)
        for explicit in (None, 2)
    ]


def test_first_task_takes_a_token_as_take_does(ledger, monkeypatch):
    monkeypatch.setattr(_budget, "clock", lambda: 7.0)
    for setup in _each_budget_state(monkeypatch):
        setup()
        budget.take(7.0)
        by_take = _state(ledger)
        ledger.clear()
        setup()
        slot = Slot(is_worker=True)
        slot.first_task()
        assert slot.counted and slot.counted_since == 7.0
        assert _state(ledger) == by_take
        ledger.clear()


@pytest.mark.parametrize("ran", [True, False])
def test_end_spell_gives_the_token_back_as_give_back_does(ledger, monkeypatch, ran):
    for setup in _each_budget_state(monkeypatch):
        setup()
        budget.tokens.append(None)  # the slot's own
        budget.give_back(now=not ran)
        by_give_back = _state(ledger)
        ledger.clear()
        setup()
        budget.tokens.append(None)
        slot = Slot(is_worker=True)
        slot.busy, slot.counted, slot.ran = 1, True, ran
        slot.end_spell()
        assert not slot.counted
        assert _state(ledger) == by_give_back
        ledger.clear()


@pytest.mark.parametrize("wakes", [0, 1, 2])
@pytest.mark.parametrize("since_fork", [0.0, 0.5 * _budget_slots.WAITS_AT_ONCE, 1.0])
def test_blocked_learns_as_waits_does(monkeypatch, wakes, since_fork):
    monkeypatch.setattr(_budget, "clock", lambda: 100.0)

    def forker() -> Slot:
        slot = Slot(is_worker=False)
        slot.forked_at = 100.0 - since_fork
        slot.wakes = {Slot(is_worker=True) for _ in range(wakes)}
        return slot

    by_waits, by_blocked = forker(), forker()
    by_waits._waits()
    by_blocked.blocked()
    assert (by_blocked.forked_at, by_blocked.anticipates) == (
        by_waits.forked_at,
        by_waits.anticipates,
    )


class _Lock:
    """A lock whose acquire records the timeout it was given and succeeds."""

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self.timeouts.append(timeout)
        return True


@pytest.mark.parametrize("main", ["this thread", "another thread"])
def test_acquire_tells_the_main_thread_as_on_main_thread_does(monkeypatch, main):
    seen: list[tuple[bool, list[float]]] = []

    def look() -> None:
        lock = _Lock()
        _interrupt.acquire(lock)
        seen.append((_interrupt.on_main_thread(), lock.timeouts))

    other = threading.Thread(target=look)
    if main == "another thread":
        # Which thread is the main one is the module's _main_thread: as after os.fork().
        other.start()
        other.join()
        seen.clear()
        monkeypatch.setattr(_interrupt, "_main_thread", other.ident)
    look()
    on_main, timeouts = seen.pop()
    # On the main thread, a wait without a limit blocks in slices; elsewhere, in one piece.
    assert timeouts == ([_interrupt.SLICE] if on_main else [-1])
    assert on_main == (main == "this thread")


@pytest.mark.parametrize("where", ["a plain thread", "asyncio", "trio"])
def test_a_fork_counts_its_forker_only_where_no_event_loop_runs(ledger, where):
    # ThreadBackend._wake_worker spells out _bridge.running_async_library()
    # is None: a thread that runs an event loop awaits its forks, and never
    # counts beside them (rule 3 of aiopar._budget).
    from aiopar._bridge import running_async_library
    from aiopar.backends.thread import ThreadBackend

    seen: list[tuple[str | None, bool]] = []

    def fork_here() -> None:
        pool = ThreadBackend(max_workers=1)  # its first fork starts a worker
        gate = threading.Event()
        try:
            pool.fork(gate.wait, 10)  # the pool stays busy until it is looked at
            seen.append((running_async_library(), threading.get_ident() in pool._sharers))
        finally:
            gate.set()
            pool.shutdown()  # which waits for the task

    async def on_loop() -> None:
        fork_here()

    def run() -> None:
        if where == "asyncio":
            import asyncio

            asyncio.run(on_loop())
        elif where == "trio":
            trio = pytest.importorskip("trio")
            trio.run(on_loop)
        else:
            fork_here()

    thread = threading.Thread(target=run)  # a fresh thread: a fresh slot
    thread.start()
    thread.join(timeout=30)
    [(library, counted)] = seen
    assert counted == (library is None)
    assert (library is None) == (where == "a plain thread")


# The thread pool's idle path looks for queued work as `self._tasks or
# any(self._queues)`, marked "self._backlog(), inline": each such expression,
# read from the source, is true exactly when _backlog() is not zero.
_INLINE_BACKLOG = "# self._backlog(), inline"


def _inline_backlogs() -> list[str]:
    import inspect

    from aiopar.backends import thread

    source = inspect.getsource(thread)
    lines = [line for line in source.splitlines() if line.rstrip().endswith(_INLINE_BACKLOG)]
    expressions = []
    for line in lines:
        code = line.split("#", 1)[0].strip()
        assert code.startswith("if ") and code.endswith(":"), line
        expressions.append(code[3:-1])
    return expressions


def test_the_idle_path_spells_backlog_as_backlog_does():
    from collections import deque

    from aiopar.backends.thread import ThreadBackend

    expressions = _inline_backlogs()
    assert len(expressions) == 2, expressions  # a new copy is named here too
    pool = ThreadBackend(max_workers=1)
    try:
        for tasks in (0, 1, 3):
            for queued in ([], [0], [0, 0], [2], [0, 1], [1, 2]):
                pool._tasks = deque(range(tasks))  # type: ignore[assignment]
                pool._queues = tuple(deque(range(n)) for n in queued)
                backlog = pool._backlog()
                for expression in expressions:
                    inline = eval(expression, {"any": any}, {"self": pool})
                    assert bool(inline) == bool(backlog), (expression, tasks, queued)
    finally:
        pool._tasks, pool._queues = deque(), ()
        pool.shutdown()
