"""`upstream.credentials: exchange` under faults: a job family whose caller's token expires long before the job
ends is polled to its end with tokens the kept refresh token renews, after its replica was killed (a second
PostgreSQL replica takes it over) and after a proxy restart (SQLite). The proxies run as processes (`python -m
proxy serve`) behind the real token token_endpoint of tests/support/token_server.py; what they wrote (logs, audit
lines, the store's bytes) is searched for every credential they handled, which must not be there in clear.

The issue's figure is a 90 s family with 20 s tokens (the closing note shows that run); here 9 s with 2 s tokens,
so the suite stays short while every poll after the first few seconds needs a renewed token.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import aiohttp
import psycopg
import pytest

from tests import pg
from tests.support.clients import Client, Tasks
from tests.support.jobs import render_job
from tests.support.oauth import ISSUER, Issuer
from tests.support.processes import ProxyProcess, Upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.token_server import TokenServer
from tests.support.waiting import until

pytestmark = pytest.mark.faults

LEASE_SECONDS = 2.0
JOB_SECONDS = 9.0
TOKEN_SECONDS = 2.0
CALLER_TOKEN_SECONDS = 4.0


def proxy(
    tmp_path: Path, upstream: Upstream, token_endpoint: TokenServer, caller_issuer: Issuer, **sections: Any
) -> ProxyProcess:
    key = tmp_path / "deployment.key"
    if not key.exists():
        key.write_bytes(os.urandom(48).hex().encode())
    return ProxyProcess(
        tmp_path,
        upstream.url,
        upstream={"credentials": token_endpoint.exchange_config(renew_before_seconds=0.5)},
        security={"jwt": {"jwks_file": str(caller_issuer.jwks_path), "issuer": ISSUER}, "key_file": str(key)},
        audit={"path": str(tmp_path / f"audit-{os.urandom(4).hex()}.log")},
        tasks={"drain_seconds": 0},
        jobs=render_job(poll_interval_ms=500, shared=True),
        **sections,
    )


@asynccontextmanager
async def modern(process: ProxyProcess, schemas: tuple[ModernSchema, SchemaValidator]) -> AsyncIterator[Tasks]:
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{process.port}") as http:
        yield Tasks(cast(Client, http), *schemas)


def bearer(caller_issuer: Issuer, lifetime: float = 600) -> dict[str, str]:
    return {"Authorization": f"Bearer {caller_issuer.token('alice', lifetime=lifetime)}"}


async def run_to_the_end(client: Tasks, task_id: str, caller_issuer: Issuer) -> dict[str, Any]:
    """Poll as a real client does, with a fresh token of its own each time, until the task settles."""

    async def settled() -> dict[str, Any] | None:
        task = await client.task(task_id, headers=bearer(caller_issuer))
        return task if task["status"] in ("completed", "failed", "cancelled") else None

    done: dict[str, Any] = await until(settled, "the job task did not settle", JOB_SECONDS + 25)
    return done


async def presented(client: Tasks, caller_issuer: Issuer) -> set[str]:
    status, message = await client.call("seen_tokens", {}, capabilities={}, headers=bearer(caller_issuer))
    assert status == 200, message
    text = "".join(block.get("text", "") for block in message["result"]["content"])
    return set(json.loads(text))


def credentials_handled(token_endpoint: TokenServer, inbound: str) -> list[str]:
    """Every credential the proxies handled: the caller's token, the tokens issued, the refresh tokens, the
    proxy client's secret."""
    return [inbound, *token_endpoint.tokens_of("alice"), *token_endpoint.grants, token_endpoint.client_secret]


def assert_absent(credentials: list[str], where: str, text: str) -> None:
    for credential in credentials:
        assert credential not in text, f"a credential in clear in {where}"


def written_by(processes: list[ProxyProcess], tmp_path: Path) -> str:
    logs = "".join(process.log.read_text() for process in processes)
    audit = "".join(path.read_text() for path in tmp_path.glob("audit-*.log"))
    assert "credential_exchanged" in logs  # the logs are the proxies' own, at info level
    assert audit
    return logs + audit


