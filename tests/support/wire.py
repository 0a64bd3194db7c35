"""What a client puts on the wire and reads back: 2026-07-28 request bodies and headers, SSE parsing, the
legacy (2025-11-25) handshake, and the capability sets the tests declare. Imports only the proxy's SSE parser."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import ClientResponse

from proxy.wire.sse import SSEParser

MODERN = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"

DECLARING: dict[str, Any] = {"extensions": {TASKS: {}}}  # a client of the Tasks extension
TASKING: dict[str, Any] = {**DECLARING, "elicitation": {}}  # ... that can also answer elicitation
ELICITING = TASKING

# A legacy (2025-11-25) client's raw handshake.
HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
INITIALIZE: dict[str, Any] = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "raw", "version": "1"}},
}


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


async def read_messages(response: Any) -> list[dict[str, Any]]:
    """Every JSON-RPC message of a response, whether it came as JSON or as an SSE stream."""
    text = await response.text()
    if response.headers.get("Content-Type", "").startswith("text/event-stream"):
        return parse_sse(text)
    return [json.loads(text)]


async def sse_messages(response: ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON-RPC messages of an SSE stream as they arrive."""
    parser = SSEParser()
    async for chunk in response.content.iter_any():
        for event in parser.feed(chunk):
            if event.data.strip():
                yield json.loads(event.data)


def policies(**tools: dict[str, Any]) -> dict[str, Any]:
    return {"tools": tools}


def result_text(task: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in task["result"]["content"])
