"""Shared fixtures: real legacy upstream servers in child processes, the proxy on loopback, schema checks.

Nothing is mocked: the upstream is the project's mcp 1.x fixture server (tests/upstream), started with
`python -m tests.upstream --port 0`; the proxy is the real aiohttp app served by pytest-aiohttp. The helpers
these fixtures hand out live in tests/support/; test modules import them from there, never from here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlite_utils import Database

from proxy.config.schema import LoggingConfig
from proxy.edge._ops import ops_app
from proxy.edge.app import create_app
from proxy.observe import logs, tracing_setup
from proxy.observe.logs import configure_logging
from tests import pg
from tests.reference_server import EverythingServer, stdio_argv
from tests.support import blocking
from tests.support.clients import ClientFactory, Tasks
from tests.support.oauth import Issuer
from tests.support.processes import ProxyProcess, Upstream, proxy_config
from tests.support.schemas import MODERN_SCHEMA, TASKS_SCHEMA, ModernSchema, SchemaValidator
from tests.support.token_server import TOKEN_ISSUER, TokenServer


@pytest.fixture(autouse=True)
def no_blocking_calls_on_the_event_loop(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """A blocking call made by the proxy's code on the thread of a running event loop fails the test: a
    `time.sleep`, or a sqlite-utils statement (the store runs those in its own threads). Each is recorded where
    it happens (the proxy may catch what is raised there) and the test fails at its end."""
    found = blocking.Recorder()
    monkeypatch.setattr(time, "sleep", found.guard(time.sleep, "time.sleep"))
    for name in ("execute", "query"):
        monkeypatch.setattr(Database, name, found.guard(getattr(Database, name), f"sqlite_utils.Database.{name}"))
    yield found.calls
    assert found.calls == [], f"blocking calls on the event loop: {found.calls}"


@pytest.fixture(scope="session")
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def own_upstream() -> Iterator[Upstream]:
    """An upstream for one test alone (it may stop and restart it)."""
    server = Upstream()
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def make_proxy(
    tmp_path: Path,
) -> AsyncIterator[Callable[..., Any]]:
    """Start a proxy in front of `url`; returns an aiohttp TestClient (real HTTP on loopback)."""
    clients: list[TestClient[web.Request, web.Application]] = []

    async def start(url: str, **sections: dict[str, Any]) -> TestClient[web.Request, web.Application]:
        app = create_app(proxy_config(url, tmp_path, **sections))
        client = TestClient(TestServer(app, host="127.0.0.1", handler_cancellation=True))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
async def proxy(make_proxy: Callable[..., Any], upstream: Upstream) -> TestClient[web.Request, web.Application]:
    client: TestClient[web.Request, web.Application] = await make_proxy(upstream.url)
    return client


@pytest.fixture
def quiet_logs(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's logging as `logging.level: warning` configures it (no request lines, nothing below
    warning), restored after the test."""
    saved = structlog.get_config()
    monkeypatch.setattr(logs, "_min_level", logs._min_level)
    monkeypatch.setattr(logs, "_request_log", logs._request_log)
    configure_logging(LoggingConfig(level="warning"))
    yield
    structlog.configure(**saved)


@pytest.fixture(scope="session")
def modern_schema() -> ModernSchema:
    return ModernSchema(MODERN_SCHEMA)


@pytest.fixture(scope="module")
def tasks_schema() -> SchemaValidator:
    return SchemaValidator(TASKS_SCHEMA)


@pytest.fixture
def tasks_client(
    make_proxy: Callable[..., Any], upstream: Upstream, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> ClientFactory:
    async def start(url: str | None = None, **sections: dict[str, Any]) -> Tasks:
        client = await make_proxy(url or upstream.url, **sections)
        return Tasks(client, modern_schema, tasks_schema)

    return start


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A plain HTTP client for tests that talk to a proxy process or an upstream themselves."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def operations() -> AsyncIterator[Callable[[TestClient[web.Request, web.Application]], Any]]:
    """The operations listener (metrics, readiness with its reasons) of an in-process proxy, served beside it on
    loopback as `serve` serves it on `observability.port`."""
    clients: list[TestClient[web.Request, web.Application]] = []

    async def start(proxy: TestClient[web.Request, web.Application]) -> TestClient[web.Request, web.Application]:
        client = TestClient(TestServer(ops_app(proxy.app), host="127.0.0.1"))
        await client.start_server()
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()


@pytest.fixture
def processes() -> Iterator[list[ProxyProcess]]:
    started: list[ProxyProcess] = []
    yield started
    for process in started:
        process.stop()


# --- upstreams that run their own 2025-11-25 tasks ------------------------------------------------------------


@pytest.fixture(scope="session")
def legacy_task_upstream() -> Iterator[Upstream]:
    """The fixture upstream with the SDK's experimental Tasks and the legacy_task_* tools (--legacy-tasks)."""
    server = Upstream("--legacy-tasks")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def everything() -> Iterator[EverythingServer]:
    """The reference server @modelcontextprotocol/server-everything over Streamable HTTP (`.url`).

    `make test` installs it; when Node or the package is missing this fails with how to install them.
    """
    server = EverythingServer()
    try:
        server.start()
        yield server
    finally:
        server.close()


@pytest.fixture
def everything_stdio_argv() -> list[str]:
    """The argv of server-everything in stdio mode (fails, not skips, when it is not installed)."""
    return stdio_argv()


# --- PostgreSQL for the store tests (tests/pg.py): a server per session, a database per test ----------------


@pytest.fixture(scope="session")
def pg_server() -> Iterator[pg.PgServer]:
    """MCP_TASKS_PROXY_TEST_PG's server, else a throwaway one; a server that cannot start fails the tests."""
    with pg.server() as server:
        yield server


@pytest.fixture
def pg_dsn(pg_server: pg.PgServer) -> Iterator[str]:
    """A fresh, empty database of its own for one test (dropped afterwards)."""
    with pg_server.database() as dsn:
        yield dsn


@pytest.fixture
async def own_pg_server() -> AsyncIterator[pg.PgServer]:
    """A throwaway server of one test alone, which it may stop, start, freeze or fail over."""
    started = await asyncio.to_thread(pg.start_throwaway)
    try:
        yield started
    finally:
        await asyncio.to_thread(started.stop)


# --- upstream credentials: callers, a token endpoint, an upstream that trusts only that endpoint ---------------------


@pytest.fixture(scope="module")
def caller_issuer(tmp_path_factory: pytest.TempPathFactory) -> Issuer:
    """The callers' token issuer (the proxy verifies its JWTs with `security.jwt`)."""
    return Issuer(tmp_path_factory.mktemp("callers"))


@pytest.fixture
def token_endpoint(caller_issuer: Issuer, tmp_path: Path) -> Iterator[TokenServer]:
    """A real token endpoint (Authlib) that exchanges the callers' tokens; each test sets its switches."""
    server = TokenServer(tmp_path, caller_issuer).start()
    yield server
    server.stop()


@pytest.fixture
def protected_upstream(token_endpoint: TokenServer) -> Iterator[Upstream]:
    """The fixture upstream as an OAuth resource server that accepts the token endpoint's tokens only."""
    server = Upstream("--auth", str(token_endpoint.jwks_path), TOKEN_ISSUER, "http://127.0.0.1:9/mcp")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Tracing on, every finished span kept in memory (turned off after the test)."""
    exporter = InMemorySpanExporter()
    assert tracing_setup.configure(environ={}, processor=SimpleSpanProcessor(exporter))
    yield exporter
    tracing_setup.shutdown()
