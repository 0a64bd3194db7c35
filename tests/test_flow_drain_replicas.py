"""End to end: a replica drains on SIGTERM while another one on the same PostgreSQL database answers for its
tasks. Real processes, a real signal; the tasks the draining replica runs end there within the drain, a
cancel sent to the other replica reaches it, and only what outlives the drain is taken over once it exits.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from proxy.tasks.replicas import TAKEN_OVER
from tests import pg
from tests.support.cluster import Cluster, client
from tests.support.schemas import ModernSchema, SchemaValidator

DRAIN_SECONDS = 5.0
TOOLS = {"sleep": {"mode": "required"}}


@pytest.fixture
def pair(tmp_path_factory: pytest.TempPathFactory, pg_server: pg.PgServer) -> Iterator[Cluster]:
    with pg_server.database() as dsn:
        replicas = Cluster(tmp_path_factory.mktemp("drain"), dsn, 2, 3.0, TOOLS, drain_seconds=DRAIN_SECONDS)
        yield replicas
        replicas.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as http:
        yield http


async def test_the_other_replica_answers_for_a_draining_replicas_tasks(
    pair: Cluster, session: aiohttp.ClientSession, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    draining, _ = client(session, [pair.replicas[0]], modern_schema, tasks_schema)
    other, _ = client(session, [pair.replicas[1]], modern_schema, tasks_schema)
    short = await draining.create("sleep", {"seconds": 2})
    cancelled = await draining.create("sleep", {"seconds": 60})
    longer = await draining.create("sleep", {"seconds": 60})
    owner = pair.records([short])[short]["owner"]

    sent = time.monotonic()
    pair.replicas[0].signal(signal.SIGTERM)
    assert pair.replicas[0].proxy.process is not None
    exited = asyncio.get_running_loop().create_task(asyncio.to_thread(pair.replicas[0].proxy.process.wait, 60))

    assert (await other.task(short))["status"] == "working"  # the other replica reads it from the store
    status, _ = await other.post("tasks/cancel", {"taskId": cancelled})
    assert status == 200
    gone = await other.until(cancelled, lambda task: task["status"] == "cancelled")
    assert gone["status"] == "cancelled"  # the draining replica, still running it, was told and stopped it
    done = await other.settled(short)
    assert done["status"] == "completed"  # ended on the draining replica, within its drain
    assert pair.records([short])[short]["owner"] == owner

    assert await exited == 0
    assert time.monotonic() - sent < DRAIN_SECONDS + 10
    taken = await other.until(longer, lambda task: task["status"] != "working", timeout_seconds=20)
    assert taken["status"] == "failed"  # outlived the drain: taken over once the lease was released
    assert taken["error"]["message"] == TAKEN_OVER
    assert pair.records([longer])[longer]["owner"] != owner
    events = pair.replicas[0].events()
    assert [event["calls_left"] for event in events if event["event"] == "drain_timed_out"] == [1]
    await other.post("tasks/cancel", {"taskId": longer})
