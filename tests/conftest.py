"""Shared fixtures: real legacy upstream servers in child processes, the proxy on loopback, schema checks.

Nothing is mocked: the upstream is the project's mcp 1.x fixture server (tests/upstream), started with
`python -m tests.upstream --port 0`; the proxy is the real aiohttp app served by pytest-aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import UPSTREAM, create_app
from proxy.config import Config, load_config
from tests import pg
from tests.reference_server import EverythingServer, stdio_argv

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_DIR = ROOT / "tests" / "schema"  # vendored: the repository needs nothing beside it
MODERN = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"


class Upstream:
    """A legacy fixture server running in its own process."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self.process: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, port: int = 0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.upstream", "--host", "127.0.0.1", "--port", str(port), *self.flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.startswith("ready "):
            self.stop()
            raise RuntimeError(f"upstream did not start: {line!r}")
        self.url = line.split(" ", 1)[1]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


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


def key_file(tmp_path: Path) -> str:
    """A deployment key (security.key_file) for proxies of one test: they share it, as replicas or restarts do."""
    path = tmp_path / "deployment.key"
    if not path.exists():
        path.write_text(os.urandom(32).hex())
    return str(path)


def proxy_config(upstream_url: str, tmp_path: Path, **sections: dict[str, Any]) -> Config:
    # Each proxy gets its own database unless the test names one (a file serves one proxy at a time).
    database = tmp_path / "tasks.db"
    number = 1
    while database.exists():
        number += 1
        database = tmp_path / f"tasks-{number}.db"
    overrides: dict[str, dict[str, Any]] = {
        "upstream": {"url": upstream_url, "call_timeout_seconds": 30},
        "store": {"path": str(database), "synchronous": "normal"},
        "logging": {"level": "warning"},
    }
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    return load_config(None, environ={}, overrides=overrides)


ProxyFactory = Callable[..., "AsyncIterator[TestClient[web.Request, web.Application]]"]


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


# --- modern request helpers -----------------------------------------------------------------------------


def modern_meta(capabilities: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "io.modelcontextprotocol/protocolVersion": MODERN,
        "io.modelcontextprotocol/clientCapabilities": capabilities if capabilities is not None else {},
        "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "1"},
        **extra,
    }


def modern_headers(method: str, name: str | None = None, **extra: str) -> dict[str, str]:
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": MODERN,
        "Mcp-Method": method,
    }
    if name is not None:
        headers["Mcp-Name"] = name
    headers.update(extra)
    return headers


def modern_body(
    method: str, params: dict[str, Any] | None = None, *, request_id: int | str = 1, **meta: Any
) -> dict[str, Any]:
    capabilities = meta.pop("capabilities", None)
    body_params = dict(params or {})
    body_params["_meta"] = modern_meta(capabilities, **meta)
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": body_params}


def parse_sse(text: str) -> list[dict[str, Any]]:
    messages = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].lstrip(" ") for line in block.split("\n") if line.startswith("data:")]
        if data and "".join(data).strip():
            messages.append(json.loads("\n".join(data)))
    return messages


async def post_and_leave(
    client: Any, body: dict[str, Any], headers: dict[str, str], after_seconds: float = 0.5
) -> None:
    """POST a request, then close the connection after `after_seconds` without reading the answer (which cancels it)."""
    request = client.post("/mcp", json=body, headers=headers)
    pending = asyncio.get_running_loop().create_task(request.__aenter__())
    await asyncio.sleep(after_seconds)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending


async def read_messages(response: Any) -> list[dict[str, Any]]:
    """Every JSON-RPC message of a response, whether it came as JSON or as an SSE stream."""
    text = await response.text()
    if response.headers.get("Content-Type", "").startswith("text/event-stream"):
        return parse_sse(text)
    return [json.loads(text)]


# --- schema validation ---------------------------------------------------------------------------------


class SchemaValidator:
    def __init__(self, path: Path) -> None:
        self.document = json.loads(path.read_text())
        self.defs = self.document["$defs"]

    def validate(self, instance: Any, definition: str) -> None:
        schema = {"$schema": self.document["$schema"], "$defs": self.defs, "$ref": f"#/$defs/{definition}"}
        jsonschema.Draft202012Validator(schema).validate(instance)


