"""Clients of the proxy: `Tasks` (a 2026-07-28 client of the Tasks extension on an in-process proxy, checking
every message against the schemas), a raw aiohttp client for proxies in child processes, and a wait for
calls open upstream. Imports the proxy's app keys only."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.edge._app_keys import POOL
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.sdk import calls_started, until_started_upstream
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, read_messages

Client = TestClient[web.Request, web.Application]

TASK_RESULT_DEFS = {
    "tasks/get": "GetTaskResult",
    "tasks/update": "UpdateTaskResult",
    "tasks/cancel": "CancelTaskResult",
}
ACK_FORBIDDEN_KEYS = {"taskId", "status", "result", "error", "inputRequests"}
TERMINAL = {"completed", "failed", "cancelled"}


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
        """Poll tasks/get until `done(task)` holds; the task as then seen."""
        last: dict[str, Any] = {}

        async def reached() -> dict[str, Any] | None:
            last.update(task=await self.task(task_id, **kwargs))
            return last["task"] if done(last["task"]) else None

        task: dict[str, Any] = await until(
            reached, lambda: f"task never reached the state: {last.get('task')}", timeout_seconds
        )
        return task

    async def settled(self, task_id: str, timeout_seconds: float = 15) -> dict[str, Any]:
        return await self.until(task_id, lambda task: task["status"] in TERMINAL, timeout_seconds)

    async def text(self, tool: str, arguments: dict[str, Any]) -> str:
        status, message = await self.call(tool, arguments, capabilities={})
        assert status == 200, message
        return "".join(block.get("text", "") for block in message["result"]["content"])


ClientFactory = Callable[..., Awaitable[Tasks]]


async def upstream_calls_open(client: Client, count: int, timeout_seconds: float = 10) -> None:
    """Wait until `count` upstream requests of the proxy's own sessions are open (the upstream answered their
    POSTs): the calls run upstream, not just in the proxy."""
    pool = client.app[POOL]
    await until(
        lambda: pool.calls_in_flight >= count,
        lambda: f"{pool.calls_in_flight} upstream calls open, not {count}",
        timeout_seconds,
    )


async def post_and_leave(client: Any, body: dict[str, Any], headers: dict[str, str], upstream_url: str) -> None:
    """POST a tools/call, wait until the upstream at `upstream_url` runs it, then close the connection without
    reading the answer (which cancels it)."""
    tool = body["params"]["name"]
    before = await calls_started(upstream_url, tool)
    request = client.post("/mcp", json=body, headers=headers)
    pending = asyncio.get_running_loop().create_task(request.__aenter__())
    await until_started_upstream(upstream_url, tool, before)
    pending.cancel()
    with pytest.raises(asyncio.CancelledError):
        await pending


# --- a raw client of a proxy in a child process -----------------------------------------------------------------


def meta(capabilities: dict[str, Any]) -> dict[str, Any]:
    return {
        "io.modelcontextprotocol/protocolVersion": "2026-07-28",
        "io.modelcontextprotocol/clientCapabilities": capabilities,
    }


async def rpc(
    session: aiohttp.ClientSession, url: str, method: str, params: dict[str, Any], capabilities: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": {**params, "_meta": meta(capabilities)}}
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": method,
    }
    name = params.get("taskId", params.get("name"))
    if isinstance(name, str):
        headers["Mcp-Name"] = name
    async with session.post(url, json=body, headers=headers) as response:
        text = await response.text()
        status = response.status
    last = [line for line in text.splitlines() if line.startswith("data:")] or [text]
    message: dict[str, Any] = json.loads(last[-1].removeprefix("data:").strip())
    return status, message


async def task_state(session: aiohttp.ClientSession, url: str, task_id: str) -> dict[str, Any]:
    status, message = await rpc(session, url, "tasks/get", {"taskId": task_id}, DECLARING)
    assert status == 200, message
    result: dict[str, Any] = message["result"]
    return result


async def task_until(
    session: aiohttp.ClientSession, url: str, task_id: str, done: Callable[[dict[str, Any]], bool]
) -> Any:
    """Poll a proxy's tasks/get over raw HTTP until `done(task)` holds; the task as then seen."""
    last: dict[str, Any] = {}

    async def reached() -> dict[str, Any] | None:
        last["task"] = await task_state(session, url, task_id)
        return last["task"] if done(last["task"]) else None

    return await until(reached, lambda: f"task never reached the state: {last.get('task')}", 20)
