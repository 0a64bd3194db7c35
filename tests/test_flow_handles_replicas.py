"""End to end: task handles on two proxy replicas sharing one PostgreSQL database, each with its own upstream.
A handle made through one replica is served by the other: its status, its result (a wait there is woken by the
store's change feed), the answer to its question (relayed to the replica that runs the call) and its cancel
(which stops the call on the owner's upstream); another principal gets "no such task" there too. The client is
the mcp 1.x Python client, one session per replica.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import pg
from tests.support.cluster import Cluster
from tests.support.real_clients import is_no_such_task, real_client
from tests.support.waiting import until
from tests.upstream.handle_fixtures import story

LEASE_SECONDS = 3.0
HOLD_MS = 1000
ALICE = {"Authorization": "Bearer alice"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pg_server: pg.PgServer) -> Iterator[Cluster]:
    with pg_server.database() as dsn:
        replicas = Cluster(
            tmp_path_factory.mktemp("handles-replicas"),
            dsn,
            2,
            LEASE_SECONDS,
            {"long_report": {"without_tasks": "handle"}},
            sections={"handles": {"hold_ms": HOLD_MS}},
        )
        yield replicas
        replicas.stop()


def new_key() -> str:
    return f"report-{uuid.uuid4().hex[:12]}"


async def test_a_handle_made_on_one_replica_is_served_by_the_other(cluster: Cluster, tmp_path: Path) -> None:
    first, second = (replica.proxy.url for replica in cluster.replicas)
    done, asked, stopped = new_key(), new_key(), new_key()
    async with (
        real_client("mcp1", first, ALICE, tmp_path) as maker,
        real_client("mcp1", second, ALICE, tmp_path) as other,
    ):
        made = await maker.call("long_report", {"key": done, "seconds": 2.5})
        task_id = made.structured["taskId"]
        assert (await other.call("task_status", {"taskId": task_id})).structured["status"] == "working"
        result = await other.call("task_result", {"taskId": task_id, "wait_seconds": 10})
        for _ in range(10):  # each waits up to the hold
            if result.structured.get("status") != "working":
                break
            result = await other.call("task_result", {"taskId": task_id})
        assert result.structured == {"key": done, "runs": 1, "approved": None}
        assert story(done) == ["started", "finished"]

        question = await maker.call("long_report", {"key": asked, "ask": True})
        asked_id = question.structured["taskId"]
        [key] = question.structured["inputRequests"]
        answered = await other.call(
            "task_respond",
            {"taskId": asked_id, "inputResponses": {key: {"action": "accept", "content": {"approve": True}}}},
        )
        assert answered.structured["answered"] == [key], answered.text
        approved = await other.call("task_result", {"taskId": asked_id})
        assert approved.structured == {"key": asked, "runs": 1, "approved": True}

        running = await maker.call("long_report", {"key": stopped, "seconds": 60})
        running_id = running.structured["taskId"]
        async with real_client("mcp1", second, {"Authorization": "Bearer mallory"}, tmp_path) as mallory:
            assert is_no_such_task(await mallory.call("task_status", {"taskId": running_id}))
            assert is_no_such_task(await mallory.call("task_cancel", {"taskId": running_id}))
        cancelled = await other.call("task_cancel", {"taskId": running_id})
        assert cancelled.structured["status"] == "cancelled"
    await until(lambda: story(stopped) == ["started", "cancelled"], "the owner's upstream call was not stopped")
