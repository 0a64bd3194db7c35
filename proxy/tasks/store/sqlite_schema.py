"""The SQLite store's schema: its sqlite-utils migrations and the SQL the store runs.

Depends on sqlite-utils and `rows`; imported only by `sqlite.py`.
"""

from __future__ import annotations

import json
from typing import Final

from sqlite_utils import Database, Migrations

from proxy.tasks.store import grants
from proxy.tasks.store.rows import COLUMNS, LIVE_SQL, TERMINAL_SQL
from proxy.wire.tasks import TERMINAL, TaskStatus

MIGRATIONS: Final = Migrations("mcp-tasks-proxy")


@MIGRATIONS(name="0001_create_tasks")
def _create_tasks(db: Database) -> None:
    tasks = db.table("tasks")
    tasks.create(
        {
            "task_id": str,
            "principal": str,
            "tool": str,
            "status": str,
            "status_message": str,
            "created_at_ms": int,
            "updated_at_ms": int,
            "ttl_ms": int,
            "expires_at_ms": int,
            "poll_interval_ms": int,
            "owner": str,
            "on_restart": str,
            "request": str,
            "result": str,
            "error": str,
            "input_requests": str,
            "inputs_issued": int,
            "rerun_principal": str,
        },
        pk="task_id",
        not_null=[
            "principal",
            "tool",
            "status",
            "created_at_ms",
            "updated_at_ms",
            "owner",
            "on_restart",
            "request",
            "input_requests",
            "inputs_issued",
        ],
    )
    tasks.create_index(["status"], index_name="idx_tasks_status")
    tasks.create_index(["expires_at_ms"], index_name="idx_tasks_expires_at_ms")
    tasks.create_index(["status", "updated_at_ms"], index_name="idx_tasks_status_updated_at_ms")


@MIGRATIONS(name="0002_create_health")
def _create_health(db: Database) -> None:
    """One row the readiness probe rewrites: proof that the file still takes a committed write."""
    db.table("health").create({"id": int, "checked_at_ms": int}, pk="id")


@MIGRATIONS(name="0003_add_client_capabilities")
def _add_client_capabilities(db: Database) -> None:
    """The creating request's ClientCapabilities: which upstream questions may become `inputRequests`,
    also for a task re-run after a restart."""
    db.table("tasks").add_column("client_capabilities", str, not_null_default="{}")


@MIGRATIONS(name="0004_create_messages_and_tool_durations")
def _create_messages_and_tool_durations(db: Database) -> None:
    """Messages for a task's owner (the same API as on PostgreSQL, where the owner may be another replica), and
    the per-tool duration estimates behind `pollIntervalMs`, kept across restarts."""
    db.execute(
        "CREATE TABLE messages (message_id INTEGER PRIMARY KEY AUTOINCREMENT, recipient TEXT NOT NULL,"
        " kind TEXT NOT NULL, key TEXT NOT NULL, payload TEXT NOT NULL, created_at_ms INTEGER NOT NULL)"
    )
    db.execute("CREATE INDEX idx_messages_recipient ON messages (recipient, message_id)")
    db.execute("CREATE INDEX idx_messages_created_at_ms ON messages (created_at_ms)")
    db.table("tool_durations").create(
        {"tool": str, "estimate_ms": float, "samples": int, "updated_at_ms": int},
        pk="tool",
        not_null=["estimate_ms", "samples", "updated_at_ms"],
    )


@MIGRATIONS(name="0005_add_upstream_task")
def _add_upstream_task(db: Database) -> None:
    """A task the upstream runs itself: its id there, the upstream session it lives in, and the upstream ids of
    its outstanding questions (by key), so that a restarted proxy follows it again and can deliver answers."""
    tasks = db.table("tasks")
    tasks.add_column("upstream_task_id", str)
    tasks.add_column("upstream_session_id", str)
    tasks.add_column("upstream_input_ids", str, not_null_default="{}")


@MIGRATIONS(name="0006_add_traceparent")
def _add_traceparent(db: Database) -> None:
    """The W3C traceparent of the span that created the task (tracing on): later tasks/* spans link to it on any
    replica and after a restart, and a task resumed after a restart goes on in its trace. Older records: NULL."""
    db.table("tasks").add_column("traceparent", str)


