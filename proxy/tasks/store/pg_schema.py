"""The PostgreSQL store's schema: versioned migrations (applied once, under an advisory lock) and the SQL the
store runs; every statement that adds or removes task rows locks the count row first. Depends on `rows`."""

from __future__ import annotations

from typing import Final

from psycopg import AsyncConnection
from psycopg.rows import DictRow

from proxy.tasks.store import grants
from proxy.tasks.store.rows import COLUMNS, LIVE_SQL, TERMINAL_SQL

# Migrations are ordered, named steps recorded in `schema_migrations`; they are applied in one transaction under an
# advisory lock, so replicas that start at once migrate once. Every statement that adds or removes task rows locks the
# one `task_count` row first (a trigger keeps its count exact): creations across replicas are serialized there, so
# eviction at capacity neither over-evicts nor lets the count run past `max_records`, and all writers take their locks
# in one order (the count, then task rows). Depends on `rows` and psycopg.

# Advisory locks live in one space per database: ours are keyed by the schema, so that two deployments in two
# schemas of one database do not share them. The second key says what is locked.
LOCK_SPACE: Final = "hashtext(current_schema() || ':mcp-tasks-proxy')"
REPLICA_LOCK_SPACE: Final = "hashtext(current_schema() || ':mcp-tasks-proxy:replica')"
MIGRATE_LOCK: Final = 1
PURGE_LOCK: Final = 2
STATUS_COUNT_SHARDS: Final = 8  # counter rows per status (`task_status_counts`): connections spread over them

