"""wire/tasks.py: task ids, timestamps, expiry, and the Tasks-extension messages built from a TaskRecord.

Every built message is also validated against the published tasks-extension JSON Schema.
"""

from __future__ import annotations

import base64
import calendar
import dataclasses
import re
import string
from typing import Any

import jsonschema
import pytest

from proxy.wire.tasks import (
    TaskRecord,
    TaskStatus,
    ack_result,
    create_task_result,
    detailed_task,
    failure_status_message,
    get_task_result,
    iso_timestamp,
    new_task_id,
    progress_status_message,
)
from tests.support.schemas import SCHEMA_DIR, SchemaValidator

SCHEMA = SchemaValidator(SCHEMA_DIR / "tasks-extension-2026-07-28.schema.json")
SERVER_INFO_KEY = "io.modelcontextprotocol/serverInfo"
SERVER_INFO = {"name": "mcp-tasks-proxy", "version": "0.1.0"}

CREATED_MS = calendar.timegm((2026, 8, 1, 10, 0, 0)) * 1000  # 2026-08-01T10:00:00.000Z
UPDATED_MS = CREATED_MS + 2_345

ELICITATION = {
    "method": "elicitation/create",
    "params": {
        "mode": "form",
        "message": "Which region should the export cover?",
        "requestedSchema": {
            "type": "object",
            "properties": {"region": {"type": "string", "title": "Region", "description": "e.g. eu-west-1"}},
            "required": ["region"],
        },
    },
}
TOOL_RESULT = {"content": [{"type": "text", "text": "exported 42 rows"}], "isError": False}
UPSTREAM_ERROR = {"code": -32602, "message": "Unknown tool: nope"}

STATUS_DEFS = {
    TaskStatus.WORKING: "WorkingTask",
    TaskStatus.INPUT_REQUIRED: "InputRequiredTask",
    TaskStatus.COMPLETED: "CompletedTask",
    TaskStatus.FAILED: "FailedTask",
    TaskStatus.CANCELLED: "CancelledTask",
}
# The one status-specific key each status carries (None: no extra key).
STATUS_KEY = {
    TaskStatus.WORKING: None,
    TaskStatus.INPUT_REQUIRED: "inputRequests",
    TaskStatus.COMPLETED: "result",
    TaskStatus.FAILED: "error",
    TaskStatus.CANCELLED: None,
}
STATUS_SPECIFIC_KEYS = {"result", "error", "inputRequests"}


def record(status: TaskStatus = TaskStatus.WORKING, **changes: Any) -> TaskRecord:
    """A realistic record for `status`, with the fields that status implies filled in."""
    base = TaskRecord(
        task_id="task_" + "A" * 32,
        principal="sha256:" + "0" * 64,
        tool="export",
        status=status,
        created_at_ms=CREATED_MS,
        updated_at_ms=UPDATED_MS,
        ttl_ms=300_000,
        poll_interval_ms=1000,
        owner="proxy-1",
        on_restart="fail",
        request={"name": "export", "arguments": {"table": "orders"}},
    )
    if status is TaskStatus.INPUT_REQUIRED:
        base = dataclasses.replace(base, input_requests={"input-1": ELICITATION}, inputs_issued=1)
    elif status is TaskStatus.COMPLETED:
        base = dataclasses.replace(base, result=TOOL_RESULT)
    elif status is TaskStatus.FAILED:
        base = dataclasses.replace(base, error=UPSTREAM_ERROR)
    return dataclasses.replace(base, **changes)


# --- new_task_id -------------------------------------------------------------------------------------------


def test_task_id_shape() -> None:
    """`task_` + ≥ 192 bits of url-safe base64, ASCII: unguessable, and safe in a header."""
    task_id = new_task_id()
    assert task_id.isascii()
    assert task_id.startswith("task_")
    body = task_id.removeprefix("task_")
    assert re.fullmatch(r"[A-Za-z0-9_-]{32,}", body), task_id
    padded = body + "=" * (-len(body) % 4)
    assert len(base64.urlsafe_b64decode(padded)) * 8 >= 192


def test_task_ids_are_distinct_and_never_look_encoded() -> None:
    ids = [new_task_id() for _ in range(1000)]
    assert len(set(ids)) == 1000
    for task_id in ids:
        assert not task_id.startswith("=?base64?")
        assert "=" not in task_id  # no padding, so nothing a header decoder could take for an encoded word
        assert re.fullmatch(r"task_[A-Za-z0-9_-]{32,}", task_id), task_id
    # 32,000 random base64 characters use the whole 64-character url-safe alphabet (a hex or otherwise narrowed
    # id would not); the chance that a fair generator misses one is about 64 * (63/64) ** 32000, i.e. nil.
    alphabet = set(string.ascii_letters + string.digits + "-_")
    assert set("".join(task_id.removeprefix("task_") for task_id in ids)) == alphabet


