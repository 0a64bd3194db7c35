"""The 2025-11-25 Tasks a legacy server may run itself, on the wire: detection, `params.task`, its Task objects
(modelcontextprotocol.io/specification/2025-11-25/basic/utilities/tasks). Sans-IO; imports only `wire.jsonrpc`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from proxy.wire.jsonrpc import JSON

TaskSupport = Literal["forbidden", "optional", "required"]
_TASK_SUPPORT: Final[tuple[TaskSupport, ...]] = ("forbidden", "optional", "required")

LEGACY_STATUSES: Final = frozenset({"working", "input_required", "completed", "failed", "cancelled"})
LEGACY_TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
STATUS_NOTIFICATION: Final = "notifications/tasks/status"
DEFAULT_POLL_INTERVAL_MS: Final = 1000  # when the upstream suggests none
NOT_FOUND_CODE: Final = -32602  # 2025-11-25: tasks/get, tasks/result and tasks/cancel of an unknown task


@dataclass(frozen=True, slots=True)
class LegacyTask:
    """What the proxy follows of an upstream's Task (2025-11-25): its id, status and timing."""

    task_id: str
    status: str
    status_message: str | None = None
    ttl_ms: int | None = None  # how long the upstream keeps it; None: not said (or unlimited)
    poll_interval_ms: int | None = None

    @property
    def terminal(self) -> bool:
        return self.status in LEGACY_TERMINAL


def runs_tool_tasks(initialize_result: Mapping[str, Any]) -> bool:
    """Did the upstream declare `tasks.requests.tools.call` (the only case where a client may send
    `params.task` on `tools/call`)?"""
    capabilities = initialize_result.get("capabilities")
    tasks = capabilities.get("tasks") if isinstance(capabilities, dict) else None
    requests = tasks.get("requests") if isinstance(tasks, dict) else None
    tools = requests.get("tools") if isinstance(requests, dict) else None
    return isinstance(tools, dict) and isinstance(tools.get("call"), dict)


def tool_task_support(tool: Any) -> TaskSupport | None:
    """A `tools/list` entry's `execution.taskSupport` (None when absent or not one of the three values)."""
    execution = tool.get("execution") if isinstance(tool, dict) else None
    support = execution.get("taskSupport") if isinstance(execution, dict) else None
    for mode in _TASK_SUPPORT:
        if support == mode:
            return mode
    return None


def with_task(params: Mapping[str, Any], ttl_ms: int | None) -> JSON:
    """`tools/call` params asking the upstream to run the call as its own task, kept `ttl_ms` (an empty
    `task` when the policy keeps tasks for ever: the upstream then chooses)."""
    return {**params, "task": {} if ttl_ms is None else {"ttl": ttl_ms}}


def _integer(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return int(value)


def parse_task(task: Any) -> LegacyTask | None:
    """A 2025-11-25 Task object (from `CreateTaskResult.task`, `tasks/get` or a status notification)."""
    if not isinstance(task, dict):
        return None
    task_id = task.get("taskId")
    status = task.get("status")
    if not isinstance(task_id, str) or not task_id or status not in LEGACY_STATUSES:
        return None
    message = task.get("statusMessage")
    return LegacyTask(
        task_id=task_id,
        status=str(status),
        status_message=message if isinstance(message, str) and message else None,
        ttl_ms=_integer(task.get("ttl")),
        poll_interval_ms=_integer(task.get("pollInterval")),
    )


def created_task(result: Mapping[str, Any]) -> LegacyTask | None:
    """The upstream's task when a task-augmented `tools/call` answered with a `CreateTaskResult` (`{"task":
    {...}}`); None for anything else (an upstream may answer such a call with a plain result)."""
    if "content" in result:
        return None
    return parse_task(result.get("task"))


def status_notification(message: Mapping[str, Any], task_id: str) -> LegacyTask | None:
    """A `notifications/tasks/status` about the task `task_id` (its params are the Task)."""
    if message.get("method") != STATUS_NOTIFICATION:
        return None
    task = parse_task(message.get("params"))
    return task if task is not None and task.task_id == task_id else None


def is_tool_result(result: Mapping[str, Any]) -> bool:
    """Is a `tasks/result` answer a `CallToolResult`? (The mcp 1.x SDK answers a failed or cancelled task
    with a result carrying nothing but `_meta`.)"""
    return isinstance(result.get("content"), list)


def bounded_ttl_ms(policy_ttl_ms: int | None, upstream_expires_at_ms: int | None, now_ms: int) -> int | None:
    """A proxy record's ttl: the policy's, but never beyond what the upstream keeps its task (from now)."""
    if upstream_expires_at_ms is None:
        return policy_ttl_ms
    left = max(0, upstream_expires_at_ms - now_ms)
    return left if policy_ttl_ms is None else min(policy_ttl_ms, left)
