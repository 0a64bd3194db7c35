"""wire/legacy_tasks.py: reading what a legacy upstream says of its own 2025-11-25 tasks. Pure unit tests; the
shapes are the ones the mcp 1.x SDK and server-everything send (see tests/test_upstream_legacy_tasks.py)."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.wire import legacy_tasks
from proxy.wire.legacy_tasks import LegacyTask

EVERYTHING_CREATED = {
    "task": {
        "taskId": "59ffecfb674a5784f2bbdaac5123d7cd",
        "status": "working",
        "ttl": 300000,
        "createdAt": "2026-11-30T17:47:24.946Z",
        "lastUpdatedAt": "2026-11-30T17:47:24.946Z",
        "pollInterval": 1000,
        "statusMessage": "Gathering sources...",
    }
}
SDK_CREATED_WITHOUT_TTL = {
    "task": {"taskId": "a:b", "status": "working", "createdAt": "", "lastUpdatedAt": "", "pollInterval": 500}
}


@pytest.mark.parametrize(
    ("capabilities", "runs"),
    [
        ({"tasks": {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}}, True),
        ({"tasks": {"list": {}, "cancel": {}}}, False),  # tasks of other kinds only
        ({"tasks": {"requests": {"tools": {}}}}, False),
        ({"tools": {"listChanged": True}}, False),
        ({"tasks": "yes"}, False),
    ],
)
def test_only_the_tools_call_task_capability_counts(capabilities: dict[str, Any], runs: bool) -> None:
    assert legacy_tasks.runs_tool_tasks({"capabilities": capabilities}) is runs


@pytest.mark.parametrize(
    ("tool", "support"),
    [
        ({"name": "t", "execution": {"taskSupport": "required"}}, "required"),
        ({"name": "t", "execution": {"taskSupport": "optional"}}, "optional"),
        ({"name": "t", "execution": {"taskSupport": "forbidden"}}, "forbidden"),
        ({"name": "t", "execution": {"taskSupport": "sometimes"}}, None),
        ({"name": "t", "execution": {}}, None),
        ({"name": "t"}, None),
    ],
)
def test_task_support_is_read_from_the_tools_execution(tool: dict[str, Any], support: str | None) -> None:
    assert legacy_tasks.tool_task_support(tool) == support


def test_params_ask_for_a_task_with_the_policys_ttl() -> None:
    params = {"name": "research", "arguments": {"topic": "x"}, "_meta": {"progressToken": "p"}}
    assert legacy_tasks.with_task(params, 60_000) == {**params, "task": {"ttl": 60_000}}
    assert legacy_tasks.with_task(params, None)["task"] == {}  # unlimited: the upstream chooses
    assert "task" not in params  # not mutated


def test_a_create_task_result_is_read_and_a_plain_result_is_not() -> None:
    assert legacy_tasks.created_task(EVERYTHING_CREATED) == LegacyTask(
        "59ffecfb674a5784f2bbdaac5123d7cd", "working", "Gathering sources...", 300000, 1000
    )
    assert legacy_tasks.created_task(SDK_CREATED_WITHOUT_TTL) == LegacyTask("a:b", "working", None, None, 500)
    assert legacy_tasks.created_task({"content": [], "task": EVERYTHING_CREATED["task"]}) is None
    assert legacy_tasks.created_task({"content": [{"type": "text", "text": "inline"}]}) is None
    assert legacy_tasks.created_task({"task": {"taskId": "x", "status": "paused"}}) is None


def test_a_status_notification_is_read_only_for_its_task() -> None:
    message = {"method": "notifications/tasks/status", "params": {**EVERYTHING_CREATED["task"], "status": "completed"}}
    task = legacy_tasks.status_notification(message, "59ffecfb674a5784f2bbdaac5123d7cd")
    assert task is not None
    assert task.terminal
    assert legacy_tasks.status_notification(message, "another") is None
    assert legacy_tasks.status_notification({"method": "notifications/progress", "params": {}}, "x") is None


def test_only_a_call_tool_result_is_a_tool_result() -> None:
    assert legacy_tasks.is_tool_result({"content": [], "isError": True})
    assert not legacy_tasks.is_tool_result({"_meta": {"io.modelcontextprotocol/related-task": {"taskId": "a"}}})


@pytest.mark.parametrize(
    ("policy_ttl", "upstream_expires", "now", "ttl"),
    [
        (3_600_000, 1_300_000, 1_000_000, 300_000),  # the upstream keeps it less long: its limit
        (60_000, 1_300_000, 1_000_000, 60_000),  # the policy's is shorter: the policy's
        (None, 1_300_000, 1_000_000, 300_000),  # unlimited by policy, bounded by the upstream
        (60_000, None, 1_000_000, 60_000),  # the upstream said nothing
        (60_000, 900_000, 1_000_000, 0),  # already past
    ],
)
def test_a_records_ttl_never_goes_beyond_the_upstreams(
    policy_ttl: int | None, upstream_expires: int | None, now: int, ttl: int
) -> None:
    assert legacy_tasks.bounded_ttl_ms(policy_ttl, upstream_expires, now) == ttl
