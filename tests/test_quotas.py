"""tasks/quotas.py: a caller's calls counted per fixed one-minute window on a real SQLite store, with a clock
the test moves: the call past the quota is refused with how long to wait (to the end of the window), and the
next window starts afresh (the window rolls over). The same count on PostgreSQL is shared by replicas
(test_store.py, test_flow_admission.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.errors import RateLimitedError
from proxy.tasks.quotas import Quotas
from proxy.tasks.store import SqliteTaskStore


class Clock:
    def __init__(self, now_ms: int) -> None:
        self.now_ms = now_ms

    def __call__(self) -> int:
        return self.now_ms


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[SqliteTaskStore]:
    opened = await SqliteTaskStore.open(tmp_path / "tasks.db", max_records=10)
    yield opened
    await opened.close()


async def test_the_call_past_the_quota_waits_for_the_window_to_roll_over(store: SqliteTaskStore) -> None:
    clock = Clock(1_700_000_080_500)  # 40.5 s into a UTC minute
    quotas = Quotas(store, clock)
    for _ in range(3):
        await quotas.charge("caller-a", 3)
    with pytest.raises(RateLimitedError) as caught:
        await quotas.charge("caller-a", 3)
    error = caught.value
    assert (error.status, error.code) == (429, -32603)
    assert error.data == {"limit": "calls_per_minute_per_principal", "max": 3, "retryAfterMs": 20_000}
    assert error.response_headers() == {
        "Retry-After": "20",
        "RateLimit-Policy": '"calls";q=3;w=60',
        "RateLimit": '"calls";r=0;t=20',
    }
    await quotas.charge("caller-b", 3)  # another caller has its own count
    clock.now_ms = 1_700_000_099_999  # the last millisecond of the window: still refused, for at least 1 s
    with pytest.raises(RateLimitedError) as caught:
        await quotas.charge("caller-a", 3)
    assert caught.value.retry_after_seconds == 1
    clock.now_ms = 1_700_000_100_000  # the next window
    for _ in range(3):
        await quotas.charge("caller-a", 3)
    with pytest.raises(RateLimitedError):
        await quotas.charge("caller-a", 3)
