"""Task records and store handles for the store tests: a record builder, a hold on a store's creation thread,
the next change of a feed within a deadline. Imports the store's public types (and the two backends' threads)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Executor
from typing import Any

from proxy.tasks.store import RESYNC, Change, SqliteTaskStore, TaskStore
from proxy.tasks.store.postgres import PostgresTaskStore
from proxy.wire.tasks import TaskRecord, TaskStatus

DEADLINE_SECONDS = 10.0


def make_record(
    task_id: str,
    *,
    status: TaskStatus = TaskStatus.WORKING,
    created_at_ms: int = 1_000,
    updated_at_ms: int | None = None,
    ttl_ms: int | None = 60_000,
    **fields: Any,
) -> TaskRecord:
    return TaskRecord(
        task_id=task_id,
        principal=fields.pop("principal", "principal-hash"),
        tool=fields.pop("tool", "slow_tool"),
        status=status,
        created_at_ms=created_at_ms,
        updated_at_ms=created_at_ms if updated_at_ms is None else updated_at_ms,
        ttl_ms=ttl_ms,
        poll_interval_ms=fields.pop("poll_interval_ms", None),
        owner=fields.pop("owner", "proxy-1"),
        on_restart=fields.pop("on_restart", "fail"),
        request=fields.pop("request", {"name": "slow_tool", "arguments": {}}),
        **fields,
    )


def creation_thread(store: TaskStore) -> Executor:
    """The thread that commits a store's creations."""
    if isinstance(store, SqliteTaskStore):
        return store.db.writer_thread("a test's creation")
    assert isinstance(store, PostgresTaskStore)
    return store._creator.executor


async def hold_creations(store: TaskStore) -> tuple[threading.Event, asyncio.Future[None]]:
    """Occupy the store's creation thread until the returned event is set (creations queue up meanwhile)."""
    release, started = threading.Event(), threading.Event()

    def block() -> None:
        started.set()
        release.wait(10)

    held = asyncio.get_running_loop().run_in_executor(creation_thread(store), block)
    await asyncio.to_thread(started.wait, 10)
    return release, held


async def next_change(changes: AsyncIterator[Change], *, skip_resync: bool = True) -> Change:
    """The next change within the deadline (RESYNCs skipped unless asked for)."""
    async with asyncio.timeout(DEADLINE_SECONDS):
        async for change in changes:
            if change.kind != RESYNC or not skip_resync:
                return change
    raise AssertionError("the feed ended")


CREATING_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def check_trace_context_migrated(store: TaskStore) -> None:
    """On a store just migrated to keep the creating trace context: `task_old`, written before (with
    upstream_task_id `up-1`), reads as created with tracing off; a new record keeps its context."""
    old = await store.records.get("task_old")
    assert old is not None
    assert (old.traceparent, old.upstream_task_id) == (None, "up-1")
    await store.records.create(make_record("task_new", traceparent=CREATING_TRACEPARENT))
    new = await store.records.get("task_new")
    assert new is not None
    assert new.traceparent == CREATING_TRACEPARENT
