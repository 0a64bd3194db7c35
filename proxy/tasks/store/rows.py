"""The row codec and the SQL both stores share: a `tasks` row's columns, a record to and from a row, the values
each write sets, the writes of a live task alike on every backend, and the quota window counted in memory.

Depends on `proxy.wire` and the store's contract (`base.py`) only; it must not import a database driver,
aiohttp, the runner or the front.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from proxy.tasks.store.base import Fence, StoreError, TaskQuery
from proxy.wire.jsonrpc import JSON, RawJSON
from proxy.wire.tasks import LIVE, TERMINAL, TaskRecord, TaskStatus

COLUMNS: Final = (
    "task_id",
    "principal",
    "tool",
    "status",
    "status_message",
    "created_at_ms",
    "updated_at_ms",
    "ttl_ms",
    "expires_at_ms",
    "poll_interval_ms",
    "owner",
    "on_restart",
    "request",
    "result",
    "error",
    "input_requests",
    "inputs_issued",
    "rerun_principal",
    "client_capabilities",
    "upstream_task_id",
    "upstream_session_id",
    "upstream_input_ids",
    "traceparent",
    "job_id",
    "queued_at_ms",
)
STATUS_KEYS: Final = tuple(status.value for status in TaskStatus)
LIVE_SQL: Final = ", ".join(f"'{status.value}'" for status in sorted(LIVE))
TERMINAL_SQL: Final = ", ".join(f"'{status.value}'" for status in sorted(TERMINAL))
MESSAGE_RETENTION_MS: Final = 3_600_000  # a message its replica never took (it died, nobody took over) goes


# Every column but the two that can be large and hold what callers sent and got: a listing reads neither.
LIST_COLUMNS: Final = ", ".join(
    {"request": "'{}' AS request", "result": "NULL AS result"}.get(column, column) for column in COLUMNS
)


def query_sql(query: TaskQuery, mark: str) -> tuple[str, list[Any]]:
    """`list_tasks` as one SELECT with `mark` as the driver's placeholder (`?` or `%s`), and its parameters."""
    clauses: list[str] = []
    params: list[Any] = []
    if query.statuses:
        clauses.append(f"status IN ({', '.join(mark for _ in query.statuses)})")
        params.extend(sorted(status.value for status in query.statuses))
    for column, value in (("tool", query.tool), ("principal", query.principal)):
        if value is not None:
            clauses.append(f"{column} = {mark}")
            params.append(value)
    if query.created_before_ms is not None:
        clauses.append(f"created_at_ms < {mark}")
        params.append(query.created_before_ms)
    if query.created_after_ms is not None:
        clauses.append(f"created_at_ms > {mark}")
        params.append(query.created_after_ms)
    if query.after is not None:
        clauses.append(f"(created_at_ms < {mark} OR (created_at_ms = {mark} AND task_id < {mark}))")
        params.extend([query.after[0], query.after[0], query.after[1]])
    where = f" WHERE {' AND '.join(clauses)}" if clauses else ""
    sql = f"SELECT {LIST_COLUMNS} FROM tasks{where} ORDER BY created_at_ms DESC, task_id DESC LIMIT {mark}"
    return sql, [*params, query.limit]


