"""End to end on PostgreSQL: two proxy processes with the Events extension on, one database, a webhook receiver
on loopback verifying every delivery with `standardwebhooks`.

The replica that ran a task is killed -9 mid-run; the survivor takes the task over and fails it, and the
receiver gets that end, signed, within three leases and 5 s of the kill, though the replica the client
subscribed on and the one that ran the task were not the same. A poll on either replica reads the same log.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests import pg
from tests.support.cluster import Cluster, Replica, client
from tests.support.events import Receiver, rpc
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until

LEASE_SECONDS = 2.0
EVENTS = {
    "enabled": True,
    "webhooks": {"allow_insecure_callbacks": True, "allow_private_callbacks": True, "retry_seconds": [0.5, 1, 2]},
}


@pytest.fixture
def cluster(tmp_path: Path, pg_dsn: str) -> Iterator[Cluster]:
    replicas = Cluster(tmp_path, pg_dsn, 2, LEASE_SECONDS, {"sleep": {"mode": "required"}}, sections={"events": EVENTS})
    yield replicas
    replicas.stop()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    await found.start()
    yield found
    await found.stop()


@pytest.mark.faults
async def test_the_end_of_a_task_whose_replica_was_killed_is_delivered_by_another(
    cluster: Cluster,
    receiver: Receiver,
    http: aiohttp.ClientSession,
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    first, _ = client(http, cluster.replicas[:1], modern_schema, tasks_schema)
    second, _ = client(http, cluster.replicas[1:], modern_schema, tasks_schema)
    delivery = {"mode": "webhook", "url": receiver.url, "secret": receiver.secret}
    status, subscribed = await rpc(
        second.client, "events/subscribe", {"name": "task.status", "arguments": {}, "delivery": delivery}
    )
    assert status == 200, subscribed
    _, started = await rpc(first.client, "events/poll", {"name": "task.status", "cursor": None})
    task_id = await first.create("sleep", {"seconds": 60}, headers={"Authorization": "Bearer alice"})
    await asyncio.sleep(0.5)  # running upstream on the first replica
    cluster.replicas[0].signal(signal.SIGKILL)
    killed_at = time.time()
    await until(lambda: bool(receiver.deliveries), "the survivor never delivered the task's end", 3 * LEASE_SECONDS + 5)
    delivered = receiver.deliveries[0]
    assert delivered.at - killed_at < 3 * LEASE_SECONDS + 5
    assert delivered.verified
    body: dict[str, Any] = receiver.events()[0]
    assert delivered.headers["webhook-id"] == body["eventId"]
    assert delivered.headers["X-MCP-Subscription-Id"] == subscribed["result"]["id"]
    assert (body["data"]["taskId"], body["data"]["status"]) == (task_id, "failed")
    assert "result" not in body["data"]
    _, polled = await rpc(second.client, "events/poll", {"name": "task.status", "cursor": started["result"]["cursor"]})
    assert [event["eventId"] for event in polled["result"]["events"]] == [body["eventId"]]  # the same log
    await asyncio.sleep(1)
    assert len(receiver.deliveries) == 1


@pytest.mark.faults
async def test_a_task_that_ends_while_postgresql_is_stopped_is_delivered_once_it_is_back(
    tmp_path: Path,
    own_pg_server: pg.PgServer,
    receiver: Receiver,
    http: aiohttp.ClientSession,
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    """Its settlement waits in the replica's outbox while the store is away (an events poll meanwhile gets a
    bounded 503), and its event is written with it once the store is back: delivered, exactly once."""
    dsn = own_pg_server.dsn(await asyncio.to_thread(own_pg_server.create_database))
    key = tmp_path / "key"
    key.write_text("k" * 64)
    store = {"timeout_seconds": 1.0, "connect_timeout_seconds": 1}
    replica = await asyncio.to_thread(
        Replica,
        tmp_path,
        dsn,
        key,
        LEASE_SECONDS,
        {"sleep": {"mode": "required"}},
        store=store,
        sections={"events": EVENTS},
    )
    try:
        tasks, _ = client(http, [replica], modern_schema, tasks_schema)
        delivery = {"mode": "webhook", "url": receiver.url, "secret": receiver.secret}
        params = {"name": "task.status", "arguments": {}, "delivery": delivery}
        assert (await rpc(tasks.client, "events/subscribe", params))[0] == 200
        task_id = await tasks.create("sleep", {"seconds": 2}, headers={"Authorization": "Bearer alice"})
        await asyncio.to_thread(own_pg_server.halt)
        asked = time.monotonic()
        status, refused = await rpc(tasks.client, "events/poll", {"name": "task.status", "cursor": None})
        assert time.monotonic() - asked < 5
        assert (status, refused["error"]["data"]["store"]) == (503, "postgres")
        await asyncio.sleep(3)  # the call ends in the outage: its settlement waits
        assert receiver.deliveries == []
        await asyncio.to_thread(own_pg_server.start)
        await until(lambda: bool(receiver.deliveries), "the end was never delivered after the outage", 20)
        body = receiver.events()[0]
        assert (body["data"]["taskId"], body["data"]["status"]) == (task_id, "completed")
        assert receiver.deliveries[0].verified
        await asyncio.sleep(1)
        assert len(receiver.deliveries) == 1
    finally:
        await asyncio.to_thread(replica.stop)