MIGRATIONS: Final[tuple[tuple[str, str], ...]] = (
    (
        "0001_create_tasks",
        f"""
        CREATE TABLE tasks (
            task_id text PRIMARY KEY,
            principal text NOT NULL,
            tool text NOT NULL,
            status text NOT NULL CHECK (status IN ({LIVE_SQL}, {TERMINAL_SQL})),
            status_message text,
            created_at_ms bigint NOT NULL,
            updated_at_ms bigint NOT NULL,
            ttl_ms bigint,
            expires_at_ms bigint,
            poll_interval_ms bigint,
            owner text NOT NULL,
            on_restart text NOT NULL,
            request text NOT NULL,
            result text,
            error text,
            input_requests text NOT NULL,
            inputs_issued integer NOT NULL,
            rerun_principal text,
            client_capabilities text NOT NULL DEFAULT '{{}}'
        );
        CREATE INDEX tasks_settled_age ON tasks (updated_at_ms, created_at_ms) WHERE status IN ({TERMINAL_SQL});
        CREATE INDEX tasks_settled_expiry ON tasks (expires_at_ms) WHERE status IN ({TERMINAL_SQL});
        CREATE INDEX tasks_live_expiry ON tasks (expires_at_ms) WHERE status IN ({LIVE_SQL});
        CREATE INDEX tasks_live_owner ON tasks (owner) WHERE status IN ({LIVE_SQL});

        CREATE TABLE task_count (id integer PRIMARY KEY CHECK (id = 1), records bigint NOT NULL);
        INSERT INTO task_count VALUES (1, 0);
        CREATE FUNCTION task_count_added() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE task_count SET records = records + (SELECT count(*) FROM added) WHERE id = 1;
            RETURN NULL;
        END $$;
        CREATE FUNCTION task_count_removed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE task_count SET records = records - (SELECT count(*) FROM removed) WHERE id = 1;
            RETURN NULL;
        END $$;
        CREATE FUNCTION task_count_emptied() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            UPDATE task_count SET records = 0 WHERE id = 1;
            RETURN NULL;
        END $$;
        CREATE TRIGGER tasks_added AFTER INSERT ON tasks REFERENCING NEW TABLE AS added
            FOR EACH STATEMENT EXECUTE FUNCTION task_count_added();
        CREATE TRIGGER tasks_removed AFTER DELETE ON tasks REFERENCING OLD TABLE AS removed
            FOR EACH STATEMENT EXECUTE FUNCTION task_count_removed();
        CREATE TRIGGER tasks_emptied AFTER TRUNCATE ON tasks FOR EACH STATEMENT EXECUTE FUNCTION task_count_emptied();

        CREATE TABLE health (id integer PRIMARY KEY, checked_at_ms bigint NOT NULL);
        """,
    ),
    (
        "0002_create_replicas_and_messages",
        """
        CREATE SEQUENCE replica_epochs;
        CREATE TABLE replicas (
            replica_id text PRIMARY KEY,
            epoch bigint NOT NULL,
            expires_at timestamptz NOT NULL,
            renewed_at timestamptz NOT NULL
        );
        CREATE TABLE messages (
            message_id bigserial PRIMARY KEY,
            recipient text NOT NULL,
            kind text NOT NULL,
            key text NOT NULL,
            payload text NOT NULL,
            created_at timestamptz NOT NULL DEFAULT clock_timestamp()
        );
        CREATE INDEX messages_recipient ON messages (recipient, message_id);
        CREATE INDEX messages_created_at ON messages (created_at);
        """,
    ),
    (
        "0003_create_tool_durations",
        """
        CREATE TABLE tool_durations (
            tool text PRIMARY KEY,
            estimate_ms double precision NOT NULL,
            samples bigint NOT NULL,
            updated_at timestamptz NOT NULL
        );
        """,
    ),
    (
        # A task the upstream runs itself: its id there, the upstream session it lives in, and the upstream ids of
        # its outstanding questions (by key), so that a restarted proxy follows it again and can deliver answers.
        "0004_add_upstream_task",
        """
        ALTER TABLE tasks ADD COLUMN upstream_task_id text;
        ALTER TABLE tasks ADD COLUMN upstream_session_id text;
        ALTER TABLE tasks ADD COLUMN upstream_input_ids text NOT NULL DEFAULT '{}';
        """,
    ),
    (
        # The W3C traceparent of the span that created the task (tracing on): later tasks/* spans link to it on
        # any replica and after a restart, and a task resumed elsewhere goes on in its trace. Older records: NULL.
        "0005_add_traceparent",
        """
        ALTER TABLE tasks ADD COLUMN traceparent text;
        """,
    ),
    (
        # A legacy job's id (`jobs:` config): a restarted proxy, or a replica taking the task over, polls the same
        # job again, never starting it twice. Older records and other tasks: NULL.
        "0006_add_jobs",
        """
        ALTER TABLE tasks ADD COLUMN job_id text;
        """,
    ),
    (
        # What is left of a deleted record for a while (`tasks.tombstone_seconds`): why it went and when,
        # answered only to the principal whose task it was.
        "0007_create_tombstones",
        """
        CREATE TABLE tombstones (
            task_id text PRIMARY KEY,
            principal text NOT NULL,
            reason text NOT NULL,
            expired_at_ms bigint,
            gone_at_ms bigint NOT NULL
        );
        CREATE INDEX tombstones_gone_at ON tombstones (gone_at_ms);
        """,
    ),
    (
        # When the task's call began to wait for an upstream slot (`upstream.max_concurrent_calls`), while it
        # waits: such a task never reached the upstream and runs at the next start, in this order.
        "0008_add_admission_queue",
        """
        ALTER TABLE tasks ADD COLUMN queued_at_ms bigint;
        """,
    ),
    (
        # `limits.calls_per_minute_per_principal`: calls per caller (key) and window, shared by every replica.
        "0009_create_quota_windows",
        """
        CREATE TABLE quota_windows (
            key text NOT NULL,
            window_start_ms bigint NOT NULL,
            calls bigint NOT NULL,
            PRIMARY KEY (key, window_start_ms)
        );
        """,
    ),
    (
        # Idempotency-Key records: one per caller (scope) and key, claimed atomically by the primary key.
        "0010_create_idempotency_keys",
        """
        CREATE TABLE idempotency_keys (
            scope text NOT NULL,
            key text NOT NULL,
            fingerprint text NOT NULL,
            owner text NOT NULL,
            created_at_ms bigint NOT NULL,
            expires_at_ms bigint NOT NULL,
            outcome text,
            PRIMARY KEY (scope, key)
        );
        CREATE INDEX idempotency_keys_expiry ON idempotency_keys (expires_at_ms);
        """,
    ),
    (
        # The replicas' renewals as the database's clock saw them: the latest one, and when renewals began again
        # after a gap (the database was away for every replica: stopped, frozen, cut off from all of them). A
        # lease that lapsed before then is no evidence that its holder died (`lease_gone`).
        "0011_create_lease_watch",
        """
        CREATE TABLE lease_watch (
            id integer PRIMARY KEY CHECK (id = 1),
            renewed_at timestamptz NOT NULL,
            returned_at timestamptz NOT NULL
        );
        INSERT INTO lease_watch VALUES (1, clock_timestamp(), '-infinity');
        """,
    ),
    (
        # The records by status, kept by the statements that change them (in their transaction), so a scrape reads
        # a few rows instead of counting the table, and every replica reads the same. Each connection adds to a
        # row of its own (by backend pid), so replicas settling at once never wait for one counter row.
        "0012_count_tasks_by_status",
        f"""
        CREATE TABLE task_status_counts (
            status text NOT NULL,
            shard integer NOT NULL,
            n bigint NOT NULL,
            PRIMARY KEY (status, shard)
        );
        CREATE FUNCTION task_status_counted() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO task_status_counts (status, shard, n)
            SELECT status, pg_backend_pid() % {STATUS_COUNT_SHARDS}, sum(change) FROM (
                SELECT status, 1 AS change FROM added
                UNION ALL SELECT status, -1 FROM removed
            ) AS changes GROUP BY status HAVING sum(change) <> 0
            ON CONFLICT (status, shard) DO UPDATE SET n = task_status_counts.n + excluded.n;
            RETURN NULL;
        END $$;
        CREATE FUNCTION task_status_added() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO task_status_counts (status, shard, n)
            SELECT status, pg_backend_pid() % {STATUS_COUNT_SHARDS}, count(*) FROM added GROUP BY status
            ON CONFLICT (status, shard) DO UPDATE SET n = task_status_counts.n + excluded.n;
            RETURN NULL;
        END $$;
        CREATE FUNCTION task_status_removed() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            INSERT INTO task_status_counts (status, shard, n)
            SELECT status, pg_backend_pid() % {STATUS_COUNT_SHARDS}, -count(*) FROM removed GROUP BY status
            ON CONFLICT (status, shard) DO UPDATE SET n = task_status_counts.n + excluded.n;
            RETURN NULL;
        END $$;
        CREATE FUNCTION task_status_emptied() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            DELETE FROM task_status_counts;
            RETURN NULL;
        END $$;
        CREATE TRIGGER tasks_status_added AFTER INSERT ON tasks REFERENCING NEW TABLE AS added
            FOR EACH STATEMENT EXECUTE FUNCTION task_status_added();
        CREATE TRIGGER tasks_status_removed AFTER DELETE ON tasks REFERENCING OLD TABLE AS removed
            FOR EACH STATEMENT EXECUTE FUNCTION task_status_removed();
        CREATE TRIGGER tasks_status_changed AFTER UPDATE ON tasks REFERENCING OLD TABLE AS removed NEW TABLE AS added
            FOR EACH STATEMENT EXECUTE FUNCTION task_status_counted();
        CREATE TRIGGER tasks_status_emptied AFTER TRUNCATE ON tasks
            FOR EACH STATEMENT EXECUTE FUNCTION task_status_emptied();
        -- Filled once the triggers hold their lock on tasks: no writer can slip between the count and them.
        INSERT INTO task_status_counts (status, shard, n) SELECT status, 0, count(*) FROM tasks GROUP BY status;
        """,
    ),
    (
        # Kept grants of `upstream.credentials: exchange` (`grants.py`): sealed tokens per caller and target.
        "0013_create_grants",
        grants.CREATE_SQL + ";",
    ),
)
STATUS_COUNTS_SQL: Final = "SELECT status, sum(n) AS n FROM task_status_counts GROUP BY status"