# --- iso_timestamp -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("epoch_ms", "expected"),
    [
        (0, "1970-01-01T00:00:00.000Z"),
        (1, "1970-01-01T00:00:00.001Z"),
        (999, "1970-01-01T00:00:00.999Z"),
        (86_400_000, "1970-01-02T00:00:00.000Z"),
        (951_782_400_000, "2000-02-29T00:00:00.000Z"),
        (1_785_578_400_123, "2026-08-01T10:00:00.123Z"),
        (1_785_578_399_999, "2026-08-01T09:59:59.999Z"),
    ],
)
def test_iso_timestamp(epoch_ms: int, expected: str) -> None:
    assert iso_timestamp(epoch_ms) == expected


def test_iso_timestamp_keeps_every_millisecond() -> None:
    # No float rounding drift: each of the 1000 milliseconds of a 2026 second is rendered as itself.
    second = calendar.timegm((2026, 8, 1, 10, 0, 0)) * 1000
    for ms in range(1000):
        assert iso_timestamp(second + ms) == f"2026-08-01T10:00:00.{ms:03d}Z"


# --- TaskRecord.expired ------------------------------------------------------------------------------------


def test_expiry_boundary() -> None:
    """Expired at exactly createdAt + ttlMs, not one millisecond before."""
    task = record(ttl_ms=5_000)
    assert task.expires_at_ms == CREATED_MS + 5_000
    assert not task.expired(CREATED_MS)
    assert not task.expired(CREATED_MS + 4_999)
    assert task.expired(CREATED_MS + 5_000)
    assert task.expired(CREATED_MS + 5_001)


@pytest.mark.parametrize("status", list(TaskStatus))
def test_expiry_applies_to_every_status(status: TaskStatus) -> None:
    task = record(status, ttl_ms=10)
    assert not task.expired(CREATED_MS + 9)
    assert task.expired(CREATED_MS + 10)


def test_expiry_counts_from_creation_not_from_the_last_update() -> None:
    task = record(ttl_ms=1_000, updated_at_ms=CREATED_MS + 900)
    assert task.expires_at_ms == CREATED_MS + 1_000
    assert task.expired(CREATED_MS + 1_000)


def test_unlimited_ttl_never_expires() -> None:
    task = record(ttl_ms=None)
    assert task.expires_at_ms is None
    assert not task.expired(CREATED_MS)
    assert not task.expired(2**62)


# --- create_task_result: flat, `resultType: "task"`, no outcome --------------------------------------------


def test_create_task_result_is_flat() -> None:
    message = create_task_result(record())
    assert message == {
        "resultType": "task",
        "taskId": "task_" + "A" * 32,
        "status": "working",
        "createdAt": "2026-08-01T10:00:00.000Z",
        "lastUpdatedAt": "2026-08-01T10:00:02.345Z",
        "ttlMs": 300_000,
        "pollIntervalMs": 1000,
    }
    SCHEMA.validate(message, "CreateTaskResult")


@pytest.mark.parametrize("status", list(TaskStatus))
def test_create_task_result_never_carries_an_outcome(status: TaskStatus) -> None:
    message = create_task_result(record(status))
    assert message["resultType"] == "task"
    assert message["status"] == status.value
    for key in ("result", "error", "inputRequests", "requestState", "ttl", "pollInterval", "task"):
        assert key not in message, key
    SCHEMA.validate(message, "CreateTaskResult")


def test_create_task_result_with_unlimited_ttl_keeps_the_key() -> None:
    """`ttlMs` is always present; null means unlimited."""
    message = create_task_result(record(ttl_ms=None))
    assert "ttlMs" in message
    assert message["ttlMs"] is None
    SCHEMA.validate(message, "CreateTaskResult")


def test_create_task_result_optional_fields_only_when_set() -> None:
    bare = create_task_result(record(poll_interval_ms=None, status_message=None))
    assert "pollIntervalMs" not in bare
    assert "statusMessage" not in bare
    assert "_meta" not in bare
    SCHEMA.validate(bare, "CreateTaskResult")

    full = create_task_result(record(poll_interval_ms=250, status_message="queued"))
    assert full["pollIntervalMs"] == 250
    assert full["statusMessage"] == "queued"
    SCHEMA.validate(full, "CreateTaskResult")


def test_create_task_result_server_info_only_when_given() -> None:
    message = create_task_result(record(), server_info=SERVER_INFO)
    assert message["_meta"] == {SERVER_INFO_KEY: SERVER_INFO}
    SCHEMA.validate(message, "CreateTaskResult")
    assert "_meta" not in create_task_result(record())
    assert "_meta" not in create_task_result(record(), server_info=None)


