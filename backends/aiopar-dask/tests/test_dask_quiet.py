"""A worker of a cluster aiopar starts closes without an error in the log,
and still logs a heartbeat that fails while it runs."""

from __future__ import annotations

import asyncio
import io
import logging
from collections.abc import Callable

import distributed
import pytest
from aiopar_dask import DaskBackend
from aiopar_dask._cluster import HEARTBEAT_FAILED, QuietWorker

pytestmark = pytest.mark.timeout(60)


async def _heartbeat_log(worker_class: type[distributed.Worker], cut: Callable) -> str:
    """What ``distributed.worker`` logs while a heartbeat the scheduler holds
    is cut by ``cut(worker, release)``."""
    log = io.StringIO()
    handler = logging.StreamHandler(log)
    logger = logging.getLogger("distributed.worker")
    logger.addHandler(handler)
    try:
        async with distributed.Scheduler(host="127.0.0.1", dashboard=False) as scheduler:
            held, release = asyncio.Event(), asyncio.Event()
            answer = scheduler.handlers["heartbeat_worker"]

            async def hold(*args, **kwargs):
                held.set()
                await release.wait()
                return answer(*args, **kwargs)

            scheduler.handlers["heartbeat_worker"] = hold
            async with worker_class(scheduler.address, host="127.0.0.1", dashboard=False) as worker:
                beat = asyncio.ensure_future(worker.heartbeat())
                await held.wait()
                await cut(worker, release)
                await beat
                release.set()
    finally:
        logger.removeHandler(handler)
    return log.getvalue()


async def _close_the_worker(worker, release) -> None:
    await worker.close()


@pytest.mark.parametrize("worker_class, logged", [(distributed.Worker, True), (QuietWorker, False)])
def test_a_heartbeat_cut_by_its_workers_close_is_no_error(worker_class, logged):
    # distributed's own Worker logs it (dask/distributed#9032): the case is real
    log = asyncio.run(_heartbeat_log(worker_class, _close_the_worker))
    assert (HEARTBEAT_FAILED in log) is logged, log


async def _fail_the_heartbeat(worker, release) -> None:
    async def refuse(*args, **kwargs):
        raise OSError("the scheduler refused the heartbeat")

    worker.scheduler.heartbeat_worker = refuse
    release.set()
    await worker.heartbeat()


def test_a_heartbeat_that_fails_while_the_worker_runs_is_still_logged():
    log = asyncio.run(_heartbeat_log(QuietWorker, _fail_the_heartbeat))
    assert HEARTBEAT_FAILED in log and "the scheduler refused" in log, log


def _worker_classes(dask_worker) -> list[str]:
    return [cls.__name__ for cls in type(dask_worker).__mro__]


@pytest.mark.parametrize("processes", [True, False])
def test_the_workers_of_a_cluster_aiopar_starts_are_quiet(processes):
    backend = DaskBackend(n_workers=1, threads_per_worker=1, processes=processes)
    try:
        classes = backend.client.run(_worker_classes)
    finally:
        backend.shutdown()
    assert [("QuietWorker" in names) for names in classes.values()] == [True]