async def migrate(conn: AsyncConnection[DictRow]) -> list[str]:
    """Apply the missing steps in order, in one transaction, once across replicas; the names applied now.

    Steps applied by a newer version of the proxy are left alone (a rolling update runs both versions).
    """
    async with conn.transaction():
        await conn.execute(f"SELECT pg_advisory_xact_lock({LOCK_SPACE}, {MIGRATE_LOCK})")
        await conn.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations"
            " (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )
        cursor = await conn.execute("SELECT name FROM schema_migrations")
        applied = {str(row["name"]) for row in await cursor.fetchall()}
        done = []
        for name, statements in MIGRATIONS:
            if name in applied:
                continue
            await conn.execute(statements.encode())  # several statements: the simple query protocol
            await conn.execute("INSERT INTO schema_migrations (name) VALUES (%s)", [name])
            done.append(name)
    return done


_TYPES: Final = {
    "created_at_ms": "bigint",
    "updated_at_ms": "bigint",
    "ttl_ms": "bigint",
    "expires_at_ms": "bigint",
    "poll_interval_ms": "bigint",
    "inputs_issued": "integer",
    "queued_at_ms": "bigint",
}
# Every record of a batch in one statement (one trigger run), as one array per column.
INSERT_SQL: Final = (
    f"INSERT INTO tasks ({', '.join(COLUMNS)}) SELECT * FROM unnest("
    + ", ".join(f"%({column})s::{_TYPES.get(column, 'text')}[]" for column in COLUMNS)
    + ")"
)
COUNT_CALL_SQL: Final = (
    "INSERT INTO quota_windows (key, window_start_ms, calls) VALUES (%(key)s, %(window_start_ms)s, 1)"
    " ON CONFLICT (key, window_start_ms) DO UPDATE SET calls = quota_windows.calls + 1 RETURNING calls"
)
PURGE_QUOTA_SQL: Final = "DELETE FROM quota_windows WHERE window_start_ms < %s"
LOCK_COUNT_SQL: Final = "SELECT records FROM task_count WHERE id = 1 FOR UPDATE"
EXISTING_SQL: Final = "SELECT task_id FROM tasks WHERE task_id = ANY(%s)"
# How many settled records could be evicted, counted only as far as a batch could need.
EVICTABLE_SQL: Final = (
    f"SELECT count(*) FROM (SELECT 1 FROM tasks WHERE status IN ({TERMINAL_SQL}) LIMIT"
    " (SELECT %(batch)s + GREATEST(0, records - %(max_records)s) FROM task_count WHERE id = 1)) AS settled"
)
EVICT_SQL: Final = (
    "DELETE FROM tasks WHERE task_id IN (SELECT task_id FROM tasks"
    f" WHERE status IN ({TERMINAL_SQL}) ORDER BY updated_at_ms, created_at_ms LIMIT %s)"
)


