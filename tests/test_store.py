"""The store's contract, port by port, against both backends: a real SQLite file under tmp_path and a real
PostgreSQL database (tests/pg.py). A test takes the port it exercises (`records`, `replicas`, `usage`,
`operators`; the keys are test_store_keys.py's), or the store when it crosses ports. SQLite-only specifics are
in test_store_sqlite.py, replicas in test_store_pg.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from proxy.tasks.store import (
    CANCEL,
    EXPIRED,
    INPUT,
    PURGED,
    RESYNC,
    STATUS,
    Change,
    FencedError,
    Keys,
    OperatorQueries,
    Records,
    Replicas,
    SqliteTaskStore,
    StoreError,
    StoreFullError,
    TaskQuery,
    TaskStore,
    Tombstone,
    Usage,
    page_key,
    parse_page_key,
    record_from_row,
)
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.wire.jsonrpc import RawJSON
from proxy.wire.tasks import TaskStatus
from tests.support.records import hold_creations, make_record, next_change

DEADLINE_SECONDS = 10.0


class Backend:
    """Opens stores of one kind on one database, and reads its tables directly."""

    def __init__(self, name: str, path: Path, dsn: str | None) -> None:
        self.name, self.path, self.dsn = name, path, dsn

    async def open(self, max_records: int = 100, *, read_only: bool = False) -> TaskStore:
        if self.dsn is not None:
            return await PostgresTaskStore.open(self.dsn, max_records=max_records, read_only=read_only)
        return await SqliteTaskStore.open(self.path, max_records=max_records, read_only=read_only)

    async def rows(self, sql: str) -> list[tuple[Any, ...]]:
        if self.dsn is not None:
            async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
                return await (await conn.execute(sql.encode())).fetchall()

        def read() -> list[tuple[Any, ...]]:
            conn = sqlite3.connect(self.path)
            try:
                return conn.execute(sql).fetchall()
            finally:
                conn.close()

        return await asyncio.to_thread(read)

    async def execute(self, sql: str) -> None:
        if self.dsn is not None:
            async with await psycopg.AsyncConnection.connect(self.dsn) as conn:
                await conn.execute(sql.encode())
            return

        def write() -> None:
            conn = sqlite3.connect(self.path)
            try:
                conn.execute(sql)
                conn.commit()
            finally:
                conn.close()

        await asyncio.to_thread(write)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    dsn = request.getfixturevalue("pg_dsn") if request.param == "postgres" else None
    return Backend(request.param, tmp_path / "state" / "tasks.db", dsn)


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[TaskStore]:
    opened = await backend.open()
    yield opened
    await opened.close()


@pytest.fixture
def records(store: TaskStore) -> Records:
    return store.records


@pytest.fixture
def replicas(store: TaskStore) -> Replicas:
    return store.replicas


@pytest.fixture
def keys(store: TaskStore) -> Keys:
    return store.keys


@pytest.fixture
def usage(store: TaskStore) -> Usage:
    return store.usage


@pytest.fixture
def operators(store: TaskStore) -> OperatorQueries:
    return store.operators


async def test_create_get_round_trips_every_field(records: Records, backend: Backend) -> None:
    full = make_record(
        "task_full",
        status=TaskStatus.INPUT_REQUIRED,
        created_at_ms=1_700_000_000_123,
        updated_at_ms=1_700_000_000_456,
        ttl_ms=3_600_000,
        poll_interval_ms=750,
        owner="proxy-7",
        on_restart="rerun",
        request={"name": "slow_tool", "arguments": {"q": "ünïcode ✓", "n": [1, 2.5, None, True]}},
        status_message="50/100 — indexing",
        result={"content": [{"type": "text", "text": "x"}]},
        error={"code": -32603, "message": "boom"},
        input_requests={"key-1": {"method": "elicitation/create", "params": {"message": "ok?"}}},
        inputs_issued=3,
        rerun_principal="Bearer secret",
        client_capabilities={"elicitation": {}},
        upstream_task_id="0b3d2565:aa4e86b6",
        upstream_session_id="session-1",
        upstream_input_ids={"key-1": "task-0b3d-140668836600304", "key-2": 0},
        traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        job_id="render-1",
        queued_at_ms=1_700_000_000_200,
    )
    bare = make_record("task_bare", ttl_ms=None)
    await records.create(full)
    await records.create(bare)

    got_full = await records.get("task_full")
    assert got_full is not None
    assert isinstance(got_full.result, RawJSON)  # kept as the stored text, which answers send as it is
    assert got_full.result.value() == full.result
    assert dataclasses.replace(got_full, result=full.result) == full
    assert await records.get("task_full") == dataclasses.replace(full, result=RawJSON(got_full.result.text))
    got_bare = await records.get("task_bare")
    assert got_bare == bare
    assert got_bare is not None
    assert (got_bare.ttl_ms, got_bare.result, got_bare.input_requests, got_bare.traceparent) == (None, None, {}, None)
    assert (got_full.job_id, got_bare.job_id) == ("render-1", None)
    assert await records.get("task_unknown") is None

    rows = await backend.rows("SELECT task_id, expires_at_ms, request, result FROM tasks ORDER BY task_id")
    stored = {row[0]: row[1:] for row in rows}
    assert stored["task_full"] == (
        1_700_000_000_123 + 3_600_000,
        json.dumps(full.request, separators=(",", ":")),
        '{"content":[{"type":"text","text":"x"}]}',
    )
    assert stored["task_bare"][0] is None
    assert stored["task_bare"][2] is None


async def test_a_stored_result_cut_short_is_a_store_error_not_an_answer(records: Records, backend: Backend) -> None:
    """Stored results are sent on as their text, unparsed; one that is not a whole object is refused instead."""
    await records.create(make_record("task_cut", status=TaskStatus.COMPLETED, result={"content": []}))
    await backend.execute("UPDATE tasks SET result = '{\"content\":[' WHERE task_id = 'task_cut'")
    with pytest.raises(StoreError, match="corrupt task record 'task_cut'"):
        await records.get("task_cut")


def test_record_from_row_decodes_json_and_status() -> None:
    row = {
        "task_id": "t",
        "principal": "p",
        "tool": "tool",
        "status": "failed",
        "status_message": None,
        "created_at_ms": 1,
        "updated_at_ms": 2,
        "ttl_ms": None,
        "expires_at_ms": None,
        "poll_interval_ms": None,
        "owner": "o",
        "on_restart": "fail",
        "request": '{"a":1}',
        "result": None,
        "error": '{"code":1}',
        "input_requests": "{}",
        "inputs_issued": 4,
        "rerun_principal": None,
        "client_capabilities": '{"elicitation":{}}',
        "upstream_task_id": "up-1",
        "upstream_session_id": "s-1",
        "upstream_input_ids": '{"elicitation-1":"task-q-1"}',
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "job_id": "render-7",
        "queued_at_ms": 5,
    }
    record = record_from_row(row)
    assert record.job_id == "render-7"
    assert record.queued_at_ms == 5
    assert record.client_capabilities == {"elicitation": {}}
    assert (record.upstream_task_id, record.upstream_session_id) == ("up-1", "s-1")
    assert record.upstream_input_ids == {"elicitation-1": "task-q-1"}
    assert record.traceparent == "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert record.status is TaskStatus.FAILED
    assert (record.request, record.error, record.result, record.inputs_issued) == ({"a": 1}, {"code": 1}, None, 4)


async def test_set_inputs_changes_live_tasks_and_bumps_updated_at(records: Records) -> None:
    original = make_record("task_a", created_at_ms=1_000)
    await records.create(original)
    asking = await records.set_inputs("task_a", {"k1": {"method": "sampling/createMessage"}}, 1, now_ms=5_000)
    assert asking is not None
    assert asking == await records.get("task_a")
    assert (asking.updated_at_ms, asking.created_at_ms, asking.status) == (5_000, 1_000, TaskStatus.INPUT_REQUIRED)
    assert asking.input_requests == {"k1": {"method": "sampling/createMessage"}}
    assert asking.inputs_issued == 1
    assert (asking.request, asking.tool, asking.ttl_ms, asking.owner) == (
        original.request,
        original.tool,
        original.ttl_ms,
        original.owner,
    )

    back = await records.set_inputs("task_a", {}, 1, now_ms=6_000)
    assert back is not None
    assert (back.status, back.input_requests, back.inputs_issued) == (TaskStatus.WORKING, {}, 1)

    progressed = await records.set_status_message("task_a", "3/10", now_ms=7_000)
    assert progressed is not None
    assert (progressed.status_message, progressed.updated_at_ms, progressed.status) == (
        "3/10",
        7_000,
        TaskStatus.WORKING,
    )


async def test_claim_takes_a_live_task_back_to_working_for_a_new_owner(records: Records) -> None:
    await records.create(make_record("task_a", created_at_ms=1_000))
    await records.set_inputs("task_a", {"k1": {"method": "roots/list"}}, 3, now_ms=2_000)
    claimed = await records.claim("task_a", "proxy-2", "re-running", now_ms=3_000)
    assert claimed is not None
    assert (claimed.owner, claimed.status, claimed.status_message) == ("proxy-2", TaskStatus.WORKING, "re-running")
    assert claimed.input_requests == {}
    assert claimed.inputs_issued == 3  # keys already issued stay issued: a re-run never reuses one


async def test_typed_writes_leave_terminal_and_missing_tasks_alone(store: TaskStore) -> None:
    await store.records.create(make_record("task_done", created_at_ms=1_000))
    settled = await store.records.settle("task_done", TaskStatus.COMPLETED, now_ms=2_000, result={"content": []})
    assert settled is not None
    assert await store.records.set_status_message("task_done", "late", now_ms=3_000) is None
    assert await store.records.set_inputs("task_done", {"k": {"method": "roots/list"}}, 1, now_ms=3_000) is None
    assert await store.records.claim("task_done", "other", "again", now_ms=3_000) is None
    assert await store.records.get("task_done") == settled
    assert await store.records.set_status_message("task_missing", "x", now_ms=3_000) is None
    assert (await store.operators.stats())["records"] == 1


async def test_first_settle_wins(records: Records) -> None:
    await records.create(make_record("task_a"))
    completed, cancelled = await asyncio.gather(
        records.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000, result={"content": [], "resultType": "complete"}),
        records.settle("task_a", TaskStatus.CANCELLED, now_ms=2_001, status_message="cancelled by client"),
    )
    winners = [record for record in (completed, cancelled) if record is not None]
    assert len(winners) == 1
    got = await records.get("task_a")
    assert got is not None
    assert got == winners[0]
    assert got.status in {TaskStatus.COMPLETED, TaskStatus.CANCELLED}

    assert await records.settle("task_a", TaskStatus.FAILED, now_ms=3_000, error={"code": 1, "message": "x"}) is None
    assert await records.get("task_a") == got
    assert await records.settle("task_missing", TaskStatus.FAILED, now_ms=3_000) is None


async def test_settle_clears_input_requests_and_rerun_principal(records: Records) -> None:
    await records.create(
        make_record(
            "task_a",
            status=TaskStatus.INPUT_REQUIRED,
            status_message="waiting",
            input_requests={"k1": {"method": "elicitation/create"}},
            inputs_issued=1,
            rerun_principal="Bearer secret",
        )
    )
    error = {"code": -32603, "message": "upstream lost"}
    settled = await records.settle("task_a", TaskStatus.FAILED, now_ms=9_000, error=error)
    assert settled is not None
    assert settled == await records.get("task_a")
    assert (settled.status, settled.error, settled.result, settled.status_message) == (
        TaskStatus.FAILED,
        error,
        None,
        None,
    )
    assert (settled.input_requests, settled.rerun_principal, settled.inputs_issued) == ({}, None, 1)
    assert settled.updated_at_ms == 9_000


async def test_a_jobs_id_is_kept_through_progress_claim_and_settlement(records: Records) -> None:
    await records.create(make_record("task_job", job_id="render-3"))
    await records.set_status_message("task_job", "40%", now_ms=2_000)
    claimed = await records.claim("task_job", "proxy-2", "resumed", now_ms=3_000)
    assert claimed is not None
    assert claimed.job_id == "render-3"  # polled again, never started again
    settled = await records.settle("task_job", TaskStatus.COMPLETED, now_ms=4_000, result={"content": []})
    assert settled is not None
    assert settled.job_id == "render-3"


async def test_a_task_the_upstream_runs_keeps_its_upstream_ids_until_it_settles(records: Records) -> None:
    await records.create(make_record("task_up", upstream_task_id="up-1", upstream_session_id="s-1"))
    question = {"elicitation-1": {"method": "elicitation/create", "params": {"message": "?"}}}
    asking = await records.set_inputs("task_up", question, 1, now_ms=2_000, upstream_input_ids={"elicitation-1": "q-7"})
    assert asking is not None
    assert (asking.status, asking.upstream_input_ids) == (TaskStatus.INPUT_REQUIRED, {"elicitation-1": "q-7"})
    unchanged = await records.set_inputs("task_up", question, 1, now_ms=3_000)  # no ids given: those kept stay
    assert unchanged is not None
    assert unchanged.upstream_input_ids == {"elicitation-1": "q-7"}
    claimed = await records.claim("task_up", "proxy-2", "resumed", now_ms=4_000)
    assert claimed is not None
    assert (claimed.upstream_task_id, claimed.upstream_session_id) == ("up-1", "s-1")  # followed again there
    settled = await records.settle("task_up", TaskStatus.COMPLETED, now_ms=5_000, result={"content": []})
    assert settled is not None
    assert settled.upstream_input_ids == {}
    assert (settled.upstream_task_id, settled.upstream_session_id) == ("up-1", "s-1")


async def test_the_creating_trace_context_stays_with_the_task_through_take_over_and_settlement(
    records: Records,
) -> None:
    created = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    await records.create(make_record("task_traced", traceparent=created))
    claimed = await records.claim("task_traced", "proxy-2", "re-running", now_ms=2_000)
    assert claimed is not None
    assert claimed.traceparent == created  # a task resumed elsewhere goes on in the trace that created it
    settled = await records.settle("task_traced", TaskStatus.CANCELLED, now_ms=3_000)
    assert settled is not None
    assert settled.traceparent == created  # a tasks/get of the settled task still links to its creation
    assert await records.get("task_traced") == settled


async def test_settle_rejects_live_status(records: Records) -> None:
    await records.create(make_record("task_a"))
    with pytest.raises(ValueError, match="terminal"):
        await records.settle("task_a", TaskStatus.WORKING, now_ms=2_000)
    got = await records.get("task_a")
    assert got is not None
    assert got.status is TaskStatus.WORKING


async def test_max_records_evicts_the_oldest_settled(backend: Backend) -> None:
    store = await backend.open(max_records=3)
    try:
        for index, task_id in enumerate(("task_a", "task_b", "task_c")):
            await store.records.create(make_record(task_id, created_at_ms=1_000 + index))
        await store.records.settle("task_a", TaskStatus.COMPLETED, now_ms=5_000)
        await store.records.settle("task_b", TaskStatus.FAILED, now_ms=4_000)  # settled last-created, but earlier
        await store.records.create(make_record("task_d", created_at_ms=6_000))
        assert await store.records.get("task_b") is None
        for kept in ("task_a", "task_c", "task_d"):
            assert await store.records.get(kept) is not None
        assert (await store.operators.stats())["records"] == 3
    finally:
        await store.close()


async def test_eviction_breaks_updated_at_ties_by_created_at(backend: Backend) -> None:
    store = await backend.open(max_records=2)
    try:
        await store.records.create(make_record("task_young", created_at_ms=2_000))
        await store.records.create(make_record("task_old", created_at_ms=1_000))
        await store.records.settle("task_young", TaskStatus.CANCELLED, now_ms=3_000)
        await store.records.settle("task_old", TaskStatus.COMPLETED, now_ms=3_000)
        await store.records.create(make_record("task_new", created_at_ms=4_000))
        assert await store.records.get("task_old") is None
        assert await store.records.get("task_young") is not None
    finally:
        await store.close()


async def test_full_of_live_tasks_raises_and_writes_nothing(backend: Backend) -> None:
    store = await backend.open(max_records=2)
    try:
        await store.records.create(make_record("task_a"))
        await store.records.create(make_record("task_b", status=TaskStatus.INPUT_REQUIRED))
        with pytest.raises(StoreFullError, match="task store full: 2 live tasks"):
            await store.records.create(make_record("task_c"))
        assert await store.records.get("task_c") is None
        assert (await store.operators.stats())["records"] == 2
        # A settled task makes room again, and the count stayed right through the refusal.
        await store.records.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000)
        await store.records.create(make_record("task_c"))
        assert await store.records.get("task_a") is None
        assert (await store.operators.stats())["records"] == 2
    finally:
        await store.close()


async def test_creations_queued_while_the_creator_is_busy_share_one_commit(store: TaskStore, backend: Backend) -> None:
    release, held = await hold_creations(store)
    creations = [asyncio.ensure_future(store.records.create(make_record(f"task_{n}"))) for n in range(40)]  # noqa: TID251
    await asyncio.sleep(0.05)  # the creations are queued behind the held thread (nothing to poll for)
    assert not any(creation.done() for creation in creations)  # nobody is answered before the commit
    release.set()
    await held
    await asyncio.gather(*creations)

    assert (await store.operators.stats())["records"] == 40
    if backend.dsn is not None:  # rows written by one transaction share its id
        assert await backend.rows("SELECT count(DISTINCT xmin::text) FROM tasks") == [(1,)]


async def test_a_record_that_fails_in_a_group_takes_back_only_itself(backend: Backend) -> None:
    store = await backend.open(max_records=3)
    try:
        await store.records.create(make_record("task_a"))
        release, held = await hold_creations(store)
        names = ["task_b", "task_a", "task_c", "task_d"]  # a duplicate id, then one more than fits
        creations = [asyncio.ensure_future(store.records.create(make_record(name, owner="x"))) for name in names]  # noqa: TID251
        await asyncio.sleep(0.05)
        release.set()
        await held
        outcomes = await asyncio.gather(*creations, return_exceptions=True)

        assert outcomes[0] is None
        assert isinstance(outcomes[1], StoreError)
        assert not isinstance(outcomes[1], StoreFullError)
        assert "create task_a failed" in str(outcomes[1])
        assert outcomes[2] is None
        assert isinstance(outcomes[3], StoreFullError)
        first = await store.records.get("task_a")
        assert first is not None
        assert first.owner == "proxy-1"  # the duplicate changed nothing
        assert await store.records.get("task_d") is None
        assert (await store.operators.stats())["records"] == 3  # the count followed the group's outcomes
        await store.records.settle("task_b", TaskStatus.COMPLETED, now_ms=2_000)
        await store.records.create(make_record("task_d"))  # room again: task_b is evicted
        assert await store.records.get("task_b") is None
    finally:
        await store.close()


async def test_an_unexpected_failure_in_a_group_answers_every_creator(store: TaskStore) -> None:
    """Whatever breaks a group commit, nobody waits forever: the group is rolled back and each creator hears."""
    release, held = await hold_creations(store)
    good = asyncio.ensure_future(store.records.create(make_record("task_good")))  # noqa: TID251
    unstorable = make_record("task_bad", request={"not json": {1, 2}})  # a set: the row cannot be encoded
    bad = asyncio.ensure_future(store.records.create(unstorable))  # noqa: TID251
    await asyncio.sleep(0.05)
    release.set()
    await held
    outcomes = await asyncio.wait_for(asyncio.gather(good, bad, return_exceptions=True), 5)

    assert all(isinstance(outcome, StoreError) for outcome in outcomes)
    assert "create failed" in str(outcomes[0])
    assert isinstance(outcomes[1], StoreError)
    assert isinstance(outcomes[1].__cause__, TypeError)
    assert await store.records.get("task_good") is None  # rolled back with its group
    assert (await store.operators.stats())["records"] == 0
    await store.records.create(make_record("task_good"))  # the store goes on working
    assert await store.records.get("task_good") is not None


async def test_a_creator_that_leaves_does_not_disturb_its_group(store: TaskStore) -> None:
    release, held = await hold_creations(store)
    leaving = asyncio.ensure_future(store.records.create(make_record("task_gone")))  # noqa: TID251
    staying = asyncio.ensure_future(store.records.create(make_record("task_kept")))  # noqa: TID251
    await asyncio.sleep(0.05)
    leaving.cancel()
    release.set()
    await held
    await staying
    with pytest.raises(asyncio.CancelledError):
        await leaving
    # The record of a creator that left is committed all the same (its caller decides what to do with it).
    assert await store.records.get("task_kept") is not None
    assert await store.records.get("task_gone") is not None


async def test_record_count_survives_a_reopen_with_a_smaller_limit(backend: Backend) -> None:
    store = await backend.open(max_records=10)
    for index in range(5):
        await store.records.create(make_record(f"task_{index}", created_at_ms=1_000 + index))
    for index in range(4):
        await store.records.settle(f"task_{index}", TaskStatus.COMPLETED, now_ms=2_000 + index)
    await store.close()

    smaller = await backend.open(max_records=2)
    try:
        await smaller.records.create(make_record("task_new"))
        assert sorted(record.task_id for record in await smaller.records.live()) == ["task_4", "task_new"]
        assert (await smaller.operators.stats())["records"] == 2
    finally:
        await smaller.close()


async def test_duplicate_id_is_a_store_error(records: Records) -> None:
    await records.create(make_record("task_a"))
    with pytest.raises(StoreError, match="create task_a failed"):
        await records.create(make_record("task_a", owner="someone-else"))
    got = await records.get("task_a")
    assert got is not None
    assert got.owner == "proxy-1"


async def test_expired_live_and_purge_expired_boundaries(store: TaskStore) -> None:
    await store.records.create(make_record("live_a", created_at_ms=1_000, ttl_ms=100))  # expires 1100
    await store.records.create(make_record("live_forever", created_at_ms=1_000, ttl_ms=None))
    await store.records.create(make_record("live_c", status=TaskStatus.INPUT_REQUIRED, created_at_ms=1_000, ttl_ms=200))
    await store.records.create(make_record("done_d", created_at_ms=1_000, ttl_ms=100))  # expires 1100
    await store.records.create(make_record("done_e", created_at_ms=1_000, ttl_ms=300))  # expires 1300
    await store.records.create(make_record("done_forever", created_at_ms=1_000, ttl_ms=None))
    for task_id in ("done_d", "done_e", "done_forever"):
        await store.records.settle(task_id, TaskStatus.COMPLETED, now_ms=1_050)

    assert await store.records.expired_live(1_099) == []
    assert [record.task_id for record in await store.records.expired_live(1_100)] == ["live_a"]
    assert [record.task_id for record in await store.records.expired_live(1_200)] == ["live_a", "live_c"]
    assert [record.task_id for record in await store.records.expired_live(10**15)] == ["live_a", "live_c"]
    assert sorted(record.task_id for record in await store.records.live()) == ["live_a", "live_c", "live_forever"]

    assert await store.records.purge_expired(1_099) == 0
    assert await store.records.purge_expired(1_100) == 1
    assert await store.records.get("done_d") is None
    assert (
        await store.records.get("live_a") is not None
    )  # expired but live: the runner settles it, purge never deletes it
    assert await store.records.purge_expired(10**15) == 1
    assert await store.records.get("done_e") is None
    assert await store.records.get("done_forever") is not None
    assert (await store.operators.stats())["records"] == 4


async def test_settle_expired_fails_live_tasks_past_their_ttl(records: Records) -> None:
    await records.create(make_record("live_a", created_at_ms=1_000, ttl_ms=100))
    await records.create(make_record("live_b", status=TaskStatus.INPUT_REQUIRED, created_at_ms=1_000, ttl_ms=200))
    await records.create(make_record("live_later", created_at_ms=1_000, ttl_ms=5_000))
    error = {"code": -32603, "message": "expired"}
    assert await records.settle_expired(1_099, error=error, status_message="expired") == []
    settled = await records.settle_expired(1_200, error=error, status_message="expired")
    assert [(record.task_id, record.status, record.error) for record in settled] == [
        ("live_a", TaskStatus.FAILED, error),
        ("live_b", TaskStatus.FAILED, error),
    ]
    assert [record.task_id for record in await records.live()] == ["live_later"]
    assert await records.settle_expired(1_200, error=error, status_message="expired") == []


async def test_delete(store: TaskStore) -> None:
    await store.records.create(make_record("task_a"))
    assert await store.records.delete("task_a") is True
    assert await store.records.get("task_a") is None
    assert await store.records.delete("task_a") is False
    assert (await store.operators.stats())["records"] == 0


async def test_stats_counts_by_status(store: TaskStore) -> None:
    empty = {"working": 0, "input_required": 0, "completed": 0, "failed": 0, "cancelled": 0, "records": 0}
    assert await store.operators.stats() == empty
    for index in range(3):
        await store.records.create(make_record(f"working_{index}"))
    await store.records.create(make_record("input_0", status=TaskStatus.INPUT_REQUIRED))
    for index, status in enumerate((TaskStatus.COMPLETED, TaskStatus.COMPLETED, TaskStatus.CANCELLED)):
        await store.records.create(make_record(f"settled_{index}"))
        await store.records.settle(f"settled_{index}", status, now_ms=2_000)
    assert await store.operators.stats() == {
        **empty,
        "working": 3,
        "input_required": 1,
        "completed": 2,
        "cancelled": 1,
        "records": 7,
    }
    assert await store.operators.size_bytes() > 0
    await store.check_writable(3_000)


async def test_records_survive_a_reopen(backend: Backend) -> None:
    store = await backend.open(max_records=10)
    await store.records.create(make_record("task_a", input_requests={"k": {"x": 1}}))
    settled = await store.records.settle("task_a", TaskStatus.COMPLETED, now_ms=2_000, result={"content": []})
    await store.records.create(make_record("task_b"))
    await store.close()

    reopened = await backend.open(max_records=10)
    try:
        assert await reopened.records.get("task_a") == settled
        assert await reopened.records.get("task_b") == make_record("task_b")
        assert [record.task_id for record in await reopened.records.live()] == ["task_b"]
    finally:
        await reopened.close()


async def test_close_is_idempotent_and_closed_store_refuses_work(store: TaskStore) -> None:
    await store.records.create(make_record("task_a"))
    await asyncio.gather(store.close(), store.close())
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await store.records.get("task_a")
    with pytest.raises(StoreError, match="closed"):
        await store.records.create(make_record("task_b"))


async def test_read_only_sees_commits_and_refuses_writes(records: Records, backend: Backend) -> None:
    await records.create(make_record("task_a"))
    reader = await backend.open(max_records=10, read_only=True)
    try:
        assert await reader.records.get("task_a") == make_record("task_a")
        await records.create(make_record("task_b"))
        assert await reader.records.get("task_b") == make_record("task_b")
        assert (await reader.operators.stats())["working"] == 2
        with pytest.raises(StoreError, match="read-only"):
            await reader.records.create(make_record("task_c"))
        with pytest.raises(StoreError, match="read-only"):
            await reader.records.set_status_message("task_a", "x", now_ms=2_000)
        with pytest.raises(StoreError, match="read-only"):
            await reader.records.settle("task_a", TaskStatus.CANCELLED, now_ms=2_000)
        with pytest.raises(StoreError, match="read-only"):
            await reader.records.delete("task_a")
        with pytest.raises(StoreError, match="read-only"):
            await reader.records.purge_expired(10**15)
        got = await records.get("task_a")
        assert got is not None
        assert got.status is TaskStatus.WORKING
    finally:
        await reader.close()


# -- fencing, messages, the change feed, pacing: the same API on both backends ----------------------------------


async def test_a_fenced_write_needs_the_task_to_be_the_fences_owner(store: TaskStore) -> None:
    mine = await store.replicas.renew_lease("proxy-1", 30)
    assert mine.owner == "proxy-1"
    assert await store.replicas.renew_lease("proxy-1", 30) == mine  # renewed in time: the same epoch
    await store.records.create(make_record("task_a", owner="proxy-1"))
    await store.records.create(make_record("task_b", owner="proxy-2"))

    assert await store.records.set_status_message("task_a", "1/3", now_ms=2_000, fence=mine) is not None
    asking = await store.records.set_inputs("task_a", {"k": {"method": "roots/list"}}, 1, now_ms=2_001, fence=mine)
    assert asking is not None
    assert asking.status is TaskStatus.INPUT_REQUIRED
    with pytest.raises(FencedError, match="task_b"):
        await store.records.settle("task_b", TaskStatus.COMPLETED, now_ms=2_002, result={}, fence=mine)
    with pytest.raises(FencedError):
        await store.records.set_status_message("task_b", "not mine", now_ms=2_002, fence=mine)
    untouched = await store.records.get("task_b")
    assert untouched is not None
    assert (untouched.status, untouched.status_message) == (TaskStatus.WORKING, None)

    settled = await store.records.settle("task_a", TaskStatus.COMPLETED, now_ms=2_003, result={}, fence=mine)
    assert settled is not None
    # A settled or unknown task is no fencing matter: None, as without a fence.
    assert await store.records.settle("task_a", TaskStatus.FAILED, now_ms=2_004, fence=mine) is None
    assert await store.records.set_status_message("task_missing", "x", now_ms=2_004, fence=mine) is None
    # Without a fence (a cancel from anywhere) the first settle still wins.
    cancelled = await store.records.settle("task_b", TaskStatus.CANCELLED, now_ms=2_005, status_message="cancelled")
    assert cancelled is not None
    assert cancelled.status is TaskStatus.CANCELLED


async def test_live_can_be_narrowed_to_one_owner(records: Records) -> None:
    await records.create(make_record("task_a", owner="proxy-1", created_at_ms=1))
    await records.create(make_record("task_b", owner="proxy-2", created_at_ms=2))
    await records.create(make_record("task_c", owner="proxy-1", created_at_ms=3))
    await records.settle("task_c", TaskStatus.COMPLETED, now_ms=4)
    assert [record.task_id for record in await records.live(owner="proxy-1")] == ["task_a"]
    assert [record.task_id for record in await records.live(owner="proxy-2")] == ["task_b"]
    assert [record.task_id for record in await records.live()] == ["task_a", "task_b"]


async def test_messages_wait_for_their_replica_in_order(store: TaskStore) -> None:
    await store.records.create(make_record("task_a", owner="proxy-1"))
    await store.records.create(make_record("task_done", owner="proxy-1"))
    await store.records.settle("task_done", TaskStatus.COMPLETED, now_ms=2_000)

    cancel = await store.replicas.notify_owner("task_a", CANCEL, {"reason": "cancelled by client"})
    assert cancel is not None
    assert (cancel.recipient, cancel.kind, cancel.key, cancel.payload) == (
        "proxy-1",
        CANCEL,
        "task_a",
        {"reason": "cancelled by client"},
    )
    answers = await store.replicas.notify_owner("task_a", INPUT, {"k1": {"action": "accept"}})
    assert answers is not None
    assert await store.replicas.notify_owner("task_done", CANCEL, {}) is None  # settled: nobody to tell
    assert await store.replicas.notify_owner("task_missing", CANCEL, {}) is None
    direct = await store.replicas.notify_replica("proxy-2", "mrtr_answers", "parked-7", {"k": 1})
    assert (direct.recipient, direct.key) == ("proxy-2", "parked-7")

    taken = await store.replicas.take_messages("proxy-1")
    assert [message.message_id for message in taken] == [cancel.message_id, answers.message_id]
    assert await store.replicas.take_messages("proxy-1") == []  # taken once
    assert await store.replicas.take_messages("proxy-2") == [direct]
    with pytest.raises(ValueError, match="kind"):
        await store.replicas.notify_owner("task_a", STATUS, {})
    with pytest.raises(ValueError, match="kind"):
        await store.replicas.notify_replica("proxy-2", "", "k", {})


async def test_the_change_feed_carries_status_changes_and_messages(store: TaskStore) -> None:
    await store.records.create(make_record("task_a", owner="proxy-1"))
    async with store.replicas.changes() as everything, store.replicas.changes(for_replica="proxy-2") as others:
        assert await next_change(everything, skip_resync=False) == Change(RESYNC)
        assert await next_change(others, skip_resync=False) == Change(RESYNC)
        await store.records.set_status_message("task_a", "2/3", now_ms=2_000)
        await store.replicas.notify_owner("task_a", CANCEL, {})
        await store.records.settle("task_a", TaskStatus.CANCELLED, now_ms=2_001)
        expected = [
            Change(STATUS, "task_a", "proxy-1", TaskStatus.WORKING),
            Change(CANCEL, "task_a", "proxy-1"),
            Change(STATUS, "task_a", "proxy-1", TaskStatus.CANCELLED),
        ]
        assert [await next_change(everything) for _ in expected] == expected
        # A replica's own filter drops the messages addressed to another one; status changes reach everyone.
        assert [await next_change(others) for _ in range(2)] == [expected[0], expected[2]]


async def test_duration_estimates_are_kept_across_a_reopen(backend: Backend) -> None:
    store = await backend.open()
    assert await store.usage.duration_estimates() == {}
    assert await store.usage.observe_duration("slow_tool", 1_000) == 1_000
    assert await store.usage.observe_duration("slow_tool", 2_000) == pytest.approx(1_300)  # 30 % weight on the newest
    await store.usage.observe_duration("fast_tool", 40.5)
    await store.close()
    reopened = await backend.open()
    try:
        assert await reopened.usage.duration_estimates() == {"slow_tool": pytest.approx(1_300), "fast_tool": 40.5}
    finally:
        await reopened.close()


async def test_a_replica_holding_its_lease_is_not_taken_over(store: TaskStore) -> None:
    one = await store.replicas.renew_lease("proxy-1", 30)
    two = await store.replicas.renew_lease("proxy-2", 30)
    await store.records.create(make_record("task_a", owner="proxy-1"))
    assert await store.replicas.expired_replicas() == []
    assert await store.replicas.take_over("proxy-1", two) == []
    got = await store.records.get("task_a")
    assert got is not None
    assert got.owner == "proxy-1"
    await store.replicas.release_lease(one)


async def test_a_replica_is_alive_while_it_holds_its_lease(replicas: Replicas, backend: Backend) -> None:
    """Whether another replica can still answer a request forwarded to it (an MRTR retry for its parked call)."""
    assert not await replicas.replica_alive("proxy-1")  # never leased
    fence = await replicas.renew_lease("proxy-1", 30)
    assert await replicas.replica_alive("proxy-1")
    await replicas.release_lease(fence)
    assert not await replicas.replica_alive("proxy-1")
    assert replicas.shared is (backend.name == "postgres")  # SQLite: one process, nobody else to take over from


async def test_a_lookup_by_another_principal_finds_nothing(records: Records) -> None:
    """Another caller's lookup gets the same None as an unknown id, and the owner's gets the record."""
    await records.create(make_record("task_big"))
    big = {"content": [{"type": "text", "text": "x" * 2_000_000}]}
    settled = await records.settle("task_big", TaskStatus.COMPLETED, now_ms=2_000, result=big)
    assert await records.get("task_big", principal="another-hash") is None
    assert await records.get("task_missing", principal="principal-hash") is None
    assert await records.get("task_big", principal="principal-hash") == settled


# --- operators: listing, cancel, purge ---------------------------------------------------------------------


async def test_list_tasks_filters_newest_first_and_pages_without_request_or_result(store: TaskStore) -> None:
    for index in range(5):
        await store.records.create(
            make_record(
                f"task_{index}",
                created_at_ms=1_000 + index * 100,
                tool="slow_tool" if index % 2 else "other_tool",
                principal="alice" if index < 3 else "bob",
                request={"name": "slow_tool", "arguments": {"secret": "s3cret"}},
            )
        )
    await store.records.settle("task_4", TaskStatus.COMPLETED, now_ms=5_000, result={"content": [], "x": "big"})

    every = await store.operators.list_tasks(TaskQuery())
    assert [record.task_id for record in every] == ["task_4", "task_3", "task_2", "task_1", "task_0"]
    assert all(record.result is None and record.request == {} for record in every)  # never read for a listing
    assert every[0].status is TaskStatus.COMPLETED

    async def ids(**query: Any) -> list[str]:
        return [record.task_id for record in await store.operators.list_tasks(TaskQuery(**query))]

    assert await ids(statuses=frozenset({TaskStatus.WORKING})) == ["task_3", "task_2", "task_1", "task_0"]
    assert await ids(statuses=frozenset({TaskStatus.WORKING, TaskStatus.COMPLETED}), tool="slow_tool") == [
        "task_3",
        "task_1",
    ]
    assert await ids(principal="bob") == ["task_4", "task_3"]
    assert await ids(created_before_ms=1_200, created_after_ms=1_000) == ["task_1"]  # both ends exclusive
    first = await store.operators.list_tasks(TaskQuery(limit=2))
    assert [record.task_id for record in first] == ["task_4", "task_3"]
    after = parse_page_key(page_key(first[-1]))
    assert await ids(limit=2, after=after) == ["task_2", "task_1"]
    assert await ids(limit=2, after=(1_000, "task_0")) == []
    with pytest.raises(ValueError, match="limit"):
        TaskQuery(limit=0)


async def test_an_operators_cancel_settles_a_live_task_once(store: TaskStore) -> None:
    await store.records.create(make_record("task_live", status=TaskStatus.INPUT_REQUIRED, input_requests={"k": {}}))
    await store.records.create(make_record("task_done"))
    await store.records.settle("task_done", TaskStatus.COMPLETED, now_ms=2_000)

    cancelled = await store.operators.cancel_task("task_live", "cancelled by an operator", now_ms=3_000)
    assert cancelled is not None
    assert (cancelled.status, cancelled.status_message, cancelled.input_requests) == (
        TaskStatus.CANCELLED,
        "cancelled by an operator",
        {},
    )
    assert cancelled.updated_at_ms == 3_000
    assert await store.operators.cancel_task("task_live", "again", now_ms=4_000) is None  # the first settle won
    assert await store.operators.cancel_task("task_done", "late", now_ms=4_000) is None
    done = await store.records.get("task_done")
    assert done is not None
    assert done.status is TaskStatus.COMPLETED
    assert await store.operators.cancel_task("task_missing", "x", now_ms=4_000) is None


async def test_purge_settled_counts_on_a_dry_run_and_deletes_only_old_settled_records(store: TaskStore) -> None:
    await store.records.create(make_record("task_old_done", created_at_ms=1_000))
    await store.records.create(make_record("task_new_done", created_at_ms=1_000))
    await store.records.create(make_record("task_old_live", created_at_ms=1_000))
    await store.records.settle("task_old_done", TaskStatus.FAILED, now_ms=2_000)
    await store.records.settle("task_new_done", TaskStatus.CANCELLED, now_ms=9_000)

    assert await store.operators.purge_settled(5_000, dry_run=True) == 1
    assert await store.records.get("task_old_done") is not None  # a dry run deletes nothing
    assert await store.operators.purge_settled(5_000, dry_run=False) == 1
    assert await store.records.get("task_old_done") is None
    assert {record.task_id for record in await store.operators.list_tasks(TaskQuery())} == {
        "task_new_done",
        "task_old_live",
    }
    assert (await store.operators.stats())["records"] == 2
    assert await store.operators.purge_settled(5_000, dry_run=False) == 0


async def test_pending_messages_tells_whether_a_replica_has_mail(store: TaskStore) -> None:
    await store.records.create(make_record("task_a", owner="proxy-1"))
    assert not await store.replicas.pending_messages("proxy-1")
    await store.replicas.notify_owner("task_a", CANCEL, {})
    assert await store.replicas.pending_messages("proxy-1")
    assert not await store.replicas.pending_messages("proxy-2")
    await store.replicas.take_messages("proxy-1")
    assert not await store.replicas.pending_messages("proxy-1")


async def test_an_operator_store_works_beside_the_store_that_runs_the_tasks(backend: Backend) -> None:
    """The CLI's cancel and purge open the store beside a running proxy (on SQLite: without its file lock)
    and never migrate it; a cancel leaves the running owner a CANCEL message it can poll for on SQLite."""
    running = await backend.open(max_records=3)
    try:
        await running.records.create(make_record("task_run", owner="proxy-1"))
        for index in range(2):
            await running.records.create(make_record(f"task_done_{index}"))
            await running.records.settle(f"task_done_{index}", TaskStatus.COMPLETED, now_ms=2_000)
        operator = await open_operator(backend)
        try:
            cancelled = await operator.operators.cancel_task("task_run", "cancelled by an operator", now_ms=3_000)
            assert cancelled is not None
            assert cancelled.status is TaskStatus.CANCELLED
            assert await operator.operators.purge_settled(2_500, dry_run=False) == 2
        finally:
            await operator.close()
        seen = await running.records.get("task_run")
        assert seen is not None
        assert seen.status is TaskStatus.CANCELLED
        if not running.replicas.shared:  # PostgreSQL's owner hears the settlement itself (its notification)
            assert [message.kind for message in await running.replicas.take_messages("proxy-1")] == [CANCEL]
        # The running store still creates up to its limit after records vanished under it.
        for index in range(2):
            await running.records.create(make_record(f"task_more_{index}"))
        assert (await running.operators.stats())["records"] == 3
    finally:
        await running.close()


async def open_operator(backend: Backend) -> TaskStore:
    if backend.dsn is not None:
        return await PostgresTaskStore.open(backend.dsn, max_records=100, migrate=False)
    return await SqliteTaskStore.open(backend.path, max_records=100, operator=True)


async def test_an_operator_store_opens_only_an_existing_sqlite_database(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such file"):
        await SqliteTaskStore.open(tmp_path / "absent.db", max_records=1, operator=True)
    assert not (tmp_path / "absent.db").exists()


# --- tombstones: what is left of a deleted record, for its own principal only -------------------------------


async def test_deleted_records_leave_tombstones_only_their_own_principal_can_read(store: TaskStore) -> None:
    for index in range(3):
        await store.records.create(make_record(f"task_{index}", created_at_ms=1_000, ttl_ms=1_000, principal="alice"))
        await store.records.settle(f"task_{index}", TaskStatus.COMPLETED, now_ms=1_500)
    await store.records.create(make_record("task_quiet", created_at_ms=1_000, ttl_ms=1_000, principal="alice"))
    await store.records.settle("task_quiet", TaskStatus.COMPLETED, now_ms=1_500)

    assert await store.records.delete("task_0", tombstone_at_ms=2_100)  # a read found it past its TTL
    assert await store.records.purge_expired(2_200, tombstones=True) == 3
    assert await store.records.tombstone("task_0", "alice") == Tombstone("task_0", EXPIRED, 2_100, 2_000)
    assert await store.records.tombstone("task_1", "alice") == Tombstone("task_1", EXPIRED, 2_200, 2_000)
    assert await store.records.tombstone("task_1", "mallory") is None  # another principal learns nothing
    assert await store.records.tombstone("task_never", "alice") is None

    await store.records.create(make_record("task_old", principal="bob"))
    await store.records.settle("task_old", TaskStatus.FAILED, now_ms=2_000)
    assert await store.operators.purge_settled(3_000, dry_run=False, tombstone_at_ms=3_100) == 1
    assert await store.records.tombstone("task_old", "bob") == Tombstone("task_old", PURGED, 3_100, 61_000)

    await store.records.create(make_record("task_untracked", created_at_ms=1_000, ttl_ms=1_000))
    await store.records.settle("task_untracked", TaskStatus.COMPLETED, now_ms=1_500)
    assert await store.records.purge_expired(5_000) == 1  # without tombstones: none left
    assert await store.records.tombstone("task_untracked", "principal-hash") is None

    # Trimmed by age (older than the cut-off) and by count (the newest `keep` stay).
    assert await store.records.trim_tombstones(2_150, keep=100) == 1  # task_0
    assert await store.records.tombstone("task_0", "alice") is None
    assert await store.records.trim_tombstones(0, keep=1) == 3
    assert await store.records.tombstone("task_old", "bob") is not None  # the newest
    assert await store.records.tombstone("task_2", "alice") is None


async def test_a_queued_task_keeps_its_place_through_a_claim_until_it_gets_its_slot(records: Records) -> None:
    await records.create(make_record("task_q", created_at_ms=1_000))
    queued = await records.set_queued("task_q", 2_000, "queued: 3 ahead", rerun_principal="sealed", now_ms=2_000)
    assert queued is not None
    assert (queued.queued_at_ms, queued.status, queued.status_message) == (2_000, TaskStatus.WORKING, "queued: 3 ahead")
    assert queued.rerun_principal == "sealed"  # a run after a restart presents the caller again
    assert queued.updated_at_ms == 2_000
    claimed = await records.claim("task_q", "proxy-2", "re-running", now_ms=3_000)
    assert claimed is not None
    assert claimed.queued_at_ms == 2_000  # still never reached the upstream
    started = await records.set_queued("task_q", None, "started", rerun_principal=None, now_ms=4_000)
    assert started is not None
    assert (started.queued_at_ms, started.status_message, started.rerun_principal) == (None, "started", None)
    assert await records.get("task_q") == started
    assert [record.queued_at_ms for record in await records.live()] == [None]
    settled = await records.settle("task_q", TaskStatus.CANCELLED, now_ms=5_000)
    assert settled is not None
    assert await records.set_queued("task_q", 6_000, "queued: 0 ahead", rerun_principal=None, now_ms=6_000) is None


async def test_calls_are_counted_per_key_and_window(backend: Backend) -> None:
    """The quota's count: per key, starting afresh in each window. On PostgreSQL it is in the database, so a
    second store (another replica) adds to the same count; on SQLite it is the one process's own."""
    store = await backend.open()
    try:
        assert [await store.usage.count_call("principal:a", 60_000) for _ in range(3)] == [1, 2, 3]
        assert await store.usage.count_call("principal:b", 60_000) == 1
        if backend.dsn is not None:
            other = await backend.open()
            try:
                assert await other.usage.count_call("principal:a", 60_000) == 4  # shared by the replicas
            finally:
                await other.close()
        assert await store.usage.count_call("principal:a", 120_000) == 1  # the next window starts afresh
    finally:
        await store.close()
    if backend.dsn is not None:
        windows = await backend.rows("SELECT key, window_start_ms, calls FROM quota_windows ORDER BY key")
        assert windows == [("principal:a", 120_000, 1)]  # the windows before the current one are dropped