def pg_text(dsn: str) -> str:
    """Every row of every table of the proxies' database, as text (what a stolen dump holds)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [row[0] for row in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")]
        return "\n".join(
            str(row[0]) for table in tables for row in conn.execute(f'SELECT row_to_json(t)::text FROM "{table}" t')
        )


def sqlite_bytes(database: Path) -> str:
    return "".join(
        path.read_bytes().decode("latin-1") for path in database.parent.glob(f"{database.name}*") if path.is_file()
    )


async def start_job(
    process: ProxyProcess, schemas: tuple[ModernSchema, SchemaValidator], caller_issuer: Issuer
) -> tuple[str, str]:
    """A job started by a caller whose own token lives CALLER_TOKEN_SECONDS, once it reports progress: its task
    id, and that token."""
    started = bearer(caller_issuer, lifetime=CALLER_TOKEN_SECONDS)
    async with modern(process, schemas) as client:
        task_id = await client.create("start_render", {"seconds": JOB_SECONDS}, headers=started)
        await client.until(
            task_id, lambda task: str(task.get("statusMessage", "")).endswith("%"), headers=bearer(caller_issuer)
        )
    return task_id, started["Authorization"].removeprefix("Bearer ")


async def test_a_taken_over_job_polls_on_with_tokens_renewed_from_the_kept_refresh_token(
    tmp_path: Path,
    pg_dsn: str,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    processes: list[ProxyProcess],
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    token_endpoint.lifetime_seconds = TOKEN_SECONDS
    store = {"url": pg.as_url(pg_dsn), "lease_seconds": LEASE_SECONDS}
    replicas = [proxy(tmp_path, protected_upstream, token_endpoint, caller_issuer, store=store) for _ in range(2)]
    processes.extend(replicas)
    for replica in replicas:
        await replica.start()
    doomed, survivor = replicas
    schemas = (modern_schema, tasks_schema)
    task_id, inbound = await start_job(doomed, schemas, caller_issuer)
    kept = await asyncio.to_thread(pg_text, pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM grants").fetchone() == (1,)  # kept for the task, sealed:
    assert_absent(credentials_handled(token_endpoint, inbound), "the database while the job runs", kept)
    await asyncio.to_thread(doomed.stop)  # SIGKILL: its lease runs out, the survivor takes the job over

    async with modern(survivor, schemas) as client:
        done = await run_to_the_end(client, task_id, caller_issuer)
        seen = await presented(client, caller_issuer)
    assert done["status"] == "completed", done
    assert token_endpoint.count("refresh") >= 2  # after the caller's token expired: renewed with the kept refresh token
    assert hashlib.sha256(inbound.encode()).hexdigest() not in seen

    def erased() -> bool:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM grants").fetchone() == (0,)

    await until(lambda: asyncio.to_thread(erased), "the grant outlived the last task of its caller", 15)
    handled = credentials_handled(token_endpoint, inbound)
    assert_absent(handled, "the database", await asyncio.to_thread(pg_text, pg_dsn))
    assert_absent(handled, "the logs and audit lines", written_by(replicas, tmp_path))


async def test_after_a_restart_the_job_polls_on_with_tokens_renewed_from_the_kept_refresh_token(
    tmp_path: Path,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    processes: list[ProxyProcess],
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    token_endpoint.lifetime_seconds = TOKEN_SECONDS
    database = tmp_path / "tasks.db"
    schemas = (modern_schema, tasks_schema)

    async def start() -> ProxyProcess:
        process = proxy(tmp_path, protected_upstream, token_endpoint, caller_issuer, store={"path": str(database)})
        processes.append(process)
        await process.start()
        return process

    first = await start()
    task_id, inbound = await start_job(first, schemas, caller_issuer)
    await asyncio.to_thread(first.stop)  # SIGKILL mid-job
    assert_absent(
        credentials_handled(token_endpoint, inbound), "the SQLite files while the job runs", sqlite_bytes(database)
    )

    second = await start()
    async with modern(second, schemas) as client:
        done = await run_to_the_end(client, task_id, caller_issuer)
        seen = await presented(client, caller_issuer)
    assert done["status"] == "completed", done
    assert token_endpoint.count("refresh") >= 2
    assert hashlib.sha256(inbound.encode()).hexdigest() not in seen
    handled = credentials_handled(token_endpoint, inbound)
    assert_absent(handled, "the SQLite files", sqlite_bytes(database))
    assert_absent(handled, "the logs and audit lines", written_by([first, second], tmp_path))
