"""Poll pacing, SANS-IO: the `pollIntervalMs` a working task suggests, from how long its tool usually takes.

The policy's `poll_interval_ms` is the pace when nothing is known. Once a tool has completed, a task of it
suggests polling just after its expected end, so the first poll finds the result; a task past its expected
end is polled again soon, backing off the longer it overruns, never slower than the policy's pace. Imports
nothing from the proxy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Final

from proxy.tasks.store.base import DURATION_SMOOTHING, MAX_DURATION_TOOLS

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