async def test_the_status_counts_agree_with_a_real_count_after_a_mixed_workload_and_a_reopen(
    backend: Backend,
) -> None:
    """Creations, questions, settlements, expiry, purges and deletes: the counts the store keeps as records change
    (what `stats` reads, never a scan) equal a real count, and still do after the store is closed and opened
    again (a restart)."""
    store = await backend.open()
    try:
        for n in range(30):
            task_id = f"task_{n}"
            await store.records.create(
                make_record(task_id, created_at_ms=1_000, ttl_ms=1_000 if n % 4 == 0 else 60_000)
            )
            if n % 3 == 0:
                await store.records.settle(task_id, TaskStatus.FAILED, now_ms=1_500, error={"code": -1, "message": "x"})
            elif n % 3 == 1:
                await store.records.set_inputs(task_id, {"k": {"method": "elicitation/create"}}, 1, now_ms=1_500)
        await store.records.settle_expired(
            2_500, error={"code": -32603, "message": "expired"}, status_message="expired"
        )
        await store.records.purge_expired(2_500, tombstones=True)
        await store.records.delete("task_1")
        await store.operators.purge_settled(10_000, dry_run=False)
        await store.records.create(make_record("task_late", status=TaskStatus.COMPLETED, created_at_ms=20_000))
        counted = await store.operators.stats()
    finally:
        await store.close()
    real = {
        str(status): int(n) for status, n in await backend.rows("SELECT status, COUNT(*) FROM tasks GROUP BY status")
    }
    assert real  # the workload left records of several statuses
    assert {status: counted[status] for status in counted if status != "records" and counted[status]} == real
    assert counted["records"] == sum(real.values())
    reopened = await backend.open()
    try:
        assert await reopened.operators.stats() == counted
    finally:
        await reopened.close()
