"""End to end: `Idempotency-Key` across two proxy processes on one PostgreSQL database, each with a legacy fixture
upstream of its own (so each upstream's `counted` tool counts the executions that replica started): a repeat
on the other replica joins the first call or gets its recorded outcome, and never runs the tool there; a repeat
of a call whose replica was killed is not run again. Waiting is by polling with a deadline.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests import pg
from tests.support.clients import Tasks
from tests.support.cluster import Cluster, client
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.sdk import calls_started, until_started_upstream
from tests.support.waiting import until

LEASE_SECONDS = 2.0
TOOLS: dict[str, Any] = {"counted": {"mode": "forbidden"}, "sleep": {"mode": "required"}}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pg_server: pg.PgServer) -> Iterator[Cluster]:
    with pg_server.database() as dsn:
        pair = Cluster(tmp_path_factory.mktemp("keys"), dsn, 2, LEASE_SECONDS, TOOLS)
        try:
            yield pair
        finally:
            pair.stop()


@pytest.fixture
def pinned(
    cluster: Cluster, http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> list[Tasks]:
    """One client per replica, each always sent to that replica."""
    return [client(http, [replica], modern_schema, tasks_schema)[0] for replica in cluster.replicas]


def keyed(key: str) -> dict[str, str]:
    return {"Idempotency-Key": key}


def text_of(message: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in message["result"]["content"])


async def test_a_repeat_on_another_replica_joins_the_running_call(cluster: Cluster, pinned: list[Tasks]) -> None:
    first_replica, other = pinned
    counter = f"replicas-{secrets.token_hex(4)}"
    key = keyed(f'"{counter}"')
    upstream = cluster.replicas[0].upstream.url
    before = await calls_started(upstream, "counted")
    first = asyncio.get_running_loop().create_task(
        first_replica.call("counted", {"key": counter, "seconds": 1.0}, headers=key)
    )
    await until_started_upstream(upstream, "counted", before)
    status, joined = await other.call("counted", {"key": counter, "seconds": 1.0}, headers=key)
    assert (status, text_of(joined)) == (200, "1")
    assert text_of((await first)[1]) == "1"
    status, replayed = await other.call("counted", {"key": counter, "seconds": 1.0}, headers=key)
    assert (status, text_of(replayed)) == (200, "1")
    assert await first_replica.text("call_count", {"key": counter}) == "1"
    assert await other.text("call_count", {"key": counter}) == "0"  # the other replica's upstream never ran it


async def test_a_task_created_on_one_replica_is_the_repeat_s_task_on_the_other(pinned: list[Tasks]) -> None:
    first_replica, other = pinned
    key = keyed(f'"task-{secrets.token_hex(4)}"')
    task_id = await first_replica.create("sleep", {"seconds": 0.5}, headers=key)
    assert await other.create("sleep", {"seconds": 0.5}, headers=key) == task_id
    assert (await other.settled(task_id))["status"] == "completed"
    assert await other.create("sleep", {"seconds": 0.5}, headers=key) == task_id


async def test_a_repeat_of_a_call_whose_replica_was_killed_is_not_run_again(
    cluster: Cluster, pinned: list[Tasks], tmp_path: Path
) -> None:
    first_replica, other = pinned
    counter = f"killed-{secrets.token_hex(4)}"
    key = keyed(f'"{counter}"')
    dying = cluster.replicas[0]
    before = await calls_started(dying.upstream.url, "counted")
    first = asyncio.get_running_loop().create_task(
        first_replica.call("counted", {"key": counter, "seconds": 30}, headers=key)
    )
    await until_started_upstream(dying.upstream.url, "counted", before)
    dying.signal(signal.SIGKILL)
    await asyncio.gather(first, return_exceptions=True)
    try:
        # Joined until the dead replica's lease runs out, then told the outcome is unknown.
        status, message = await other.call("counted", {"key": counter, "seconds": 30}, headers=key)
        assert status == 500
        assert message["error"]["data"] == {"idempotencyKey": "interrupted"}
        assert await other.text("call_count", {"key": counter}) == "0"
    finally:
        assert dying.proxy.process is not None
        await asyncio.to_thread(dying.proxy.process.wait, 10)
        await asyncio.to_thread(dying.start)

    async def replayed() -> bool:
        status, message = await first_replica.call("counted", {"key": counter, "seconds": 30}, headers=key)
        return status == 500 and message["error"]["data"] == {"idempotencyKey": "interrupted"}

    await until(replayed, "the restarted replica did not replay the recorded outcome", 20)
