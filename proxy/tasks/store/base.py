"""What every task store is: the `TaskStore` protocol, its errors and value types (the row codec: `rows.py`).

Shared by the SQLite and the PostgreSQL store. Depends on `proxy.wire` only; it must not import a database
driver, aiohttp, the runner or the front.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Final, Protocol

from proxy.tasks.store.grants import Grants
from proxy.tasks.store.keys import KeyRecord
from proxy.wire.jsonrpc import JSON
from proxy.wire.tasks import TaskRecord, TaskStatus


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


# The tools' duration estimates the store keeps for pacing (`tasks/services/pacing.py` applies the same rule in
# memory): each completion moves its tool's estimate by this share of the difference; the least recently
# completed tools beyond the cap are forgotten.
DURATION_SMOOTHING: Final = 0.3
MAX_DURATION_TOOLS: Final = 1024

FailureListener = Callable[[str, str], None]  # (operation, reason label) of each operation the store could not do


class StoreHealth:
    """What a store knows of its own availability, for readiness and metrics. `available` turns False at the
    first operation that met `StoreUnavailableError` and True again at the next one that succeeded; each failure
    is reported to the listeners registered with `on_failure` as (operation, reason label: `timeout`,
    `connection`, `read_only`, ...)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.available = True
        self._listeners: list[FailureListener] = []

    def on_failure(self, listener: FailureListener) -> None:
        """`listener(operation, reason)` runs at each failure from now on (the metrics, once they exist)."""
        self._listeners.append(listener)

    def failed(self, operation: str, reason: str, detail: str) -> StoreUnavailableError:
        """Note a failure; the error to raise for it."""
        self.available = False
        for listener in self._listeners:
            listener(operation, reason)
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

    @property
    def grants(self) -> Grants:
        """The kept grants of `upstream.credentials: exchange` (`grants.py`)."""
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