def notify_sql(kind: str, key: str, recipient: str, status: str = "NULL") -> str:
    """A `pg_notify` of one change, for a SELECT over the rows a write returned (same transaction)."""
    body = f"json_build_object('k', {kind}, 't', {key}, 'r', {recipient}, 's', {status})::text"
    return f"pg_notify(%(channel)s, {body})"


NOTIFY_STATUS: Final = notify_sql("'status'", "changed.task_id", "changed.owner", "changed.status")
NOTIFY_MESSAGE: Final = notify_sql("posted.kind", "posted.key", "posted.recipient")
FENCE_SQL: Final = (
    " AND owner = %(fence_owner)s AND EXISTS (SELECT 1 FROM replicas WHERE replica_id = %(fence_owner)s"
    " AND epoch = %(fence_epoch)s AND expires_at > clock_timestamp())"
)
SETTLE_EXPIRED_SQL: Final = (
    "WITH due AS (SELECT task_id FROM tasks WHERE expires_at_ms <= %(now_ms)s"
    f" AND status IN ({LIVE_SQL}) ORDER BY expires_at_ms LIMIT 1000 FOR UPDATE SKIP LOCKED),"
    " changed AS (UPDATE tasks SET status = 'failed', error = %(error)s, status_message = %(status_message)s,"
    " input_requests = '{}', rerun_principal = NULL, upstream_input_ids = '{}', updated_at_ms = %(now_ms)s FROM due"
    f" WHERE tasks.task_id = due.task_id AND tasks.status IN ({LIVE_SQL}) RETURNING tasks.*)"
    f" SELECT changed.*, {NOTIFY_STATUS} FROM changed"
)
# What the deletes of records select, with named parameters (`bury_sql` makes each its DELETE).
EXPIRED_WHERE: Final = f"FROM tasks WHERE expires_at_ms <= %(now_ms)s AND status IN ({TERMINAL_SQL}) LIMIT %(chunk)s"
SETTLED_BEFORE_WHERE: Final = (
    f"FROM tasks WHERE status IN ({TERMINAL_SQL}) AND updated_at_ms < %(before_ms)s LIMIT %(chunk)s"
)
ONE_WHERE: Final = "FROM tasks WHERE task_id = %(task_id)s"
COUNT_SETTLED_BEFORE_SQL: Final = (
    f"SELECT count(*) AS n FROM tasks WHERE status IN ({TERMINAL_SQL}) AND updated_at_ms < %(before_ms)s"
)
# The DELETE wrapped so that each deleted record leaves a tombstone, in the same statement.
_BURY_SQL: Final = (
    "WITH gone AS (DELETE FROM tasks WHERE task_id IN (SELECT task_id {where}) RETURNING task_id, principal,"
    " expires_at_ms) INSERT INTO tombstones (task_id, principal, reason, expired_at_ms, gone_at_ms)"
    " SELECT task_id, principal, %(reason)s, expires_at_ms, %(now_ms)s FROM gone ON CONFLICT (task_id) DO UPDATE"
    " SET principal = excluded.principal, reason = excluded.reason, expired_at_ms = excluded.expired_at_ms,"
    " gone_at_ms = excluded.gone_at_ms"
)
TOMBSTONE_SQL: Final = (
    "SELECT task_id, reason, gone_at_ms, expired_at_ms FROM tombstones WHERE task_id = %s AND principal = %s"
)
# The trim, in batches: those gone before the cut-off, then the oldest beyond the count kept (by the index on
# gone_at_ms; rows another replica's trim holds are skipped, never waited for).
TRIM_OLD_TOMBSTONES_SQL: Final = (
    "DELETE FROM tombstones WHERE task_id IN (SELECT task_id FROM tombstones WHERE gone_at_ms < %s LIMIT %s"
    " FOR UPDATE SKIP LOCKED)"
)
TRIM_OLDEST_TOMBSTONES_SQL: Final = (
    "DELETE FROM tombstones WHERE task_id IN (SELECT task_id FROM tombstones ORDER BY gone_at_ms LIMIT %s"
    " FOR UPDATE SKIP LOCKED)"
)
COUNT_TOMBSTONES_SQL: Final = "SELECT count(*) AS n FROM tombstones"


