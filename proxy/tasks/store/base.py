"""What every task store shares: its errors and value types (its ports: `contract.py`; the row codec: `rows.py`).
Depends on `proxy.wire` only; it must not import a database driver, aiohttp or tasks."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

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
