"""The store's events port (`contract.Events`), against both backends (a real SQLite file, a real PostgreSQL
database): a task's status events written by the database in the transaction that changes it, whichever port
ends the task, read by cursor per principal, trimmed with `truncated`, fanned out to webhook subscriptions and
claimed from the outbox by one replica at a time. A test takes the events port, and the records port to run
tasks."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from proxy.tasks.store import Events, Records, SqliteTaskStore, TaskStore
from proxy.tasks.store.events import TASK_STATUS, StoredEvent, Watch, WebhookSubscription
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.wire.tasks import TaskStatus
from tests.support.records import make_record

NOW = 1_700_000_000_000


class Backend:
    def __init__(self, path: Path, dsn: str | None) -> None:
        self.path, self.dsn = path, dsn

    async def open(self) -> TaskStore:
        if self.dsn is not None:
            return await PostgresTaskStore.open(self.dsn, max_records=100)
        return await SqliteTaskStore.open(self.path, max_records=100)

    async def count(self, table: str) -> int:
        if self.dsn is not None:
            async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
                row = await (await conn.execute(f"SELECT COUNT(*) FROM {table}".encode())).fetchone()
                assert row is not None
                return int(row[0])

        def read() -> int:
            conn = sqlite3.connect(self.path)
            try:
                return int(conn.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])
            finally:
                conn.close()

        return await asyncio.to_thread(read)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    dsn = request.getfixturevalue("pg_dsn") if request.param == "postgres" else None
    return Backend(tmp_path / "state" / "tasks.db", dsn)


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[TaskStore]:
    opened = await backend.open()
    await opened.events.configure(True)
    yield opened
    await opened.close()


@pytest.fixture
def events(store: TaskStore) -> Events:
    return store.events


@pytest.fixture
def records(store: TaskStore) -> Records:
    return store.records


def subscription(principal: str = "alice", subject: str = "", **fields: Any) -> WebhookSubscription:
    values: dict[str, Any] = {
        "subscription_id": f"sub_{principal}_{subject or 'all'}",
        "principal": principal,
        "name": TASK_STATUS,
        "subject": subject,
        "arguments": "{}",
        "url": "https://receiver.example/hook",
        "secret": "sealed",
        "secret_digest": "digest",
        "previous_secret": None,
        "previous_until_ms": None,
        "created_at_ms": NOW,
        "refreshed_at_ms": NOW,
        "expires_at_ms": NOW + 3_600_000,
    }
    return WebhookSubscription(**{**values, **fields})


async def run_task(records: Records, task_id: str, principal: str = "alice", *, ask: bool = False) -> None:
    await records.create(make_record(task_id, principal=principal, created_at_ms=NOW))
    await records.set_status_message(task_id, "10%", now_ms=NOW + 1)
    if ask:
        await records.set_inputs(task_id, {"k1": {"method": "elicitation/create"}}, 1, now_ms=NOW + 2)
    await records.settle(
        task_id, TaskStatus.COMPLETED, now_ms=NOW + 3, result={"content": [], "secret": "no"}, status_message="done"
    )


async def test_events_off_logs_nothing(backend: Backend) -> None:
    store = await backend.open()
    try:
        await run_task(store.records, "task_quiet")
        await store.events.configure(True)
        await store.events.configure(False)  # switched off again: no replica logs any more
        await run_task(store.records, "task_quiet_too")
        assert await store.events.head() == 0
        assert await backend.count("event_log") == 0
    finally:
        await store.close()


async def test_a_tasks_input_required_and_end_are_logged_once_with_its_status_fields(
    events: Events, records: Records
) -> None:
    await run_task(records, "task_a", ask=True)
    page = await events.read("alice", TASK_STATUS, None, 0, 10)
    assert [(event.subject, event.data["status"]) for event in page.events] == [
        ("task_a", "input_required"),
        ("task_a", "completed"),
    ]
    done = page.events[1]
    assert done.data == {
        "taskId": "task_a",
        "status": "completed",
        "statusMessage": "done",
        "createdAtMs": NOW,
        "updatedAtMs": NOW + 3,
        "ttlMs": 60_000,
        "pollIntervalMs": None,
    }
    assert "result" not in done.data
    assert done.event_id == f"task_a.completed.{NOW + 3}"
    assert (page.position, page.truncated, page.has_more) == (await events.head(), False, False)


async def test_every_way_a_task_ends_logs_its_event_once(store: TaskStore, events: Events, records: Records) -> None:
    """The owner's fenced settlement (what its call's machine writes, a `tasks/cancel` included), an unfenced
    cancel from another replica, an operator's cancel and the TTL sweep each end a task through another port or
    path; the database logs each end, once."""
    fence = await store.replicas.renew_lease("replica-1", 30)
    for task_id in ("task_owned", "task_elsewhere", "task_operator"):
        await records.create(make_record(task_id, principal="alice", owner="replica-1", created_at_ms=NOW))
    await records.create(make_record("task_lapsing", principal="alice", created_at_ms=NOW, ttl_ms=10))
    await records.settle("task_owned", TaskStatus.CANCELLED, now_ms=NOW + 1, status_message="cancelled", fence=fence)
    await records.settle("task_elsewhere", TaskStatus.CANCELLED, now_ms=NOW + 2, status_message="cancelled")
    await store.operators.cancel_task("task_operator", "cancelled by an operator", now_ms=NOW + 3)
    error = {"code": -32603, "message": "expired"}
    await records.settle_expired(NOW + 20, error=error, status_message="expired")
    await records.settle("task_owned", TaskStatus.FAILED, now_ms=NOW + 30, fence=fence)  # settled already: no-op
    page = await events.read("alice", TASK_STATUS, None, 0, 10)
    assert sorted((event.subject, event.data["status"]) for event in page.events) == [
        ("task_elsewhere", "cancelled"),
        ("task_lapsing", "failed"),
        ("task_operator", "cancelled"),
        ("task_owned", "cancelled"),
    ]


async def test_reads_are_per_principal_and_subject_and_resume_after_their_position(
    events: Events, records: Records
) -> None:
    await run_task(records, "task_a")
    await run_task(records, "task_b", principal="bob")
    first = await events.read("alice", TASK_STATUS, None, 0, 10)
    assert [event.subject for event in first.events] == ["task_a"]
    assert (await events.read("alice", TASK_STATUS, "task_b", 0, 10)).events == []
    assert [event.subject for event in (await events.read("bob", TASK_STATUS, "task_b", 0, 10)).events] == ["task_b"]
    await run_task(records, "task_c")
    await run_task(records, "task_d")
    page = await events.read("alice", TASK_STATUS, None, first.position, 1)
    assert ([event.subject for event in page.events], page.has_more) == (["task_c"], True)
    rest = await events.read("alice", TASK_STATUS, None, page.position, 10)
    assert ([event.subject for event in rest.events], rest.has_more) == (["task_d"], False)
    assert (await events.read("alice", TASK_STATUS, None, rest.position, 10)).events == []


async def test_a_cursor_behind_what_is_kept_resumes_at_the_oldest_kept_with_truncated(
    events: Events, records: Records
) -> None:
    for name in ("task_1", "task_2", "task_3"):
        await run_task(records, name)
    await events.housekeep(NOW + 10, 3_600_000, 1, 3_600_000)
    page = await events.read("alice", TASK_STATUS, None, 0, 10)
    assert ([event.subject for event in page.events], page.truncated) == (["task_3"], True)
    assert await events.head() == page.position
    floor = await events.read("alice", TASK_STATUS, None, page.position - 1, 10, floor_ms=NOW + 100)
    assert (floor.events, floor.truncated) == ([], True)


async def test_an_event_fans_out_to_matching_subscriptions_and_one_replica_claims_each(
    events: Events, records: Records
) -> None:
    await events.put_subscription(subscription())
    await events.put_subscription(subscription(subject="task_b", subscription_id="sub_b"))
    await events.put_subscription(subscription(principal="bob"))
    await events.put_subscription(subscription(subscription_id="sub_lapsed", expires_at_ms=NOW - 1))
    await run_task(records, "task_a")
    claimed = await events.claim("replica-1", NOW + 10, 30_000, 10)
    assert [(d.subscription_id, d.event_id, d.attempts) for d in claimed] == [
        ("sub_alice_all", f"task_a.completed.{NOW + 3}", 1)
    ]
    delivery = claimed[0]
    assert (delivery.url, delivery.secret, delivery.data["status"]) == (
        "https://receiver.example/hook",
        "sealed",
        "completed",
    )
    assert delivery.watermark == (delivery.seq or 0) - 1
    assert await events.claim("replica-2", NOW + 20, 30_000, 10) == []  # held by replica-1
    again = await events.claim("replica-2", NOW + 40_000, 30_000, 10)  # its claim lapsed (replica-1 died)
    assert [(d.event_id, d.attempts) for d in again] == [(delivery.event_id, 2)]
    await events.delivered(delivery, "replica-1", NOW + 40_001)  # the old claim's answer changes nothing
    assert (await events.outbox()).pending == 1
    await events.retry(again[0], "replica-2", NOW + 50_000, "http_5xx", NOW + 40_002)
    assert await events.next_due_ms() == NOW + 50_000
    assert await events.claim("replica-1", NOW + 49_999, 30_000, 10) == []
    last = await events.claim("replica-1", NOW + 50_000, 30_000, 10)
    await events.delivered(last[0], "replica-1", NOW + 50_001)
    assert (await events.outbox()).pending == 0
    listed = {s.subscription_id: s for s in await events.subscriptions("alice")}
    assert (listed["sub_alice_all"].last_delivery_at_ms, listed["sub_alice_all"].last_error) == (NOW + 50_001, None)
    assert await events.watermark("sub_alice_all") == await events.head()


async def test_unsubscribing_drops_pending_deliveries_and_housekeeping_ages_them(
    events: Events, records: Records, backend: Backend
) -> None:
    await events.put_subscription(subscription())
    await events.put_subscription(subscription(subscription_id="sub_other", expires_at_ms=None))
    await run_task(records, "task_a")
    assert (await events.outbox()).pending == 2
    assert await events.delete_subscription("sub_alice_all", "bob") is False  # not bob's
    assert await events.delete_subscription("sub_alice_all", "alice") is True
    assert (await events.outbox()).pending == 1
    aged = await events.housekeep(NOW + 7_200_000, 86_400_000, 1000, 3_600_000)
    assert aged == 1
    assert await backend.count("event_deliveries") == 0
    await events.put_subscription(subscription(subscription_id="sub_lapsing", expires_at_ms=NOW + 7_200_001))
    await events.housekeep(NOW + 7_200_001, 86_400_000, 1000, 3_600_000)
    assert [s.subscription_id for s in await events.subscriptions()] == ["sub_other"]


async def test_enqueue_and_replay_add_deliveries_once(events: Events, records: Records) -> None:
    sub = subscription()
    await run_task(records, "task_a")
    await events.put_subscription(sub)
    assert (await events.outbox()).pending == 0  # subscribed after the event: not fanned out
    assert await events.replay(sub, 0, None, NOW + 5) is False
    assert await events.replay(sub, 0, None, NOW + 6) is False
    assert (await events.outbox()).pending == 1
    event = StoredEvent(0, "late.completed.1", TASK_STATUS, "alice", "task_x", {"taskId": "task_x"}, NOW)
    await events.enqueue(sub.subscription_id, event, NOW + 7)
    await events.enqueue(sub.subscription_id, event, NOW + 8)
    assert (await events.outbox()).pending == 2


async def test_verification_is_cached_per_principal_and_url(events: Events) -> None:
    await events.mark_verified("alice", "https://a.example/h", NOW)
    assert await events.verified("alice", "https://a.example/h", NOW - 1)
    assert not await events.verified("bob", "https://a.example/h", NOW - 1)
    assert not await events.verified("alice", "https://a.example/h", NOW + 1)


async def test_operators_list_subscriptions_without_their_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from proxy.cli import main

    database = tmp_path / "tasks.db"
    store = await SqliteTaskStore.open(database, max_records=10)
    await store.events.put_subscription(subscription(url="https://receiver.example/hook?token=t0k3n"))
    await store.close()
    assert await asyncio.to_thread(main, ["tasks", "subscriptions", "--db", str(database)]) == 0
    printed = capsys.readouterr().out
    (listed,) = json.loads(printed)["subscriptions"]
    assert (listed["id"], listed["callback"], listed["pending"]) == (
        "sub_alice_all",
        "https://receiver.example/hook",
        0,
    )
    assert "sealed" not in printed
    assert "t0k3n" not in printed


async def test_an_appended_event_is_logged_once_and_fans_out_like_a_tasks(events: Events) -> None:
    await events.put_subscription(
        subscription(
            subscription_id="sub_uri", name="resource.updated", subject="test://a", arguments='{"uri":"test://a"}'
        )
    )
    updated = StoredEvent(0, "evt_1", "resource.updated", "alice", "test://a", {"uri": "test://a"}, NOW)
    await events.append(updated)
    await events.append(updated)  # the same id: once
    await events.append(StoredEvent(0, "evt_2", "resource.updated", "alice", "test://b", {"uri": "test://b"}, NOW))
    page = await events.read("alice", "resource.updated", "test://a", 0, 10)
    assert [(event.event_id, event.data) for event in page.events] == [("evt_1", {"uri": "test://a"})]
    assert [d.event_id for d in await events.claim("replica-1", NOW + 1, 30_000, 10)] == ["evt_1"]


async def test_one_replica_at_a_time_holds_a_wanted_watch(events: Events) -> None:
    await events.want(Watch("alice", "resource.updated", "test://a", "sealed-1", NOW + 60_000))
    await events.want(Watch("alice", "resource.updated", "test://a", "sealed-2", NOW + 30_000))  # keeps the later
    held = await events.hold_watches("replica-1", NOW, 5_000, 10)
    assert [(w.subject, w.credential, w.wanted_until_ms, w.holder) for w in held] == [
        ("test://a", "sealed-2", NOW + 60_000, "replica-1")
    ]
    assert await events.hold_watches("replica-2", NOW + 1_000, 5_000, 10) == []  # held by replica-1
    assert len(await events.hold_watches("replica-1", NOW + 4_000, 5_000, 10)) == 1  # renewed
    taken = await events.hold_watches("replica-2", NOW + 9_001, 5_000, 10)  # replica-1 let it lapse
    assert [w.holder for w in taken] == ["replica-2"]
    await events.drop_watches(NOW + 60_000)  # unwanted now, but still held: kept until the hold lapses
    assert await events.hold_watches("replica-1", NOW + 60_001, 5_000, 10) == []
    await events.drop_watches(NOW + 70_000)
    await events.want(Watch("alice", "resource.updated", "test://a", None, NOW + 80_000))
    assert [w.credential for w in await events.hold_watches("replica-3", NOW + 70_001, 5_000, 10)] == [None]
