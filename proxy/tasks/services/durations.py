"""How long each tool's tasks usually take, shared by every replica through the store and kept across
restarts: loaded at start and every few seconds, a completion shared at once, and the record a client sees
paced by it (`pacing.py`). Imports the store and the pacing rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final

import structlog

from proxy.tasks.ports import Spawner
from proxy.tasks.services import pacing
from proxy.tasks.store import StoreError, TaskStore
from proxy.wire.tasks import TaskRecord, TaskStatus

log = structlog.get_logger(__name__)

RELOAD_SECONDS: Final = 5.0  # how often the tools' duration estimates are read again (other replicas')


class Durations:
    def __init__(self, store: TaskStore, clock: Callable[[], int], spawner: Spawner) -> None:
        self.store = store
        self.clock = clock
        self.spawner = spawner
        self.estimates = pacing.DurationEstimates()
        self._loaded_at = float("-inf")

    async def load(self) -> None:
        """The estimates as the store keeps them (every replica's completions, across restarts)."""
        self._loaded_at = time.monotonic()
        try:
            self.estimates.load(await self.store.duration_estimates())
        except StoreError as exc:
            log.warning("durations_not_loaded", error=str(exc))

    async def reload_if_due(self) -> None:
        if time.monotonic() - self._loaded_at > RELOAD_SECONDS:
            await self.load()

    def completed(self, record: TaskRecord) -> None:
        """A task completed: its duration counts here at once, and for every replica through the store."""
        duration_ms = record.updated_at_ms - record.created_at_ms
        self.estimates.observe(record.tool, duration_ms)
        self.spawner.spawn(self._share(record.tool, duration_ms), f"duration-{record.task_id}")

    async def _share(self, tool: str, duration_ms: float) -> None:
        try:
            self.estimates.load({tool: await self.store.observe_duration(tool, duration_ms)})
        except StoreError as exc:
            log.warning("duration_not_stored", tool=tool, error=str(exc))

    def paced(self, record: TaskRecord) -> TaskRecord:
        """The record as the client sees it: a working task's `pollIntervalMs` follows its tool's usual
        duration; the stored value is the policy's."""
        if record.status is not TaskStatus.WORKING or record.poll_interval_ms is None:
            return record
        interval = pacing.poll_interval_ms(
            record.poll_interval_ms,
            created_at_ms=record.created_at_ms,
            now_ms=self.clock(),
            expected_ms=self.estimates.expected_ms(record.tool),
        )
        return record if interval == record.poll_interval_ms else replace(record, poll_interval_ms=interval)