@MIGRATIONS(name="0007_add_jobs")
def _add_jobs(db: Database) -> None:
    """A legacy job's id (`jobs:` config): a restarted proxy polls the same job again, never starting it twice.
    Older records and other tasks: NULL."""
    db.table("tasks").add_column("job_id", str)


@MIGRATIONS(name="0008_create_tombstones")
def _create_tombstones(db: Database) -> None:
    """What is left of a deleted record for a while (`tasks.tombstone_seconds`): why it went and when, answered
    only to the principal whose task it was."""
    db.execute(
        "CREATE TABLE tombstones (task_id TEXT PRIMARY KEY, principal TEXT NOT NULL, reason TEXT NOT NULL,"
        " expired_at_ms INTEGER, gone_at_ms INTEGER NOT NULL)"
    )
    db.execute("CREATE INDEX idx_tombstones_gone_at_ms ON tombstones (gone_at_ms)")


@MIGRATIONS(name="0009_add_admission_queue")
def _add_admission_queue(db: Database) -> None:
    """When the task's call began to wait for an upstream slot (`upstream.max_concurrent_calls`), while it waits:
    such a task never reached the upstream and runs at the next start, in this order. Older records: NULL."""
    db.table("tasks").add_column("queued_at_ms", int)


@MIGRATIONS(name="0010_create_idempotency_keys")
def _create_idempotency_keys(db: Database) -> None:
    """Idempotency-Key records: one per caller (scope) and key, claimed atomically by the primary key."""
    db.execute(
        "CREATE TABLE idempotency_keys (scope TEXT NOT NULL, key TEXT NOT NULL, fingerprint TEXT NOT NULL,"
        " owner TEXT NOT NULL, created_at_ms INTEGER NOT NULL, expires_at_ms INTEGER NOT NULL, outcome TEXT,"
        " PRIMARY KEY (scope, key))"
    )
    db.execute("CREATE INDEX idx_idempotency_keys_expires_at_ms ON idempotency_keys (expires_at_ms)")


@MIGRATIONS(name="0011_count_tasks_by_status")
def _count_tasks_by_status(db: Database) -> None:
    """The records by status, kept by triggers in the transaction of every change, so a scrape reads five rows
    instead of counting the table."""
    db.execute("CREATE TABLE task_status_counts (status TEXT PRIMARY KEY, n INTEGER NOT NULL)")
    db.execute(
        "INSERT INTO task_status_counts (status, n) SELECT value, 0 FROM json_each(?)",
        [json.dumps([status.value for status in TaskStatus])],
    )
    db.execute(
        "UPDATE task_status_counts SET n = (SELECT COUNT(*) FROM tasks WHERE tasks.status = task_status_counts.status)"
    )
    db.execute(
        "CREATE TRIGGER tasks_status_added AFTER INSERT ON tasks BEGIN"
        " UPDATE task_status_counts SET n = n + 1 WHERE status = NEW.status; END"
    )
    db.execute(
        "CREATE TRIGGER tasks_status_removed AFTER DELETE ON tasks BEGIN"
        " UPDATE task_status_counts SET n = n - 1 WHERE status = OLD.status; END"
    )
    db.execute(
        "CREATE TRIGGER tasks_status_changed AFTER UPDATE OF status ON tasks WHEN OLD.status <> NEW.status BEGIN"
        " UPDATE task_status_counts SET n = n - 1 WHERE status = OLD.status;"
        " UPDATE task_status_counts SET n = n + 1 WHERE status = NEW.status; END"
    )


@MIGRATIONS(name="0012_create_grants")
def _create_grants(db: Database) -> None:
    """Kept grants of `upstream.credentials: exchange` (`grants.py`): sealed tokens per caller and target."""
    db.execute(grants.CREATE_SQL)