def test_the_schema_check_is_not_vacuous() -> None:
    message = create_task_result(record())
    message["resultType"] = "complete"
    with pytest.raises(jsonschema.ValidationError):
        SCHEMA.validate(message, "CreateTaskResult")
    with pytest.raises(jsonschema.ValidationError):
        SCHEMA.validate(detailed_task(record(TaskStatus.WORKING)), "CompletedTask")


# --- get_task_result / detailed_task: `resultType: "complete"`, the variant of the status ------------------


@pytest.mark.parametrize("status", list(TaskStatus))
def test_get_task_result_for_every_status(status: TaskStatus) -> None:
    message = get_task_result(record(status))
    assert message["resultType"] == "complete"
    assert message["taskId"] == "task_" + "A" * 32
    assert message["status"] == status.value
    assert message["createdAt"] == "2026-08-01T10:00:00.000Z"
    assert message["lastUpdatedAt"] == "2026-08-01T10:00:02.345Z"
    assert message["ttlMs"] == 300_000
    assert message["pollIntervalMs"] == 1000
    expected_key = STATUS_KEY[status]
    present = STATUS_SPECIFIC_KEYS & message.keys()
    assert present == ({expected_key} if expected_key else set())
    assert "_meta" not in message
    SCHEMA.validate(message, "GetTaskResult")
    SCHEMA.validate(message, STATUS_DEFS[status])


@pytest.mark.parametrize("status", list(TaskStatus))
def test_detailed_task_is_the_get_result_without_result_type(status: TaskStatus) -> None:
    task = detailed_task(record(status))
    assert "resultType" not in task
    assert task["status"] == status.value
    SCHEMA.validate(task, STATUS_DEFS[status])
    SCHEMA.validate(task, "DetailedTask")
    others = [name for other, name in STATUS_DEFS.items() if other is not status]
    for name in others:
        with pytest.raises(jsonschema.ValidationError):
            SCHEMA.validate(task, name)


def test_working_task_carries_no_outcome() -> None:
    message = get_task_result(record(TaskStatus.WORKING, status_message="50/100 — indexing"))
    assert not STATUS_SPECIFIC_KEYS & message.keys()
    assert message["statusMessage"] == "50/100 — indexing"
    SCHEMA.validate(message, "GetTaskResult")


def test_input_required_task_carries_its_input_requests() -> None:
    message = get_task_result(record(TaskStatus.INPUT_REQUIRED))
    assert message["inputRequests"] == {"input-1": ELICITATION}
    SCHEMA.validate(message, "InputRequiredTask")
    SCHEMA.validate(message, "GetTaskResult")


def test_input_requests_are_validated_by_the_schema() -> None:
    broken = {"input-1": {"method": "elicitation/create", "params": {"mode": "form"}}}  # no message, no schema
    message = get_task_result(record(TaskStatus.INPUT_REQUIRED, input_requests=broken))
    with pytest.raises(jsonschema.ValidationError):
        SCHEMA.validate(message, "InputRequiredTask")


def test_completed_task_carries_the_tool_result() -> None:
    message = get_task_result(record(TaskStatus.COMPLETED))
    assert message["result"] == TOOL_RESULT
    SCHEMA.validate(message, "CompletedTask")


def test_completed_task_without_a_stored_result_still_has_one() -> None:
    message = get_task_result(record(TaskStatus.COMPLETED, result=None))
    assert isinstance(message["result"], dict)
    assert message["result"].get("content") == []
    SCHEMA.validate(message, "CompletedTask")
    SCHEMA.validate(message, "GetTaskResult")


def test_failed_task_carries_the_error() -> None:
    message = get_task_result(record(TaskStatus.FAILED))
    assert message["error"] == UPSTREAM_ERROR
    SCHEMA.validate(message, "FailedTask")


def test_failed_task_without_a_stored_error_gets_an_internal_error() -> None:
    message = get_task_result(record(TaskStatus.FAILED, error=None))
    assert message["error"]["code"] == -32603
    assert isinstance(message["error"]["message"], str)
    assert message["error"]["message"]
    SCHEMA.validate(message, "FailedTask")


def test_cancelled_task_carries_no_outcome() -> None:
    # Even if a result or error was stored before the cancel, a cancelled task shows neither.
    message = get_task_result(record(TaskStatus.CANCELLED, result=TOOL_RESULT, error=UPSTREAM_ERROR))
    assert not STATUS_SPECIFIC_KEYS & message.keys()
    SCHEMA.validate(message, "CancelledTask")


