"""The settlement outbox against a real SQLite store on a real full disk (a small tmpfs, filled and freed):
writes wait in order per task, are retried with growing waits, bounded, and a fenced one is dropped."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import structlog

from proxy.background import Background
from proxy.observe.metrics import Metrics
from proxy.tasks.effects.outbox import FIRST_RETRY_SECONDS, Kind, Outbox
from proxy.tasks.store import Fence, SqliteTaskStore
from proxy.wire.jsonrpc import RawJSON
from proxy.wire.tasks import TaskRecord, TaskStatus
from tests.support.disks import fill, small_tmpfs
from tests.support.records import make_record
from tests.support.waiting import until

FENCE = Fence("replica-1", 1)
PENDING = "mcp_tasks_proxy_store_pending_settlements"
Writer = Callable[[Fence | None], Awaitable[TaskRecord | None]]


@pytest.fixture
async def disk() -> AsyncIterator[Path]:
    with small_tmpfs("4m") as directory:
        yield directory


@pytest.fixture
async def store(disk: Path) -> AsyncIterator[SqliteTaskStore]:
    opened = await SqliteTaskStore.open(disk / "tasks.db", max_records=100)
    for task_id, owner in (("task_a", "replica-1"), ("task_b", "replica-1"), ("task_c", "replica-2")):
        await opened.records.create(make_record(task_id, owner=owner))
    yield opened
    await opened.close()


class Log:
    """What the outbox wrote, in the order it wrote it."""

    def __init__(self) -> None:
        self.written: list[tuple[str, Kind, TaskStatus | None]] = []

    def keep(self, outbox: Outbox, task_id: str, kind: Kind, write: Writer) -> None:
        def written(record: TaskRecord | None) -> None:
            self.written.append((task_id, kind, None if record is None else record.status))

        outbox.keep(task_id, kind, lambda: FENCE, write, written, "disk full")


def progress(
    store: SqliteTaskStore, task_id: str, message: str
) -> Callable[[Fence | None], Awaitable[TaskRecord | None]]:
    return lambda fence: store.records.set_status_message(task_id, message, now_ms=2_000, fence=fence)


def settle(store: SqliteTaskStore, task_id: str, status: TaskStatus, **values: object) -> Writer:
    return lambda fence: store.records.settle(task_id, status, now_ms=3_000, fence=fence, **values)  # type: ignore[arg-type]


async def test_writes_wait_in_order_per_task_with_growing_waits_and_are_written_once_space_returns(
    store: SqliteTaskStore, disk: Path
) -> None:
    metrics = Metrics()
    metrics.store_available.set_function(lambda: store.health.available)  # as the app wires it
    outbox, log, background = Outbox(100, metrics), Log(), Background()
    filler = fill(disk)
    log.keep(outbox, "task_a", "progress", progress(store, "task_a", "step 1"))
    log.keep(outbox, "task_b", "settle", settle(store, "task_b", TaskStatus.FAILED, error={"code": -1, "message": "x"}))
    inputs = {"q1": {"method": "elicitation/create", "params": {}}}
    log.keep(
        outbox,
        "task_a",
        "inputs",
        lambda fence: store.records.set_inputs("task_a", inputs, 1, now_ms=2_500, fence=fence),
    )
    log.keep(outbox, "task_a", "settle", settle(store, "task_a", TaskStatus.COMPLETED, result={"content": [], "n": 1}))
    assert outbox.count == 4
    assert metrics.registry.get_sample_value(PENDING) == 4

    assert await outbox.try_all() is False  # the disk is still full: nothing written, nothing lost
    assert outbox.count == 4
    assert log.written == []
    record = await store.records.get("task_a")
    assert record is not None
    assert record.status is TaskStatus.WORKING

    background.spawn(outbox.run_forever(), "outbox")
    try:
        await until(lambda: outbox.retry_seconds >= 4 * FIRST_RETRY_SECONDS, "the wait between tries grows")
        assert metrics.registry.get_sample_value("mcp_tasks_proxy_store_available") == 0
        filler.unlink()
        await until(lambda: outbox.count == 0, lambda: f"written once space returned; waiting {outbox.count}")
    finally:
        await background.close(1.0)
    # Oldest task first, each task's writes in the order they were made.
    assert log.written == [
        ("task_a", "progress", TaskStatus.WORKING),
        ("task_a", "inputs", TaskStatus.INPUT_REQUIRED),
        ("task_a", "settle", TaskStatus.COMPLETED),
        ("task_b", "settle", TaskStatus.FAILED),
    ]
    assert outbox.retry_seconds == FIRST_RETRY_SECONDS
    assert not outbox.holds("task_a")
    assert metrics.registry.get_sample_value(PENDING) == 0
    assert metrics.registry.get_sample_value("mcp_tasks_proxy_store_available") == 1
    record = await store.records.get("task_a")
    assert record is not None
    assert record.status is TaskStatus.COMPLETED
    assert isinstance(record.result, RawJSON)
    assert '"n":1' in record.result.text


async def test_a_write_another_replica_fenced_off_is_dropped_and_the_tasks_after_it_still_written(
    store: SqliteTaskStore, disk: Path
) -> None:
    outbox, log = Outbox(100, None), Log()
    filler = fill(disk)
    log.keep(outbox, "task_c", "progress", progress(store, "task_c", "mine?"))  # task_c is replica-2's
    log.keep(outbox, "task_c", "settle", settle(store, "task_c", TaskStatus.COMPLETED, result={"content": []}))
    log.keep(outbox, "task_a", "settle", settle(store, "task_a", TaskStatus.COMPLETED, result={"content": []}))
    filler.unlink()
    assert await outbox.try_all() is True
    assert log.written == [("task_a", "settle", TaskStatus.COMPLETED)]
    assert outbox.count == 0
    assert not outbox.holds("task_c")
    survivor = await store.records.get("task_c")
    assert survivor is not None
    assert survivor.status is TaskStatus.WORKING
    assert survivor.owner == "replica-2"


async def test_at_the_limit_progress_is_coalesced_or_dropped_but_results_are_kept(
    store: SqliteTaskStore, disk: Path
) -> None:
    outbox, log = Outbox(2, None), Log()
    filler = fill(disk)
    log.keep(outbox, "task_a", "progress", progress(store, "task_a", "step 1"))
    log.keep(outbox, "task_a", "progress", progress(store, "task_a", "step 2"))  # replaces step 1
    assert outbox.count == 1
    log.keep(outbox, "task_b", "settle", settle(store, "task_b", TaskStatus.COMPLETED, result={"content": []}))
    assert outbox.full
    log.keep(outbox, "task_c", "progress", progress(store, "task_c", "dropped"))  # progress only: dropped
    assert outbox.count == 2
    assert not outbox.holds("task_c")
    log.keep(outbox, "task_a", "settle", settle(store, "task_a", TaskStatus.COMPLETED, result={"content": []}))
    assert outbox.count == 3  # a result past the limit is still kept
    filler.unlink()
    await outbox.close()  # shutdown: one last round
    assert log.written == [
        ("task_a", "progress", TaskStatus.WORKING),
        ("task_a", "settle", TaskStatus.COMPLETED),
        ("task_b", "settle", TaskStatus.COMPLETED),
    ]
    record = await store.records.get("task_a")
    assert record is not None
    assert record.status_message is None
    record_c = await store.records.get("task_c")
    assert record_c is not None
    assert record_c.status_message != "dropped"


async def test_at_shutdown_what_the_store_still_refuses_is_given_up_by_task_id(
    store: SqliteTaskStore, disk: Path
) -> None:
    outbox, log = Outbox(10, None), Log()
    filler = fill(disk)
    secret = {"content": [{"type": "text", "text": "the result value"}]}
    log.keep(outbox, "task_a", "settle", settle(store, "task_a", TaskStatus.COMPLETED, result=secret))
    with structlog.testing.capture_logs() as events:
        await outbox.close()
    assert outbox.count == 0
    assert log.written == []
    lost = [event for event in events if event["event"] == "settlement_lost"]
    assert [(event["task_id"], event["writes"]) for event in lost] == [("task_a", ["settle"])]
    assert "the result value" not in repr(events)
    record = await store.records.get("task_a")
    assert record is not None
    assert record.status is TaskStatus.WORKING
    filler.unlink()  # the store's own close checkpoints its WAL


async def test_writes_refenced_after_a_lease_renewal_are_written_under_the_new_fence(
    store: SqliteTaskStore, disk: Path
) -> None:
    """Writes kept under a fence that no longer holds are tried under the one a renewed lease hands out."""
    outbox, log = Outbox(10, None), Log()
    filler = fill(disk)
    log.keep(outbox, "task_c", "settle", settle(store, "task_c", TaskStatus.COMPLETED, result={"content": []}))
    assert outbox.task_ids() == ["task_c"]
    outbox.refence("task_c", Fence("replica-2", 2))  # task_c is replica-2's: the kept fence (replica-1) fails
    filler.unlink()
    assert await outbox.try_all() is True
    assert log.written == [("task_c", "settle", TaskStatus.COMPLETED)]


async def test_a_refused_write_is_tried_again_under_the_fence_a_reclaim_hands_out(
    store: SqliteTaskStore, disk: Path
) -> None:
    """The store came back before the lapsed lease's recovery re-fenced the writes: a write its kept fence
    refuses is tried once more under the renewed lease's fence when the task is still this replica's (a result
    produced in the outage is not dropped); refused again, or no longer ours, it is dropped."""
    asked: list[str] = []

    async def reclaim(task_id: str) -> Fence | None:
        asked.append(task_id)
        return Fence("replica-2", 2) if task_id == "task_c" else FENCE  # task_c is replica-2's (the renewed lease)

    outbox, log = Outbox(10, None, reclaim), Log()
    filler = fill(disk)
    log.keep(outbox, "task_c", "settle", settle(store, "task_c", TaskStatus.COMPLETED, result={"content": []}))
    filler.unlink()
    assert await outbox.try_all() is True
    assert asked == ["task_c"]
    assert log.written == [("task_c", "settle", TaskStatus.COMPLETED)]
    record = await store.records.get("task_c")
    assert record is not None
    assert record.status is TaskStatus.COMPLETED
    await store.records.create(make_record("task_d", owner="replica-3"))
    log.keep(outbox, "task_d", "settle", settle(store, "task_d", TaskStatus.COMPLETED, result={"content": []}))
    assert await outbox.try_all() is True  # reclaim hands out the fence refused: dropped
    assert not outbox.holds("task_d")
    assert log.written == [("task_c", "settle", TaskStatus.COMPLETED)]