RESPONSE_DEFS = {
    "server/discover": "DiscoverResultResponse",
    "tools/list": "ListToolsResultResponse",
    "tools/call": "CallToolResultResponse",
    "prompts/list": "ListPromptsResultResponse",
    "prompts/get": "GetPromptResultResponse",
    "resources/list": "ListResourcesResultResponse",
    "resources/templates/list": "ListResourceTemplatesResultResponse",
    "resources/read": "ReadResourceResultResponse",
    "completion/complete": "CompleteResultResponse",
}


class ModernSchema(SchemaValidator):
    def check(self, message: dict[str, Any], method: str) -> None:
        """Validate one message the proxy sent for a request of `method` against the 2026-07-28 schema."""
        if "error" in message:
            self.validate(message, "JSONRPCErrorResponse")
        elif "result" in message:
            self.validate(message, RESPONSE_DEFS[method])
            if message["result"].get("resultType") == "input_required":
                # Only these methods may answer `input_required`; the loose anyOf of the response type is not enough.
                assert method in ("tools/call", "prompts/get", "resources/read"), method
                self.validate(message["result"], "InputRequiredResult")
        else:
            self.validate(message, "ServerNotification")

    def check_all(self, messages: list[dict[str, Any]], method: str) -> None:
        for message in messages:
            self.check(message, method)


@pytest.fixture(scope="session")
def modern_schema() -> ModernSchema:
    return ModernSchema(SCHEMA_DIR / "mcp-2026-07-28.schema.json")


Client = TestClient[web.Request, web.Application]


# --- a modern client of the Tasks extension ----------------------------------------------------------------

DECLARING: dict[str, Any] = {"extensions": {TASKS: {}}}
TASK_RESULT_DEFS = {
    "tasks/get": "GetTaskResult",
    "tasks/update": "UpdateTaskResult",
    "tasks/cancel": "CancelTaskResult",
}
ACK_FORBIDDEN_KEYS = {"taskId", "status", "result", "error", "inputRequests"}


@pytest.fixture(scope="module")
def tasks_schema() -> SchemaValidator:
    return SchemaValidator(SCHEMA_DIR / "tasks-extension-2026-07-28.schema.json")


class Tasks:
    """A modern client of one proxy, checking every message against both schemas."""

    def __init__(self, client: Client, core: ModernSchema, tasks: SchemaValidator) -> None:
        self.client = client
        self.core = core
        self.tasks = tasks
        self.ids = 0

    async def post(
        self,
        method: str,
        params: dict[str, Any],
        *,
        capabilities: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        **meta: Any,
    ) -> tuple[int, dict[str, Any]]:
        self.ids += 1
        name = params.get({"resources/read": "uri"}.get(method, "name")) if "/" in method else None
        if method.startswith("tasks/"):
            name = params.get("taskId")
        response = await self.client.post(
            "/mcp",
            json=modern_body(
                method,
                params,
                request_id=self.ids,
                capabilities=DECLARING if capabilities is None else capabilities,
                **meta,
            ),
            headers={**modern_headers(method, name if isinstance(name, str) else None), **(headers or {})},
        )
        messages = await read_messages(response)
        final = messages[-1]
        assert final["id"] == self.ids
        self.check(final, method)
        return response.status, final

    def check(self, message: dict[str, Any], method: str) -> None:
        if "error" in message:
            self.core.validate(message, "JSONRPCErrorResponse")
            return
        result = message["result"]
        if result.get("resultType") == "task":
            assert method == "tools/call"  # only tools/call may become a task
            self.tasks.validate(result, "CreateTaskResult")
            assert not {"result", "error", "inputRequests", "requestState", "task"} & result.keys()  # flat, no outcome
        elif method in TASK_RESULT_DEFS:
            self.tasks.validate(result, TASK_RESULT_DEFS[method])
            assert result["resultType"] == "complete"  # never "task" on tasks/*
            if method != "tasks/get":
                assert not ACK_FORBIDDEN_KEYS & result.keys()  # acks are empty
        else:
            self.core.check(message, method)

    async def call(
        self, tool: str, arguments: dict[str, Any] | None = None, **kwargs: Any
    ) -> tuple[int, dict[str, Any]]:
        return await self.post("tools/call", {"name": tool, "arguments": arguments or {}}, **kwargs)

    async def create(self, tool: str, arguments: dict[str, Any] | None = None, **kwargs: Any) -> str:
        status, message = await self.call(tool, arguments, **kwargs)
        assert status == 200, message
        assert message["result"]["resultType"] == "task", message
        task_id: str = message["result"]["taskId"]
        return task_id

    async def get(self, task_id: str, **kwargs: Any) -> tuple[int, dict[str, Any]]:
        return await self.post("tasks/get", {"taskId": task_id}, **kwargs)

    async def task(self, task_id: str, **kwargs: Any) -> dict[str, Any]:
        status, message = await self.get(task_id, **kwargs)
        assert status == 200, message
        result: dict[str, Any] = message["result"]
        return result

    async def until(
        self, task_id: str, done: Callable[[dict[str, Any]], bool], timeout_seconds: float = 15, **kwargs: Any
    ) -> dict[str, Any]:
        deadline = asyncio.get_running_loop().time() + timeout_seconds
        while True:
            task = await self.task(task_id, **kwargs)
            if done(task):
                return task
            assert asyncio.get_running_loop().time() < deadline, f"task never reached the state: {task}"
            await asyncio.sleep(0.05)

    async def settled(self, task_id: str, timeout_seconds: float = 15) -> dict[str, Any]:
        terminal = {"completed", "failed", "cancelled"}
        return await self.until(task_id, lambda task: task["status"] in terminal, timeout_seconds)

    async def text(self, tool: str, arguments: dict[str, Any]) -> str:
        status, message = await self.call(tool, arguments, capabilities={})
        assert status == 200, message
        return "".join(block.get("text", "") for block in message["result"]["content"])


