"""`upstream.credentials: exchange` under faults: a job family whose caller's token expires long before the job
ends is polled to its end with tokens the kept refresh token renews, after its replica was killed (a second
PostgreSQL replica takes it over) and after a proxy restart (SQLite). The proxies run as processes (`python -m
proxy serve`) behind the real token endpoint of tests/support/token_server.py; what they wrote (logs, audit
lines, the store's bytes) is searched for every credential they handled, which must not be there in clear.

The issue's figure is a 90 s family with 20 s tokens (the closing note shows that run); here 9 s with 2 s tokens,
so the suite stays short while every poll after the first few seconds needs a renewed token.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from collections.abc import AsyncIterator, Iterator
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
from tests.support.token_server import TOKEN_ISSUER, TokenServer
from tests.support.waiting import until

pytestmark = pytest.mark.faults

LEASE_SECONDS = 2.0
JOB_SECONDS = 9.0
TOKEN_SECONDS = 2.0
CALLER_TOKEN_SECONDS = 4.0


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> Issuer:
    return Issuer(tmp_path_factory.mktemp("callers"))


@pytest.fixture
def endpoint(issuer: Issuer, tmp_path: Path) -> Iterator[TokenServer]:
    server = TokenServer(tmp_path, issuer, lifetime_seconds=TOKEN_SECONDS).start()
    yield server
    server.stop()


@pytest.fixture
def protected(endpoint: TokenServer) -> Iterator[Upstream]:
    server = Upstream("--auth", str(endpoint.jwks_path), TOKEN_ISSUER, "http://127.0.0.1:9/mcp")
    server.start()
    yield server
    server.stop()


def proxy(tmp_path: Path, upstream: Upstream, endpoint: TokenServer, issuer: Issuer, **sections: Any) -> ProxyProcess:
    key = tmp_path / "deployment.key"
    if not key.exists():
        key.write_bytes(os.urandom(48).hex().encode())
    return ProxyProcess(
        tmp_path,
        upstream.url,
        upstream={"credentials": endpoint.exchange_config(renew_before_seconds=0.5)},
        security={"jwt": {"jwks_file": str(issuer.jwks_path), "issuer": ISSUER}, "key_file": str(key)},
        audit={"path": str(tmp_path / f"audit-{os.urandom(4).hex()}.log")},
        tasks={"drain_seconds": 0},
        jobs=render_job(poll_interval_ms=500, shared=True),
        **sections,
    )


@asynccontextmanager
async def modern(process: ProxyProcess, schemas: tuple[ModernSchema, SchemaValidator]) -> AsyncIterator[Tasks]:
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{process.port}") as http:
        yield Tasks(cast(Client, http), *schemas)


def bearer(issuer: Issuer, lifetime: float = 600) -> dict[str, str]:
    return {"Authorization": f"Bearer {issuer.token('alice', lifetime=lifetime)}"}


async def run_to_the_end(client: Tasks, task_id: str, issuer: Issuer) -> dict[str, Any]:
    """Poll as a real client does, with a fresh token of its own each time, until the task settles."""

    async def settled() -> dict[str, Any] | None:
        task = await client.task(task_id, headers=bearer(issuer))
        return task if task["status"] in ("completed", "failed", "cancelled") else None

    done: dict[str, Any] = await until(settled, "the job task did not settle", JOB_SECONDS + 25)
    return done


async def presented(client: Tasks, issuer: Issuer) -> set[str]:
    status, message = await client.call("seen_tokens", {}, capabilities={}, headers=bearer(issuer))
    assert status == 200, message
    text = "".join(block.get("text", "") for block in message["result"]["content"])
    return set(json.loads(text))


def credentials_handled(endpoint: TokenServer, inbound: str) -> list[str]:
    """Every credential the proxies handled: the caller's token, the tokens issued, the refresh tokens, the
    proxy client's secret."""
    return [inbound, *endpoint.tokens_of("alice"), *endpoint.grants, endpoint.client_secret]


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


