"""How the results of dask tasks come back: in groups, as they complete.

A gather costs two of dask's round trips (who has the value, then the value
itself), and a gather per task made forks a third dearer than dask's own
tasks on a 2-core machine. Here the tasks in flight are watched together
(``distributed.as_completed``): whenever some have completed, their values
come back in one gather, and ``on_done`` gets them all in one call, on the
client's event loop, where the gather ends (it must not block there). While
other tasks are still running, a group waits ``GROUP_WINDOW`` seconds for
more to join it. A task sent while no other is in flight (a fork waited for
at once) is fetched alone, as soon as it completes, by a gather of its own:
the quickest way back.

Such a task's dask future is kept until the next task is sent, or for
``KEEP_ALONE`` seconds if none is, and only then let go (which releases its
key), so that the release reaches the scheduler behind the next fork's
graph, as raw dask's ``submit(...).result()`` in a loop has it. Released at
once, it went ahead of that graph, and the scheduler's message to the worker
to free the key started the worker stream's 5 ms batch interval, which the
next fork's ``compute-task`` then waited out: sequential forks took
1.08-1.15x raw dask's time.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from typing import Any

import distributed

__all__ = ["GROUP_WINDOW", "Done", "Results"]

GROUP_WINDOW = 0.005  # seconds a group waits for more tasks to complete, while others run
KEEP_ALONE = 0.01  # seconds a task fetched alone keeps its key when no other is sent (dask's
# client sends to the scheduler in batches this far apart)

# What came of each task of a group: its dask future, and its value or what gathering raised.
Done = list[tuple[distributed.Future[Any], Any, BaseException | None]]


class Results:
    """Fetches the results of ``client``'s tasks as they complete and hands
    each group to ``on_done(group)``, on the client's loop."""

    def __init__(self, client: distributed.Client, on_done: Callable[[Done], object]) -> None:
        self._client = client
        self._on_done = on_done
        self._completed = distributed.as_completed(loop=client.loop)
        self._lock = threading.Lock()
        self._tracked = 0  # tasks whose results have not been handed on
        self._collecting = False  # a _collect coroutine runs on the client's loop
        self._kept: distributed.Future[Any] | None = None  # the last task fetched alone
        self._keeps = 0  # tasks kept so far: which one a timer lets go of

    def expect(self, futures: list[distributed.Future[Any]]) -> None:
        """Fetch the results of these futures' tasks as they complete. Any thread."""
        loop = self._client.loop
        assert loop is not None  # (a client that has started)
        with self._lock:
            kept, self._kept = self._kept, None
            alone = len(futures) == 1 and not self._tracked
            self._tracked += len(futures)
            if alone:
                start: Callable[..., object] = functools.partial(self._fetch_alone, futures[0])
            else:
                self._completed.update(futures)
                if self._collecting:
                    return
                self._collecting = True
                start = self._collect
        loop.add_callback(start)
        # After the caller's submit, whose graph is on its way to the loop already.
        del kept

    async def _fetch_alone(self, future: distributed.Future[Any]) -> None:
        """On the client's loop: the result of a task sent alone, once it completes."""
        try:
            (value,) = await self._client.gather([future], asynchronous=True)
        except BaseException as exc:  # erred, cancelled, lost: the task's own outcome
            done: Done = [(future, None, exc)]
        else:
            done = [(future, value, None)]
        # Kept before the aiopar future settles: the next fork, which its
        # waiter may send at once, lets go of it.
        with self._lock:
            self._kept = future
            self._keeps += 1
            keeps = self._keeps
        asyncio.get_running_loop().call_later(KEEP_ALONE, self._let_go, keeps)
        self._hand_on(done)

    def _let_go(self, keeps: int) -> None:
        """On the client's loop: let go of the task kept, if it is still the
        ``keeps``-th and no task was sent since."""
        with self._lock:
            if keeps != self._keeps:
                return
            kept, self._kept = self._kept, None
        del kept

    def _hand_on(self, done: Done) -> None:
        with self._lock:
            self._tracked -= len(done)
        self._on_done(done)

    async def _collect(self) -> None:
        """On the client's loop: each group of completed tasks, fetched and
        handed on, until none is in flight."""
        completed = self._completed
        while True:
            try:
                first = await anext(completed)
            except StopAsyncIteration:
                with self._lock:  # (what expect() adds meanwhile is seen here)
                    if completed.is_empty():
                        self._collecting = False
                        return
                continue
            group = [first, *completed.next_batch(block=False)]
            if not completed.is_empty():  # others run: let some complete, fetch them together
                await asyncio.sleep(GROUP_WINDOW)
                group += completed.next_batch(block=False)
            self._hand_on(await self._fetch(group))

    async def _fetch(self, group: list[distributed.Future[Any]]) -> Done:
        """The values of ``group`` (complete), in one gather if all finished;
        one by one otherwise, so a failure stays with its own task."""
        client = self._client
        if all(future.status == "finished" for future in group):
            try:
                values = await client.gather(group, asynchronous=True)
            except Exception:  # a value was lost meanwhile (its worker died): one by one
                pass
            else:
                return [(future, value, None) for future, value in zip(group, values, strict=True)]
        done: Done = []
        for future in group:
            try:
                (value,) = await client.gather([future], asynchronous=True)
            except BaseException as exc:  # erred, cancelled, lost: the task's own outcome
                done.append((future, None, exc))
            else:
                done.append((future, value, None))
        return done
