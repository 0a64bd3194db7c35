"""What every task store is: the `TaskStore` protocol, its errors and value types, and the row codec.

Shared by the SQLite and the PostgreSQL store. Depends on `proxy.wire` only; it must not import a database
driver, aiohttp, the runner or the front.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Final, Protocol

from proxy.tasks.store.keys import KeyRecord
from proxy.wire.jsonrpc import JSON, RawJSON
from proxy.wire.tasks import LIVE, TERMINAL, TaskRecord, TaskStatus


class StoreError(Exception):
    """The task store could not do what was asked (the database failed, is wrong, or the store is closed)."""


class StoreFullError(StoreError):
    """`max_records` reached and no settled record can be evicted."""


class StoreLockedError(StoreError):
    """Another mcp-tasks-proxy process (or another open store in this one) holds the SQLite database file."""


class StoreUnavailableError(StoreError):
    """The store cannot be reached or cannot commit right now: PostgreSQL down, frozen, failing over or past its
    deadline; SQLite's disk full, its file system read-only, or an I/O error. Transient, unlike the other
    `StoreError`s: a request that needs the store is answered 503 with `Retry-After`, and a settlement that hits
    it is kept and written again later, never dropped. `kind` names the backend ("sqlite" or "postgres")."""

    def __init__(self, kind: str, reason: str, *, detail: str | None = None) -> None:
        super().__init__(f"the task store ({kind}) is unavailable: {detail or reason}")
        self.kind = kind
        self.reason = reason  # a short word that may be told to clients ("timeout", "disk full", ...)
        self.detail = detail  # what the driver said (hosts, paths): for the proxy's log only


FailureListener = Callable[[str, str], None]  # (operation, reason label) of each operation the store could not do


class StoreHealth:
    """What a store knows of its own availability, for readiness and metrics. `available` turns False at the
    first operation that met `StoreUnavailableError` and True again at the next one that succeeded; each failure
    is reported to `listener` as (operation, reason label: `timeout`, `connection`, `read_only`, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.available = True
        self.listener: FailureListener | None = None

    def failed(self, operation: str, reason: str, detail: str) -> StoreUnavailableError:
        """Note a failure; the error to raise for it."""
        self.available = False
        if self.listener is not None:
            self.listener(operation, reason)
        return StoreUnavailableError(self.kind, reason, detail=f"{operation}: {detail}")


class FencedError(StoreError):
    """A write carried a `Fence` that no longer holds: the task is live but not owned under that lease (another
    replica took it over, or the writer's lease lapsed). The writer must stop working on the task."""


@dataclass(frozen=True, slots=True)
class Fence:
    """Proof of ownership carried by the writes a task's owner makes: the replica and its lease's epoch.

    `renew_lease` hands one out; a new epoch means the lease lapsed in between (tasks may have been taken over).
    """

    owner: str
    epoch: int


# Kinds of change on the feed. Messages (`notify_owner`, `notify_replica`) carry kinds of their caller's choosing.
STATUS: Final = "status"  # a task's record changed (status, statusMessage, inputRequests or owner)
RESYNC: Final = "resync"  # the feed (re)started: changes may have been missed, re-read what you follow
CANCEL: Final = "cancel"  # a message: the owner should stop the task's upstream call
INPUT: Final = "input"  # a message: answers for the owner's outstanding questions
RESERVED_KINDS: Final = frozenset({STATUS, RESYNC})
MAX_KIND_CHARS: Final = 64


@dataclass(frozen=True, slots=True)
class Change:
    """One event of the change feed. A wake-up, not the data: read the record or `take_messages` for it.

    `key` is the task id (STATUS, a task's messages) or a message's key, "" for RESYNC; `recipient` is the
    task's owner (STATUS) or the replica a message is addressed to.
    """

    kind: str
    key: str = ""
    recipient: str = ""
    status: TaskStatus | None = None

    def to_json(self) -> str:
        body: dict[str, str] = {"k": self.kind, "t": self.key, "r": self.recipient}
        if self.status is not None:
            body["s"] = self.status.value
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Change:
        body = json.loads(text)
        status = body.get("s")
        return cls(body["k"], body.get("t", ""), body.get("r", ""), None if status is None else TaskStatus(status))

    def wanted_by(self, replica_id: str | None) -> bool:
        """Status changes and resyncs go to everyone; a message only to the replica it is addressed to."""
        return replica_id is None or self.kind in RESERVED_KINDS or self.recipient == replica_id


@dataclass(frozen=True, slots=True)
class Message:
    """A durable request for one replica (a cancel, answers, ...): kept until that replica takes it."""

    message_id: int
    recipient: str
    kind: str
    key: str
    payload: JSON


EXPIRED: Final = "expired"  # a tombstone's reason: the record's ttlMs ran out and the sweep (or a read) dropped it
PURGED: Final = "purged"  # a tombstone's reason: an operator's `tasks purge` deleted it


@dataclass(frozen=True, slots=True)
class Tombstone:
    """What is left of a deleted record for a while: why it went and when, so that a caller asking for its own
    task later learns it expired rather than that it never existed. Kept per task id AND principal hash: it
    answers only the principal whose task it was."""

    task_id: str
    reason: str
    gone_at_ms: int
    expired_at_ms: int | None


MAX_LIST_LIMIT: Final = 1000  # records one `list_tasks` page holds at most


@dataclass(frozen=True, slots=True)
class TaskQuery:
    """An operator's filter over the records (`list_tasks`), newest first: by status, tool, principal hash and
    creation time (`created_before_ms` / `created_after_ms`, both exclusive); a page of at most `limit`
    records after the page key `after` (`page_key` of the last record of the previous page)."""

    statuses: frozenset[TaskStatus] = frozenset()
    tool: str | None = None
    principal: str | None = None
    created_before_ms: int | None = None
    created_after_ms: int | None = None
    after: tuple[int, str] | None = None
    limit: int = 50

    def __post_init__(self) -> None:
        if not 1 <= self.limit <= MAX_LIST_LIMIT:
            raise ValueError(f"limit must be 1-{MAX_LIST_LIMIT}, got {self.limit}")


def page_key(record: TaskRecord) -> str:
    """Where the page after `record` starts, as text (`parse_page_key` reads it back)."""
    return f"{record.created_at_ms}:{record.task_id}"


def parse_page_key(text: str) -> tuple[int, str]:
    created, _, task_id = text.partition(":")
    if not created.isdigit() or not task_id:
        raise ValueError(f"not a page key (CREATED_MS:TASK_ID): {text!r}")
    return int(created), task_id


def check_kind(kind: str) -> None:
    if not kind or len(kind) > MAX_KIND_CHARS or kind in RESERVED_KINDS:
        raise ValueError(f"a message kind is 1-{MAX_KIND_CHARS} characters, not {sorted(RESERVED_KINDS)}: {kind!r}")


class TaskStore(Protocol):
    """What the runner and the app need from a task store: `SqliteTaskStore` (one process) and
    `PostgresTaskStore` (several replicas on one database).

    Writes of a live task take an optional `fence`: given, the write happens only while the task is owned by
    `fence.owner` under a lease of that epoch, else FencedError. Without one (a cancel from any replica, the
    TTL sweep) the write is unconditional, and the first settle still wins.
    """

    async def create(self, record: TaskRecord) -> None: ...

    async def get(self, task_id: str, *, principal: str | None = None) -> TaskRecord | None:
        """The record, or None; with `principal`, only when it is that caller's (checked before anything of the
        record, its result included, is read out of the database)."""
        ...

    async def set_inputs(
        self,
        task_id: str,
        input_requests: JSON,
        inputs_issued: int,
        *,
        now_ms: int,
        fence: Fence | None = None,
        upstream_input_ids: JSON | None = None,
    ) -> TaskRecord | None: ...

    async def set_status_message(
        self, task_id: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None: ...

    async def claim(
        self, task_id: str, owner: str, status_message: str, *, now_ms: int, fence: Fence | None = None
    ) -> TaskRecord | None: ...

    async def set_queued(
        self,
        task_id: str,
        queued_at_ms: int | None,
        status_message: str,
        *,
        rerun_principal: str | None,
        now_ms: int,
        fence: Fence | None = None,
    ) -> TaskRecord | None: ...

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
    ) -> TaskRecord | None: ...

    async def live(self, owner: str | None = None) -> list[TaskRecord]: ...

    async def expired_live(self, now_ms: int) -> list[TaskRecord]: ...

    async def settle_expired(self, now_ms: int, *, error: JSON, status_message: str) -> list[TaskRecord]: ...

    async def purge_expired(self, now_ms: int, *, tombstones: bool = False) -> int:
        """Settled records past their TTL (with `tombstones`, each leaves an EXPIRED tombstone)."""
        ...

    async def delete(self, task_id: str, *, tombstone_at_ms: int | None = None) -> bool:
        """The record gone; with `tombstone_at_ms`, an EXPIRED tombstone of that time left in its place."""
        ...

    async def tombstone(self, task_id: str, principal: str) -> Tombstone | None:
        """The tombstone of `principal`'s deleted task `task_id`, or None (never another principal's)."""
        ...

    async def trim_tombstones(self, gone_before_ms: int, keep: int) -> int:
        """Tombstones older than `gone_before_ms` deleted, and the oldest beyond the newest `keep`; how many."""
        ...

    async def stats(self) -> dict[str, int]: ...

    # -- operators ---------------------------------------------------------------------------------------------

    async def list_tasks(self, query: TaskQuery) -> list[TaskRecord]:
        """One page of the records `query` selects, newest first, without their request and result."""
        ...

    async def cancel_task(self, task_id: str, status_message: str, *, now_ms: int) -> TaskRecord | None:
        """An operator's cancel: the live task settled `cancelled`, and its owner told to stop the call (on
        PostgreSQL by the settlement's own notification, on SQLite by a CANCEL message the running proxy
        polls for); the settled record, or None when the task is not live."""
        ...

    async def purge_settled(self, updated_before_ms: int, *, dry_run: bool, tombstone_at_ms: int | None = None) -> int:
        """Settled records last changed before `updated_before_ms`: how many there are, deleted unless
        `dry_run` (with `tombstone_at_ms`, each leaves a PURGED tombstone). Live tasks are never touched."""
        ...

    async def pending_messages(self, replica_id: str) -> bool:
        """Are messages waiting for `replica_id`? (A read; on SQLite the proxy asks this to notice what the CLI,
        another process, posted.)"""
        ...

    async def check_writable(self, now_ms: int) -> None: ...

    @property
    def health(self) -> StoreHealth:
        """Whether the store took its latest operation, and who hears of each failure (metrics)."""
        ...

    async def size_bytes(self) -> int: ...

    async def close(self) -> None: ...

    # -- replicas: leases and take-over ------------------------------------------------------------------------

    @property
    def shared(self) -> bool:
        """Several processes may use this store at once (PostgreSQL): a restart takes over the tasks of dead
        replicas (`expired_replicas`, `take_over`) instead of every live task."""
        ...

    async def renew_lease(self, replica_id: str, lease_seconds: float) -> Fence: ...

    async def replica_alive(self, replica_id: str) -> bool: ...

    async def release_lease(self, fence: Fence) -> None: ...

    async def expired_replicas(self) -> list[str]: ...

    async def take_over(self, dead_replica: str, fence: Fence) -> list[TaskRecord]: ...

    # -- messages and the change feed ----------------------------------------------------------------------------

    async def notify_owner(self, task_id: str, kind: str, payload: JSON) -> Message | None: ...

    async def notify_replica(self, replica_id: str, kind: str, key: str, payload: JSON) -> Message: ...

    async def take_messages(self, replica_id: str) -> list[Message]: ...

    def changes(self, for_replica: str | None = None) -> AbstractAsyncContextManager[AsyncIterator[Change]]: ...

    # -- shared pacing ---------------------------------------------------------------------------------------------

    async def observe_duration(self, tool: str, duration_ms: float) -> float: ...

    async def duration_estimates(self) -> dict[str, float]: ...

    # -- quota windows ---------------------------------------------------------------------------------------------

    async def count_call(self, key: str, window_start_ms: int) -> int: ...

    # -- idempotency keys (draft-ietf-httpapi-idempotency-key-header) -----------------------------------------

    async def claim_key(self, record: KeyRecord) -> KeyRecord | None:
        """Claim `record.key` in `record.scope` for `record.owner`, running: None when this claim won it (at
        once, across replicas: the primary key decides), else the record that holds it. A record past its
        retention counts as free and is replaced."""
        ...

    async def get_key(self, scope: str, key: str) -> KeyRecord | None: ...

    async def settle_key(self, record: KeyRecord, outcome: str) -> bool:
        """Record the outcome of a running key held by `record.owner`; False when it is not (any more)."""
        ...

    async def release_key(self, record: KeyRecord) -> None:
        """Forget a running key held by `record.owner` (its request was refused before the upstream saw it)."""
        ...

    async def purge_keys(self, now_ms: int) -> int:
        """Keys past their retention; how many."""
        ...


# -- the row codec and SQL shared by both stores -------------------------------------------------------------------

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


class LiveWrites:
    """The writes of a live task, alike on every backend: each is one conditional update (`_update`, the
    backend's own), so a settled task never changes and the first settle wins."""

    async def _update(
        self, task_id: str, values: Mapping[str, Any], now_ms: int, fence: Fence | None
    ) -> TaskRecord | None:
        raise NotImplementedError

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