INSERT_SQL: Final = f"INSERT INTO tasks ({', '.join(COLUMNS)}) VALUES ({', '.join(':' + column for column in COLUMNS)})"
# One indexed walk per settled status, then the oldest of those few candidates: a single
# `status IN (...) ORDER BY updated_at_ms` would sort every settled record on each create at capacity.
_OLDEST_SETTLED_SQL: Final = " UNION ALL ".join(
    f"SELECT * FROM (SELECT task_id, updated_at_ms, created_at_ms FROM tasks WHERE status = '{status.value}'"
    " ORDER BY updated_at_ms, created_at_ms LIMIT :count)"
    for status in sorted(TERMINAL)
)
EVICT_SQL: Final = (
    "DELETE FROM tasks WHERE task_id IN (SELECT task_id FROM"
    f" ({_OLDEST_SETTLED_SQL}) ORDER BY updated_at_ms, created_at_ms LIMIT :count)"
)
# `+status` keeps the planner on the expires_at_ms index (few rows are past expiry; many share a status).
EXPIRED_LIVE_SQL: Final = (
    f"SELECT * FROM tasks WHERE expires_at_ms <= ? AND +status IN ({LIVE_SQL}) ORDER BY expires_at_ms, task_id"
)


STATUS_COUNTS_SQL: Final = "SELECT status, n FROM task_status_counts"


PURGE_WHERE: Final = f"FROM tasks WHERE expires_at_ms <= ? AND +status IN ({TERMINAL_SQL})"
# One batch of the purge: the records it selects are the same for the tombstones' INSERT and the DELETE of one
# transaction (the oldest first, by the expiry index).
PURGE_BATCH_WHERE: Final = (
    f"FROM tasks WHERE rowid IN (SELECT rowid FROM tasks WHERE expires_at_ms <= ? AND +status IN ({TERMINAL_SQL})"
    " ORDER BY expires_at_ms LIMIT ?)"
)
BURY_SQL: Final = (
    "INSERT OR REPLACE INTO tombstones (task_id, principal, reason, expired_at_ms, gone_at_ms)"
    " SELECT task_id, principal, ?, expires_at_ms, ? "
)
TOMBSTONE_SQL: Final = (
    "SELECT task_id, reason, gone_at_ms, expired_at_ms FROM tombstones WHERE task_id = ? AND principal = ?"
)
# The trim, in batches: those gone before the cut-off, then the oldest beyond the count kept (by the index on
# gone_at_ms, never a sort of them all).
TRIM_OLD_TOMBSTONES_SQL: Final = (
    "DELETE FROM tombstones WHERE rowid IN (SELECT rowid FROM tombstones WHERE gone_at_ms < ? LIMIT ?)"
)
TRIM_OLDEST_TOMBSTONES_SQL: Final = (
    "DELETE FROM tombstones WHERE rowid IN (SELECT rowid FROM tombstones ORDER BY gone_at_ms LIMIT ?)"
)
COUNT_TOMBSTONES_SQL: Final = "SELECT COUNT(*) FROM tombstones"
HEALTH_SQL: Final = "INSERT OR REPLACE INTO health (id, checked_at_ms) VALUES (1, ?)"
NOTIFY_OWNER_SQL: Final = (
    "INSERT INTO messages (recipient, kind, key, payload, created_at_ms)"
    f" SELECT owner, :kind, task_id, :payload, :now_ms FROM tasks WHERE task_id = :key AND status IN ({LIVE_SQL})"
    " RETURNING message_id, recipient, kind, key, payload"
)
NOTIFY_REPLICA_SQL: Final = (
    "INSERT INTO messages (recipient, kind, key, payload, created_at_ms) VALUES (:recipient, :kind, :key, :payload,"
    " :now_ms) RETURNING message_id, recipient, kind, key, payload"
)
TAKE_MESSAGES_SQL: Final = (
    "DELETE FROM messages WHERE recipient = ? RETURNING message_id, recipient, kind, key, payload"
)
PURGE_MESSAGES_SQL: Final = "DELETE FROM messages WHERE created_at_ms <= ?"
OBSERVE_SQL: Final = (
    "INSERT INTO tool_durations (tool, estimate_ms, samples, updated_at_ms) VALUES (:tool, :ms, 1, :now_ms)"
    " ON CONFLICT (tool) DO UPDATE SET estimate_ms = estimate_ms + :smoothing * (excluded.estimate_ms - estimate_ms),"
    " samples = samples + 1, updated_at_ms = excluded.updated_at_ms RETURNING estimate_ms"
)
TRIM_DURATIONS_SQL: Final = (
    "DELETE FROM tool_durations WHERE tool IN"
    " (SELECT tool FROM tool_durations ORDER BY updated_at_ms DESC, tool LIMIT -1 OFFSET ?)"
)
