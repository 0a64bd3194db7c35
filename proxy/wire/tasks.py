"""The Tasks extension on the wire (SEP-2663): statuses, the task record, CreateTaskResult and DetailedTask.

SANS-IO: plain data and pure functions. The store persists `TaskRecord`s, the runner changes them, the front
turns them into messages with the builders here. Imports only `wire.jsonrpc` and `mcp_types` constants.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Final

from mcp_types import SERVER_INFO_META_KEY
from mcp_types import jsonrpc as codes

from proxy.wire.envelope import TASKS_EXTENSION
from proxy.wire.jsonrpc import JSON, RawJSON


class TaskStatus(StrEnum):
    WORKING = "working"
    INPUT_REQUIRED = "input_required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


TERMINAL: Final = frozenset({TaskStatus.COMPLETED, TaskStatus.FAILED, TaskStatus.CANCELLED})
LIVE: Final = frozenset({TaskStatus.WORKING, TaskStatus.INPUT_REQUIRED})

# What a client that did not declare the Tasks extension lacks, as `data.requiredCapabilities` of -32021.
REQUIRED_CAPABILITY: Final[JSON] = {"extensions": {TASKS_EXTENSION: {}}}

# Unknown ids and other principals' ids get the same -32602 answer, so ids cannot be probed. The caller's own
# task that is gone (expired, purged) says so while its tombstone lasts (`gone_error`), with the same code.
NOT_FOUND_MESSAGE: Final = "Failed to retrieve task: Task not found"

RESTART_MESSAGE: Final = "interrupted: the proxy restarted while the upstream call was running"
EXPIRED_MESSAGE: Final = "expired: the task did not settle within its ttlMs"
RERUN_MESSAGE: Final = "re-running: the proxy restarted while the upstream call was running"
RESUMED_MESSAGE: Final = "resumed: the proxy restarted and follows the upstream's task again"


_TASK_ID: Final = re.compile(r"task_[A-Za-z0-9_-]{32}")


def new_task_id() -> str:
    """192 bits from the OS CSPRNG (task ids may serve as bearer tokens, so they must not be guessable), URL-
    and header-safe ASCII, never a `=?base64?` look-alike."""
    return "task_" + secrets.token_urlsafe(24)


def is_task_id(value: object) -> bool:
    """Whether `value` has the shape `new_task_id` gives every id: checked before a store is asked about it."""
    return isinstance(value, str) and _TASK_ID.fullmatch(value) is not None


def iso_timestamp(epoch_ms: int) -> str:
    """ISO 8601 in UTC with milliseconds, e.g. `2026-08-01T10:00:00.000Z`."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def gone_error(task_id: str, reason: str, gone_at_ms: int, expired_at_ms: int | None) -> tuple[str, JSON]:
    """The message and `data` of the -32602 for the caller's own task whose record is gone: `expired` (its
    ttlMs ran out at `expired_at_ms`) or `purged` (an operator deleted it at `gone_at_ms`)."""
    data: JSON = {"taskId": task_id, "reason": reason, "deletedAt": iso_timestamp(gone_at_ms)}
    if reason == "expired" and expired_at_ms is not None:
        data["expiredAt"] = iso_timestamp(expired_at_ms)
        return f"Failed to retrieve task: Task has expired (at {data['expiredAt']}, its ttlMs)", data
    return f"Failed to retrieve task: Task was deleted by an operator (at {data['deletedAt']})", data


def internal_error(message: str) -> JSON:
    """A JSON-RPC error object for failures the proxy itself observed (lost upstream, restart, expiry)."""
    return {"code": codes.INTERNAL_ERROR, "message": message}