async def test_a_taken_over_job_polls_on_with_tokens_renewed_from_the_kept_refresh_token(
    tmp_path: Path,
    pg_dsn: str,
    protected: Upstream,
    endpoint: TokenServer,
    issuer: Issuer,
    processes: list[ProxyProcess],
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    store = {"url": pg.as_url(pg_dsn), "lease_seconds": LEASE_SECONDS}
    replicas = [proxy(tmp_path, protected, endpoint, issuer, store=store) for _ in range(2)]
    processes.extend(replicas)
    for replica in replicas:
        await replica.start()
    doomed, survivor = replicas
    schemas = (modern_schema, tasks_schema)
    started = bearer(issuer, lifetime=CALLER_TOKEN_SECONDS)
    inbound = started["Authorization"].removeprefix("Bearer ")
    async with modern(doomed, schemas) as client:
        task_id = await client.create("start_render", {"seconds": JOB_SECONDS}, headers=started)
        await client.until(
            task_id, lambda task: str(task.get("statusMessage", "")).endswith("%"), headers=bearer(issuer)
        )
    kept = await asyncio.to_thread(pg_text, pg_dsn)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM grants").fetchone() == (1,)  # kept for the task, sealed:
    assert_absent(credentials_handled(endpoint, inbound), "the database while the job runs", kept)
    await asyncio.to_thread(doomed.stop)  # SIGKILL: its lease runs out, the survivor takes the job over

    async with modern(survivor, schemas) as client:
        done = await run_to_the_end(client, task_id, issuer)
        seen = await presented(client, issuer)
    assert done["status"] == "completed", done
    assert endpoint.count("refresh") >= 2  # after the caller's token expired: renewed with the kept refresh token
    assert hashlib.sha256(inbound.encode()).hexdigest() not in seen

    def erased() -> bool:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM grants").fetchone() == (0,)

    await until(lambda: asyncio.to_thread(erased), "the grant outlived the last task of its caller", 15)
    handled = credentials_handled(endpoint, inbound)
    assert_absent(handled, "the database", await asyncio.to_thread(pg_text, pg_dsn))
    assert_absent(handled, "the logs and audit lines", written_by(replicas, tmp_path))


async def test_after_a_restart_the_job_polls_on_with_tokens_renewed_from_the_kept_refresh_token(
    tmp_path: Path,
    protected: Upstream,
    endpoint: TokenServer,
    issuer: Issuer,
    processes: list[ProxyProcess],
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    database = tmp_path / "tasks.db"
    schemas = (modern_schema, tasks_schema)

    async def start() -> ProxyProcess:
        process = proxy(tmp_path, protected, endpoint, issuer, store={"path": str(database)})
        processes.append(process)
        await process.start()
        return process

    first = await start()
    started = bearer(issuer, lifetime=CALLER_TOKEN_SECONDS)
    inbound = started["Authorization"].removeprefix("Bearer ")
    async with modern(first, schemas) as client:
        task_id = await client.create("start_render", {"seconds": JOB_SECONDS}, headers=started)
        await client.until(
            task_id, lambda task: str(task.get("statusMessage", "")).endswith("%"), headers=bearer(issuer)
        )
    await asyncio.to_thread(first.stop)  # SIGKILL mid-job
    assert_absent(credentials_handled(endpoint, inbound), "the SQLite files while the job runs", sqlite_bytes(database))

    second = await start()
    async with modern(second, schemas) as client:
        done = await run_to_the_end(client, task_id, issuer)
        seen = await presented(client, issuer)
    assert done["status"] == "completed", done
    assert endpoint.count("refresh") >= 2
    assert hashlib.sha256(inbound.encode()).hexdigest() not in seen
    handled = credentials_handled(endpoint, inbound)
    assert_absent(handled, "the SQLite files", sqlite_bytes(database))
    assert_absent(handled, "the logs and audit lines", written_by([first, second], tmp_path))
