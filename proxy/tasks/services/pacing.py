"""Poll pacing: the `pollIntervalMs` a working task suggests, from how long its tool usually takes, and those
durations, shared by every replica through the store (`Durations`). Imports the store."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Final

import structlog

from proxy.tasks.ports import Spawner
from proxy.tasks.store import StoreError, Usage
from proxy.tasks.store.base import DURATION_SMOOTHING, MAX_DURATION_TOOLS
from proxy.wire.tasks import TaskRecord, TaskStatus

# The policy's `poll_interval_ms` is the pace when nothing is known. Once a tool has completed, a task of it suggests
# polling just after its expected end, so the first poll finds the result; a task past its expected end is polled
# again soon, backing off the longer it overruns, never slower than the policy's pace.

log = structlog.get_logger(__name__)

MIN_POLL_MS: Final = 25  # never suggest polling faster than this
SMOOTHING: Final = DURATION_SMOOTHING  # weight of the newest duration in the running estimate
MAX_TOOLS: Final = MAX_DURATION_TOOLS  # tools remembered (least recently completed forgotten first)
STRETCH: Final = 1.25  # a first poll may wait up to this much longer than the policy's pace to land after the end


class DurationEstimates:
    """A running (exponentially weighted) estimate of each tool's task duration, in milliseconds."""

    def __init__(self) -> None:
        self._estimates: OrderedDict[str, float] = OrderedDict()

    def observe(self, tool: str, duration_ms: float) -> None:
        previous = self._estimates.pop(tool, None)
        self._estimates[tool] = duration_ms if previous is None else previous + SMOOTHING * (duration_ms - previous)
        if len(self._estimates) > MAX_TOOLS:
            self._estimates.popitem(last=False)

    def expected_ms(self, tool: str) -> float | None:
        return self._estimates.get(tool)

    def load(self, estimates: Mapping[str, float]) -> None:
        """Take the estimates kept in the task store (shared by replicas, kept across restarts) as they are."""
        for tool, estimate_ms in estimates.items():
            self._estimates.pop(tool, None)
            self._estimates[tool] = estimate_ms
        while len(self._estimates) > MAX_TOOLS:
            self._estimates.popitem(last=False)


def poll_interval_ms(configured_ms: int, *, created_at_ms: int, now_ms: int, expected_ms: float | None) -> int:
    """The interval to suggest now for a working task created at `created_at_ms`."""
    if expected_ms is None:
        return configured_ms
    remaining = created_at_ms + expected_ms - now_ms
    margin = 20 + 0.02 * expected_ms  # land just after the end: the result still has to be committed
    if remaining > 0:
        target = remaining + margin
        return configured_ms if target > configured_ms * STRETCH else max(MIN_POLL_MS, round(target))
    return min(configured_ms, max(MIN_POLL_MS, round(-remaining / 2)))  # overrunning: back off as it grows


RELOAD_SECONDS: Final = 5.0  # how often the tools' duration estimates are read again (other replicas')


class Durations:
    """How long each tool's tasks usually take, as every replica saw them, and the record a client sees paced by it."""

    def __init__(self, usage: Usage, clock: Callable[[], int], spawner: Spawner) -> None:
        self.usage = usage  # the store's usage port: every replica's estimates
        self.clock = clock
        self.spawner = spawner
        self.estimates = DurationEstimates()
        self._loaded_at = float("-inf")

    async def load(self) -> None:
        """The estimates as the store keeps them (every replica's completions, across restarts)."""
        self._loaded_at = time.monotonic()
        try:
            self.estimates.load(await self.usage.duration_estimates())
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
            self.estimates.load({tool: await self.usage.observe_duration(tool, duration_ms)})
        except StoreError as exc:
            log.warning("duration_not_stored", tool=tool, error=str(exc))

    def paced(self, record: TaskRecord) -> TaskRecord:
        """The record as the client sees it: a working task's `pollIntervalMs` follows its tool's usual
        duration; the stored value is the policy's."""
        if record.status is not TaskStatus.WORKING or record.poll_interval_ms is None:
            return record
        interval = poll_interval_ms(
            record.poll_interval_ms,
            created_at_ms=record.created_at_ms,
            now_ms=self.clock(),
            expected_ms=self.estimates.expected_ms(record.tool),
        )
        return record if interval == record.poll_interval_ms else replace(record, poll_interval_ms=interval)
