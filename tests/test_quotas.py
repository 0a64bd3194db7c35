"""tasks/quotas.py: a caller's calls counted per fixed one-minute window on a real SQLite store, with a clock
the test moves: the call past the quota is refused with how long to wait (to the end of the window), and the
next window starts afresh (the window rolls over); a tool's own quota is counted per tool beside the global
one, and both are listed in the RateLimit fields with what is left of each. The same count on PostgreSQL is
shared by replicas (test_store.py, test_flow_admission.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest

from proxy.config.schema import TasksConfig
from proxy.errors import RateLimitedError, RatePolicy
from proxy.policy import policy_for
from proxy.tasks.services.quotas import Quotas
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
    quotas = Quotas(store.usage, clock)
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


def tool_policies(**tools: Mapping[str, object]) -> TasksConfig:
    return TasksConfig.model_validate({"tools": tools})


async def test_a_tools_quota_counts_its_calls_alone_and_rolls_over_with_the_window(store: SqliteTaskStore) -> None:
    clock = Clock(1_700_000_070_000)  # 30 s into a UTC minute
    quotas = Quotas(store.usage, clock)
    tasks = tool_policies(render={"calls_per_minute_per_principal": 2})
    render, other = policy_for(tasks, "render"), policy_for(tasks, "other")
    for _ in range(2):
        await quotas.charge("caller-a", 0, "render", render)
    for _ in range(5):
        await quotas.charge("caller-a", 0, "other", other)  # another tool: no quota of its own
    with pytest.raises(RateLimitedError) as caught:
        await quotas.charge("caller-a", 0, "render", render)
    error = caught.value
    assert (error.status, error.code) == (429, -32603)
    assert error.data == {
        "limit": "tasks.tools.render.calls_per_minute_per_principal",
        "max": 2,
        "retryAfterMs": 30_000,
    }
    assert error.response_headers() == {
        "Retry-After": "30",
        "RateLimit-Policy": '"tool:render";q=2;w=60',
        "RateLimit": '"tool:render";r=0;t=30',
    }
    await quotas.charge("caller-b", 0, "render", render)  # another caller has its own count of the tool
    clock.now_ms = 1_700_000_100_000  # the next window: the tool's count starts afresh
    for _ in range(2):
        await quotas.charge("caller-a", 0, "render", render)
    with pytest.raises(RateLimitedError):
        await quotas.charge("caller-a", 0, "render", render)


async def test_the_global_and_a_tools_quota_are_both_listed_with_what_is_left_of_each(
    store: SqliteTaskStore,
) -> None:
    clock = Clock(1_700_000_090_000)  # 50 s into a UTC minute
    quotas = Quotas(store.usage, clock)
    tasks = tool_policies(render={"calls_per_minute_per_principal": 1})
    render, other = policy_for(tasks, "render"), policy_for(tasks, "other")
    await quotas.charge("caller-a", 3, "render", render)
    with pytest.raises(RateLimitedError) as caught:
        await quotas.charge("caller-a", 3, "render", render)  # the tool's quota is spent, the global one not
    assert caught.value.data["limit"] == "tasks.tools.render.calls_per_minute_per_principal"
    assert caught.value.response_headers() == {
        "Retry-After": "10",
        "RateLimit-Policy": '"calls";q=3;w=60, "tool:render";q=1;w=60',
        "RateLimit": '"calls";r=1;t=10, "tool:render";r=0;t=10',
    }
    await quotas.charge("caller-a", 3, "other", other)  # the third call of the window, of another tool
    with pytest.raises(RateLimitedError) as caught:
        await quotas.charge("caller-a", 3, "other", other)
    assert caught.value.data["limit"] == "calls_per_minute_per_principal"
    assert caught.value.response_headers()["RateLimit-Policy"] == '"calls";q=3;w=60'


async def test_each_tool_a_glob_matches_has_its_own_count_named_by_the_glob(store: SqliteTaskStore) -> None:
    quotas = Quotas(store.usage, Clock(1_700_000_040_000))
    tasks = tool_policies(**{"batch_*": {"calls_per_minute_per_principal": 1}})
    await quotas.charge("caller-a", 0, "batch_a", policy_for(tasks, "batch_a"))
    await quotas.charge("caller-a", 0, "batch_b", policy_for(tasks, "batch_b"))
    with pytest.raises(RateLimitedError) as caught:
        await quotas.charge("caller-a", 0, "batch_a", policy_for(tasks, "batch_a"))
    assert caught.value.data["limit"] == "tasks.tools.batch_*.calls_per_minute_per_principal"
    assert caught.value.response_headers()["RateLimit-Policy"] == '"tool:batch_*";q=1;w=60'


def test_a_policy_name_that_is_no_structured_field_string_is_escaped_or_replaced() -> None:
    error = RateLimitedError("x", 1, 60, 5, [RatePolicy('tool:a"b\\c\u00e9', 1, 0)])
    assert error.response_headers()["RateLimit-Policy"] == '"tool:a\\"b\\\\c?";q=1;w=60'