def bury_sql(where: str, tombstones: bool) -> str:
    """The DELETE of the records `where` selects; with `tombstones`, each leaves one (parameters `reason` and
    `now_ms`)."""
    if tombstones:
        return _BURY_SQL.format(where=where)
    return f"DELETE FROM tasks WHERE task_id IN (SELECT task_id {where})"


PURGE_MESSAGES_SQL: Final = "DELETE FROM messages WHERE created_at <= clock_timestamp() - make_interval(secs => %s)"
TRIM_DURATIONS_SQL: Final = (
    "DELETE FROM tool_durations WHERE tool IN"
    " (SELECT tool FROM tool_durations ORDER BY updated_at DESC, tool OFFSET %s)"
)
# Each renewal also notes itself in `lease_watch`: one that comes more than `gap` seconds after the latest one of
# any replica marks the store's return (nobody could renew in between).
RENEW_SQL: Final = (
    "WITH watch AS (UPDATE lease_watch SET returned_at = CASE WHEN clock_timestamp() - renewed_at"
    " > make_interval(secs => %(gap)s) THEN clock_timestamp() ELSE returned_at END,"
    " renewed_at = GREATEST(renewed_at, clock_timestamp()) WHERE id = 1)"
    " INSERT INTO replicas (replica_id, epoch, expires_at, renewed_at) VALUES (%(replica)s, nextval('replica_epochs'),"
    " clock_timestamp() + make_interval(secs => %(seconds)s), clock_timestamp())"
    " ON CONFLICT (replica_id) DO UPDATE SET"
    " epoch = CASE WHEN replicas.expires_at > clock_timestamp() THEN replicas.epoch ELSE EXCLUDED.epoch END,"
    " expires_at = EXCLUDED.expires_at, renewed_at = EXCLUDED.renewed_at RETURNING epoch"
)
# A replica (its row `r` in `replicas`) is gone when its lease ran out and, since the store's latest return, it
# has had a lease period of its own (as it renewed it: `expires_at - renewed_at`) to renew: a lease that lapsed
# while nobody could reach the store is renewed by a live holder within that period after the return, whatever
# instant each replica reconnects at. By the database's clock alone, so no replica's clock matters.
LEASE_GONE: Final = (
    "(r.expires_at <= clock_timestamp() AND clock_timestamp()"
    " >= (SELECT returned_at FROM lease_watch WHERE id = 1) + (r.expires_at - r.renewed_at))"
)
EXPIRED_REPLICAS_SQL: Final = (
    f"SELECT replica_id FROM replicas r WHERE {LEASE_GONE}"
    f" UNION SELECT DISTINCT owner FROM tasks WHERE status IN ({LIVE_SQL})"
    " AND NOT EXISTS (SELECT 1 FROM replicas WHERE replica_id = tasks.owner) ORDER BY 1"
)
REPLICA_ALIVE_SQL: Final = f"SELECT 1 FROM replicas r WHERE replica_id = %s AND NOT {LEASE_GONE}"
REPLICA_SPARED_SQL: Final = f"SELECT NOT {LEASE_GONE} AS spared FROM replicas r WHERE replica_id = %s FOR UPDATE"
# A clean stop: the lease ends now, and its period with it (a survivor takes over at once, even just after a return).
RELEASE_SQL: Final = (
    "UPDATE replicas SET expires_at = clock_timestamp(), renewed_at = clock_timestamp()"
    " WHERE replica_id = %s AND epoch = %s"
)
LEASE_HELD_SQL: Final = "SELECT 1 FROM replicas WHERE replica_id = %s AND epoch = %s AND expires_at > clock_timestamp()"
TAKE_OVER_SQL: Final = (
    f"WITH changed AS (UPDATE tasks SET owner = %(owner)s WHERE owner = %(dead)s AND status IN ({LIVE_SQL})"
    f" RETURNING *) SELECT changed.*, {NOTIFY_STATUS} FROM changed"
)
NOTIFY_OWNER_SQL: Final = (
    "WITH posted AS (INSERT INTO messages (recipient, kind, key, payload) SELECT owner, %(kind)s, task_id,"
    f" %(payload)s FROM tasks WHERE task_id = %(key)s AND status IN ({LIVE_SQL}) RETURNING *)"
    f" SELECT message_id, recipient, kind, key, payload, {NOTIFY_MESSAGE} FROM posted"
)
NOTIFY_REPLICA_SQL: Final = (
    "WITH posted AS (INSERT INTO messages (recipient, kind, key, payload) VALUES (%(recipient)s, %(kind)s, %(key)s,"
    f" %(payload)s) RETURNING *) SELECT message_id, recipient, kind, key, payload, {NOTIFY_MESSAGE} FROM posted"
)
OBSERVE_SQL: Final = (
    "INSERT INTO tool_durations (tool, estimate_ms, samples, updated_at) VALUES (%(tool)s, %(ms)s, 1,"
    " clock_timestamp()) ON CONFLICT (tool) DO UPDATE SET estimate_ms = tool_durations.estimate_ms"
    " + %(smoothing)s * (EXCLUDED.estimate_ms - tool_durations.estimate_ms), samples = tool_durations.samples + 1,"
    " updated_at = EXCLUDED.updated_at RETURNING estimate_ms"
)
HEALTH_SQL: Final = (
    "INSERT INTO health (id, checked_at_ms) VALUES (1, %s) ON CONFLICT (id) DO UPDATE SET checked_at_ms ="
    " EXCLUDED.checked_at_ms"
)
