"""Idempotency-key records: the value type and the SQL both backends run on their `idempotency_keys` table,
whose primary key makes the first claim atomic. Must not import a database driver, aiohttp or tasks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

# A record is claimed `running` (no outcome) by the process that runs the first request, then settled with the outcome
# that request got, or released (deleted) when the request was refused before the upstream saw it. The settlement and
# the release name the claim (its owner and its `created_at_ms`), so a late one never touches a later claim of the
# same key. A claim is committed only while its request still waits for it (the backends say how), so a claim the
# store holds is one a request took up, or one its process owes a release or an outcome.

KEY_COLUMNS: Final = ("scope", "key", "fingerprint", "owner", "created_at_ms", "expires_at_ms", "outcome")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """One key of one caller: `scope` is the caller's principal hash (the one tasks are bound to), `owner` the
    process (replica) that runs the first request, `outcome` the JSON text of its answer, None while it runs."""

    scope: str
    key: str
    fingerprint: str
    owner: str
    created_at_ms: int
    expires_at_ms: int
    outcome: str | None = None


def key_from_row(row: Mapping[str, Any]) -> KeyRecord:
    return KeyRecord(
        scope=row["scope"],
        key=row["key"],
        fingerprint=row["fingerprint"],
        owner=row["owner"],
        created_at_ms=int(row["created_at_ms"]),
        expires_at_ms=int(row["expires_at_ms"]),
        outcome=row["outcome"],
    )


def key_params(record: KeyRecord) -> dict[str, Any]:
    return {column: getattr(record, column) for column in KEY_COLUMNS}


# Named parameters in the `:name` style; `pg()` rewrites them for psycopg (`%(name)s`).
# A record past its retention that the sweep has not removed yet is taken over by the claim, atomically.
CLAIM_SQL: Final = (
    "INSERT INTO idempotency_keys (scope, key, fingerprint, owner, created_at_ms, expires_at_ms, outcome)"
    " VALUES (:scope, :key, :fingerprint, :owner, :created_at_ms, :expires_at_ms, NULL)"
    " ON CONFLICT (scope, key) DO UPDATE SET fingerprint = excluded.fingerprint, owner = excluded.owner,"
    " created_at_ms = excluded.created_at_ms, expires_at_ms = excluded.expires_at_ms, outcome = NULL"
    " WHERE idempotency_keys.expires_at_ms <= excluded.created_at_ms RETURNING scope"
)
GET_SQL: Final = "SELECT * FROM idempotency_keys WHERE scope = :scope AND key = :key"
_THE_CLAIM: Final = "scope = :scope AND key = :key AND owner = :owner AND created_at_ms = :created_at_ms"
SETTLE_SQL: Final = f"UPDATE idempotency_keys SET outcome = :outcome WHERE {_THE_CLAIM} AND outcome IS NULL"
RELEASE_SQL: Final = f"DELETE FROM idempotency_keys WHERE {_THE_CLAIM} AND outcome IS NULL"
PURGE_SQL: Final = "DELETE FROM idempotency_keys WHERE expires_at_ms <= :now_ms"


def pg(sql: str) -> str:
    """`:name` parameters as psycopg's `%(name)s`."""
    for column in (*KEY_COLUMNS, "now_ms"):
        sql = sql.replace(f":{column}", f"%({column})s")
    return sql