ClientFactory = Callable[..., Awaitable[Tasks]]


@pytest.fixture
def tasks_client(
    make_proxy: Callable[..., Any], upstream: Upstream, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> ClientFactory:
    async def start(url: str | None = None, **sections: dict[str, Any]) -> Tasks:
        client = await make_proxy(url or upstream.url, **sections)
        return Tasks(client, modern_schema, tasks_schema)

    return start


async def upstream_calls_open(client: Client, count: int, timeout_seconds: float = 10) -> None:
    """Wait until `count` upstream requests of the proxy's own sessions are open (the upstream answered their
    POSTs): the calls run upstream, not just in the proxy."""
    pool = client.app[UPSTREAM]
    deadline = asyncio.get_running_loop().time() + timeout_seconds
    while pool.calls_in_flight < count:
        assert asyncio.get_running_loop().time() < deadline, f"{pool.calls_in_flight} upstream calls open, not {count}"
        await asyncio.sleep(0.01)


def policies(**tools: dict[str, Any]) -> dict[str, Any]:
    return {"tools": tools}


def result_text(task: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in task["result"]["content"])


# --- the proxy as a child process ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ProxyProcess:
    """`python -m proxy serve` with a config file; stderr (the JSON log) goes to a file."""

    def __init__(self, tmp_path: Path, upstream_url: str, **sections: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = tmp_path / f"proxy-{self.port}.log"
        self.config = tmp_path / f"proxy-{self.port}.yaml"
        config: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "upstream": {"url": upstream_url},
            "store": {"path": str(tmp_path / "ops.db"), "synchronous": "normal"},
            "logging": {"level": "info", "format": "json"},
        }
        for name, values in sections.items():
            config.setdefault(name, {}).update(values)
        self.config.write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen[bytes] | None = None

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(self.config)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    async def start(self) -> None:
        self.process = await asyncio.to_thread(self._spawn)
        deadline = asyncio.get_running_loop().time() + 20
        async with aiohttp.ClientSession() as http:
            while True:
                assert self.process.poll() is None, self.log.read_text()
                try:
                    async with http.get(f"http://127.0.0.1:{self.port}/healthz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                assert asyncio.get_running_loop().time() < deadline, "the proxy did not start"
                await asyncio.sleep(0.05)

    async def terminate(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.process.wait, 60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]


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