def encode(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def decode(text: str | None) -> Any:
    return None if text is None else json.loads(text)


def raw_result(text: str | None) -> RawJSON | None:
    """A stored result stays text: it is only ever sent on, and it can be megabytes. Only the proxy writes it
    (always an object); a value cut short is caught here rather than sent."""
    if text is None:
        return None
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError("the stored result is not a JSON object")
    return RawJSON(text)


def encode_result(result: JSON | RawJSON | None) -> str | None:
    if isinstance(result, RawJSON):
        return result.text
    return None if result is None else encode(result)


def record_from_row(row: Mapping[str, Any]) -> TaskRecord:
    """A `tasks` row (column name → value) as a `TaskRecord`; JSON columns decoded, the result kept as text."""
    return TaskRecord(
        task_id=row["task_id"],
        principal=row["principal"],
        tool=row["tool"],
        status=TaskStatus(row["status"]),
        created_at_ms=row["created_at_ms"],
        updated_at_ms=row["updated_at_ms"],
        ttl_ms=row["ttl_ms"],
        poll_interval_ms=row["poll_interval_ms"],
        owner=row["owner"],
        on_restart=row["on_restart"],
        request=decode(row["request"]),
        status_message=row["status_message"],
        result=raw_result(row["result"]),
        error=decode(row["error"]),
        input_requests=decode(row["input_requests"]),
        inputs_issued=row["inputs_issued"],
        rerun_principal=row["rerun_principal"],
        client_capabilities=decode(row["client_capabilities"]),
        upstream_task_id=row["upstream_task_id"],
        upstream_session_id=row["upstream_session_id"],
        upstream_input_ids=decode(row["upstream_input_ids"]),
        traceparent=row["traceparent"],
        job_id=row["job_id"],
        queued_at_ms=row["queued_at_ms"],
    )


def records_from_rows(rows: list[dict[str, Any]]) -> list[TaskRecord]:
    records = []
    for row in rows:
        try:
            records.append(record_from_row(row))
        except (ValueError, TypeError) as exc:
            raise StoreError(f"corrupt task record {row.get('task_id')!r}: {exc}") from exc
    return records


def row_from_record(record: TaskRecord) -> dict[str, Any]:
    return {
        "task_id": record.task_id,
        "principal": record.principal,
        "tool": record.tool,
        "status": TaskStatus(record.status).value,
        "status_message": record.status_message,
        "created_at_ms": record.created_at_ms,
        "updated_at_ms": record.updated_at_ms,
        "ttl_ms": record.ttl_ms,
        "expires_at_ms": record.expires_at_ms,
        "poll_interval_ms": record.poll_interval_ms,
        "owner": record.owner,
        "on_restart": record.on_restart,
        "request": encode(record.request),
        "result": encode_result(record.result),
        "error": None if record.error is None else encode(record.error),
        "input_requests": encode(record.input_requests),
        "inputs_issued": record.inputs_issued,
        "rerun_principal": record.rerun_principal,
        "client_capabilities": encode(record.client_capabilities),
        "upstream_task_id": record.upstream_task_id,
        "upstream_session_id": record.upstream_session_id,
        "upstream_input_ids": encode(record.upstream_input_ids),
        "traceparent": record.traceparent,
        "job_id": record.job_id,
        "queued_at_ms": record.queued_at_ms,
    }


def settle_values(
    status: TaskStatus, result: JSON | None, error: JSON | None, status_message: str | None
) -> dict[str, Any]:
    """The columns a settle writes (ValueError for a live status)."""
    if TaskStatus(status) not in TERMINAL:
        raise ValueError(f"settle() needs a terminal status, not {status!r}")
    return {
        "status": TaskStatus(status).value,
        "result": encode_result(result),
        "error": None if error is None else encode(error),
        "status_message": status_message,
        "input_requests": "{}",
        "rerun_principal": None,
        "upstream_input_ids": "{}",
    }


def inputs_values(input_requests: JSON, inputs_issued: int, upstream_input_ids: JSON | None = None) -> dict[str, Any]:
    """The live task's outstanding questions: `input_required` with them, `working` without any; for a task
    the upstream runs itself, also their upstream ids."""
    status = TaskStatus.INPUT_REQUIRED if input_requests else TaskStatus.WORKING
    values = {"status": status.value, "input_requests": encode(input_requests), "inputs_issued": inputs_issued}
    if upstream_input_ids is not None:
        values["upstream_input_ids"] = encode(upstream_input_ids)
    return values


def claim_values(owner: str, status_message: str) -> dict[str, Any]:
    """A live task taken over by `owner` to be run again from the start: `working`, no questions."""
    return {
        "owner": owner,
        "status": TaskStatus.WORKING.value,
        "status_message": status_message,
        "input_requests": "{}",
    }


Update = Callable[[str, Mapping[str, Any], int, Fence | None], Awaitable[TaskRecord | None]]


class LiveWrites:
    """The writes of a live task, alike on every backend: each is one conditional update through the backend's
    own `update` (a settled task never changes, so the first settle wins). A backend's records port composes
    one and offers its writes as its own."""

    def __init__(self, update: Update) -> None:
        self._update = update

    async def set_inputs(
        self,
        task_id: str,
        input_requests: JSON,
        inputs_issued: int,
        *,
        now_ms: int,
        fence: Fence | None = None,
        upstream_input_ids: JSON | None = None,
    ) -> TaskRecord | None:
        """The live task's outstanding questions: `input_required` with them, `working` without any."""
        return await self._update(
            task_id, inputs_values(input_requests, inputs_issued, upstream_input_ids), now_ms, fence
        )

    async def set_status_message(
        self, task_id: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None:
        return await self._update(task_id, {"status_message": status_message}, now_ms, fence)

    async def claim(
        self, task_id: str, owner: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None:
        """A live task taken over by `owner` to be run again from the start: `working`, no questions."""
        return await self._update(task_id, claim_values(owner, status_message), now_ms, fence)

    async def set_queued(
        self,
        task_id: str,
        queued_at_ms: int | None,
        status_message: str,
        *,
        rerun_principal: str | None,
        now_ms: int,
        fence: Fence | None = None,
    ) -> TaskRecord | None:
        """The live task's call waits for an upstream slot since `queued_at_ms` (its place is in the
        statusMessage), or, with None, got one; while it waits, the sealed principal a run after a restart
        presents upstream is kept (`rerun_principal`), as for an `on_restart: rerun` task."""
        values = {"queued_at_ms": queued_at_ms, "status_message": status_message, "rerun_principal": rerun_principal}
        return await self._update(task_id, values, now_ms, fence)

    async def settle(
        self,
        task_id: str,
        status: TaskStatus,
        *,
        now_ms: int,
        result: JSON | None = None,
        error: JSON | None = None,
        status_message: str | None = None,
        fence: Fence | None = None,
    ) -> TaskRecord | None:
        """Only a live task settles, so the first settle wins (on whichever replica) and a terminal state never
        changes."""
        return await self._update(task_id, settle_values(status, result, error, status_message), now_ms, fence)


class WindowCounts:
    """Calls counted per key in the current quota window, in this process's memory (a backend that one process
    holds alone): nothing is written per call, and a new window starts every count afresh."""

    def __init__(self) -> None:
        self._window_start_ms: int | None = None
        self._counts: dict[str, int] = {}

    def count(self, key: str, window_start_ms: int) -> int:
        if window_start_ms != self._window_start_ms:
            self._window_start_ms = window_start_ms
            self._counts = {}
        calls = self._counts[key] = self._counts.get(key, 0) + 1
        return calls