@dataclass(frozen=True, slots=True)
class TaskRecord:
    """One durable task, as stored. Times are epoch milliseconds (UTC).

    `principal` is the hash of the caller's principal header; `request` is the upstream `tools/call` params
    needed to run the call again; `owner` names the proxy process that runs the upstream call;
    `input_requests` holds the outstanding server→client requests by key and `inputs_issued` counts every
    key ever minted for this task (keys are never reused). `rerun_principal` keeps the principal
    header's value only for `on_restart: rerun` tasks and tasks the upstream runs itself, until they settle,
    because a re-run, or following the upstream's task again after a restart, must present it upstream again.
    `client_capabilities` are the creating request's: only questions they cover become `inputRequests`.
    A record read back from a store holds its `result` as the stored text (`RawJSON`), which answers send as it is.

    A task the upstream runs itself (2025-11-25 Tasks) keeps the upstream's task id, the upstream session it
    lives in (tasks are scoped to their session) and, by key, the upstream JSON-RPC ids of its outstanding
    questions: a restarted proxy follows it again there and can still deliver the answers.

    `queued_at_ms` is set while the task's call waits for an upstream slot (`upstream.max_concurrent_calls`):
    such a task never reached the upstream, so a restarted proxy runs it (in the order of these times) whatever
    its `on_restart`.

    `traceparent` is the W3C trace context of the span that created the task, when tracing was on (never
    sent to a client): the spans of later requests about the task link to it, and a task resumed after a
    restart, or taken over by another replica, goes on in that trace.
    """

    task_id: str
    principal: str
    tool: str
    status: TaskStatus
    created_at_ms: int
    updated_at_ms: int
    ttl_ms: int | None
    poll_interval_ms: int | None
    owner: str
    on_restart: str
    request: JSON
    status_message: str | None = None
    result: JSON | RawJSON | None = None
    error: JSON | None = None
    input_requests: JSON = field(default_factory=dict)
    inputs_issued: int = 0
    rerun_principal: str | None = None
    client_capabilities: JSON = field(default_factory=dict)
    upstream_task_id: str | None = None
    upstream_session_id: str | None = None
    upstream_input_ids: JSON = field(default_factory=dict)
    traceparent: str | None = None
    job_id: str | None = None  # a legacy job's id (`jobs:` config): polled through its status tool
    queued_at_ms: int | None = None  # set while its call waits for an upstream slot: it never reached the upstream

    @property
    def expires_at_ms(self) -> int | None:
        return None if self.ttl_ms is None else self.created_at_ms + self.ttl_ms

    def expired(self, now_ms: int) -> bool:
        """Past `createdAt + ttlMs` (the TTL counts from creation; never expired before, terminal or not)."""
        expires = self.expires_at_ms
        return expires is not None and now_ms >= expires


def _task_fields(record: TaskRecord) -> JSON:
    task: JSON = {
        "taskId": record.task_id,
        "status": record.status.value,
        "createdAt": iso_timestamp(record.created_at_ms),
        "lastUpdatedAt": iso_timestamp(record.updated_at_ms),
        "ttlMs": record.ttl_ms,  # the key is always present, null = unlimited
    }
    if record.status_message is not None:
        task["statusMessage"] = record.status_message
    if record.poll_interval_ms is not None:
        task["pollIntervalMs"] = record.poll_interval_ms
    return task


def _with_server_info(result: JSON, server_info: JSON | None) -> JSON:
    if server_info:
        result["_meta"] = {SERVER_INFO_META_KEY: server_info}
    return result


def create_task_result(record: TaskRecord, server_info: JSON | None = None) -> JSON:
    """Flat Task fields with `resultType:"task"`; no result, error, inputRequests or requestState."""
    return _with_server_info({"resultType": "task", **_task_fields(record)}, server_info)


def detailed_task(record: TaskRecord) -> JSON:
    """The DetailedTask variant for the current status (without `resultType`): `inputRequests` with every
    outstanding question, `result` when completed, `error` when failed."""
    task = _task_fields(record)
    if record.status is TaskStatus.INPUT_REQUIRED:
        task["inputRequests"] = record.input_requests
    elif record.status is TaskStatus.COMPLETED:
        task["result"] = record.result if record.result is not None else {"content": [], "resultType": "complete"}
    elif record.status is TaskStatus.FAILED:
        task["error"] = record.error if record.error is not None else internal_error("Task failed")
    return task


def get_task_result(record: TaskRecord, server_info: JSON | None = None) -> JSON:
    """`tasks/get` answers with the DetailedTask and `resultType:"complete"`."""
    return _with_server_info({"resultType": "complete", **detailed_task(record)}, server_info)


def ack_result(server_info: JSON | None = None) -> JSON:
    """The empty ack of `tasks/update` and `tasks/cancel`: nothing but `resultType` (and `_meta`)."""
    return _with_server_info({"resultType": "complete"}, server_info)


def progress_status_message(params: Any) -> str | None:
    """Upstream `notifications/progress` params → a `statusMessage` such as `50/100 — indexing`."""
    if not isinstance(params, dict):
        return None
    progress = params.get("progress")
    if not isinstance(progress, int | float) or isinstance(progress, bool):
        return None
    text = _number(progress)
    total = params.get("total")
    if isinstance(total, int | float) and not isinstance(total, bool):
        text = f"{text}/{_number(total)}"
    message = params.get("message")
    if isinstance(message, str) and message:
        text = f"{text} — {message}"
    return text


def _number(value: float) -> str:
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.3f}".rstrip("0").rstrip(".")  # 0.5, 12.125, 1234567.5: never an exponent


def failure_status_message(error: JSON) -> str:
    """A diagnostic `statusMessage` for a failed task (the Tasks extension asks for one), from its JSON-RPC
    error."""
    message = error.get("message")
    code = error.get("code")
    text = message if isinstance(message, str) and message else "the upstream call failed"
    has_code = isinstance(code, int) and not isinstance(code, bool)
    return f"{text} (JSON-RPC error {code})" if has_code else text


def queued_status_message(ahead: int) -> str:
    """The `statusMessage` of a task whose call waits for an upstream slot, with its place: `queued: 3 ahead`."""
    return f"queued: {ahead} ahead"