def test_stale_fields_of_another_status_are_not_shown() -> None:
    # A completed record that still holds input requests from an earlier round shows only its result.
    message = get_task_result(record(TaskStatus.COMPLETED, input_requests={"input-1": ELICITATION}))
    assert STATUS_SPECIFIC_KEYS & message.keys() == {"result"}


def test_get_task_result_with_unlimited_ttl_and_server_info() -> None:
    message = get_task_result(record(TaskStatus.COMPLETED, ttl_ms=None, poll_interval_ms=None), SERVER_INFO)
    assert "ttlMs" in message
    assert message["ttlMs"] is None
    assert "pollIntervalMs" not in message
    assert message["_meta"] == {SERVER_INFO_KEY: SERVER_INFO}
    SCHEMA.validate(message, "GetTaskResult")


# --- ack_result: empty apart from `resultType` -------------------------------------------------------------


def test_ack_result_is_empty() -> None:
    message = ack_result()
    assert message == {"resultType": "complete"}
    SCHEMA.validate(message, "UpdateTaskResult")
    SCHEMA.validate(message, "CancelTaskResult")


def test_ack_result_with_server_info() -> None:
    message = ack_result(SERVER_INFO)
    assert message == {"resultType": "complete", "_meta": {SERVER_INFO_KEY: SERVER_INFO}}
    SCHEMA.validate(message, "UpdateTaskResult")
    SCHEMA.validate(message, "CancelTaskResult")


def test_ack_results_are_independent_objects() -> None:
    first = ack_result()
    first["extra"] = True
    assert ack_result() == {"resultType": "complete"}


# --- status messages ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({"progress": 50, "total": 100, "message": "indexing"}, "50/100 — indexing"),
        ({"progress": 50, "total": 100}, "50/100"),
        ({"progress": 50}, "50"),
        ({"progress": 50, "message": "indexing"}, "50 — indexing"),
        ({"progress": 0}, "0"),
        ({"progress": 0.5, "total": 2}, "0.5/2"),
        ({"progress": 50.0, "total": 100.0}, "50/100"),
        ({"progress": 1.25, "total": 2.5, "message": "halfway"}, "1.25/2.5 — halfway"),
        ({"progress": 50, "message": ""}, "50"),
        ({"progress": 50, "total": True}, "50"),
        ({"progress": 50, "total": "100"}, "50"),
        ({"progress": 50, "message": 7}, "50"),
        ({"progressToken": "t1", "progress": 3, "total": 9}, "3/9"),
    ],
)
def test_progress_status_message(params: dict[str, Any], expected: str) -> None:
    assert progress_status_message(params) == expected


@pytest.mark.parametrize(
    "params",
    [
        {"total": 100, "message": "indexing"},
        {"progress": None},
        {"progress": True, "total": 100},
        {"progress": False},
        {"progress": "50", "total": 100},
        {"progress": [50]},
        {},
        None,
        "50/100",
        50,
        [50, 100],
    ],
)
def test_progress_status_message_without_a_number(params: Any) -> None:
    assert progress_status_message(params) is None


def test_failure_status_message_names_message_and_code() -> None:
    """A diagnostic statusMessage for a failed task."""
    text = failure_status_message({"code": -32602, "message": "Unknown tool: nope"})
    assert "Unknown tool: nope" in text
    assert "-32602" in text


def test_failure_status_message_without_a_message_still_has_the_code() -> None:
    text = failure_status_message({"code": -32603})
    assert text
    assert "-32603" in text


def test_failure_status_message_without_a_code() -> None:
    text = failure_status_message({"message": "boom"})
    assert "boom" in text
    assert "None" not in text


# --- TaskStatus --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "terminal"),
    [
        (TaskStatus.WORKING, False),
        (TaskStatus.INPUT_REQUIRED, False),
        (TaskStatus.COMPLETED, True),
        (TaskStatus.FAILED, True),
        (TaskStatus.CANCELLED, True),
    ],
)
def test_terminal(status: TaskStatus, terminal: bool) -> None:
    assert status.terminal is terminal


def test_status_values_are_the_wire_values() -> None:
    assert [status.value for status in TaskStatus] == ["working", "input_required", "completed", "failed", "cancelled"]
    for status in TaskStatus:
        SCHEMA.validate(status.value, "TaskStatus")


def test_progress_numbers_are_never_written_as_exponents() -> None:
    assert progress_status_message({"progress": 1234567.5}) == "1234567.5"
    assert progress_status_message({"progress": 1 / 3, "total": 1}) == "0.333/1"


def test_a_boolean_error_code_is_not_shown_as_a_code() -> None:
    assert failure_status_message({"code": True, "message": "x"}) == "x"
