"""One 2026-07-28 client's requests: each POST carries the per-request `_meta` and the routing headers (`Mcp-Method`,
`Mcp-Name`, a tool's `Mcp-Param-*`); its answer is read as JSON or as an SSE stream whose progress goes to a
callback. Failures are typed: `UnreachableError`, `RpcError`. Imports aiohttp's client and the wire."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Mapping
from typing import Any, Final

import aiohttp

from proxy.wire.envelope import encode_header_value, param_headers
from proxy.wire.sse import SSEParser

PROTOCOL_VERSION: Final = "2026-07-28"
TASKS_EXTENSION: Final = "io.modelcontextprotocol/tasks"
_META: Final = "io.modelcontextprotocol/"
MAX_ANSWER_CHARS: Final = 64 * 1024 * 1024  # an SSE event larger than this is refused, not held

Progress = Callable[[dict[str, Any]], None]  # the params of a `notifications/progress`


class UnreachableError(Exception):
    """Nothing answered at the URL: refused, unknown host, timed out, or not HTTP."""


class RpcError(Exception):
    """The endpoint answered with a JSON-RPC error (or an HTTP error without one)."""

    def __init__(self, status: int, code: int | None, message: str, data: object = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.data = data


def param_header_values(input_schema: object, arguments: Mapping[str, Any]) -> dict[str, str]:
    """The `Mcp-Param-{Name}` headers a call with `arguments` carries for the tool's `x-mcp-header` annotations:
    strings as they are, integers in decimal, booleans in lowercase (Streamable HTTP's value encoding)."""
    headers = {}
    for spec in param_headers(input_schema):
        value: Any = arguments
        for key in spec.path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            continue
        text = ("true" if value else "false") if isinstance(value, bool) else str(value)
        headers[f"Mcp-Param-{spec.name}"] = encode_header_value(text)
    return headers


class Connection:
    """Requests to one endpoint `url` with `headers` (credentials) on every one; `elicitation` declares that the
    client can answer the upstream's questions (a person is at the terminal)."""

    def __init__(self, url: str, headers: Mapping[str, str], *, elicitation: bool, version: str) -> None:
        self.url = url
        self.headers = dict(headers)
        capabilities: dict[str, Any] = {"extensions": {TASKS_EXTENSION: {}}}
        if elicitation:
            capabilities["elicitation"] = {}  # form mode: questions answered as typed fields
        self.capabilities = capabilities
        self.client_info = {"name": "mcp-tasks-proxy", "version": version}
        self._ids = itertools.count(1)
        self._http: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Connection:
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._http is not None:
            await self._http.close()

    async def request(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        name: str | None = None,
        headers: Mapping[str, str] | None = None,
        progress: Progress | None = None,
    ) -> dict[str, Any]:
        """The result of one request; `name` goes in `Mcp-Name`; with `progress`, a progress token is sent and
        each `notifications/progress` of the answer's stream is handed to it."""
        assert self._http is not None, "use the connection as an async context manager"
        request_id = next(self._ids)
        meta = {
            f"{_META}protocolVersion": PROTOCOL_VERSION,
            f"{_META}clientCapabilities": self.capabilities,
            f"{_META}clientInfo": self.client_info,
        }
        if progress is not None:
            meta["progressToken"] = f"progress-{request_id}"
        body = {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {**(params or {}), "_meta": meta}}
        sent = {
            **self.headers,
            "Content-Type": "application/json",
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": PROTOCOL_VERSION,
            "Mcp-Method": method,
            **({"Mcp-Name": encode_header_value(name)} if name is not None else {}),
            **(headers or {}),
        }
        try:
            async with self._http.post(self.url, data=json.dumps(body), headers=sent) as response:
                message = await _answer(response, request_id, progress)
        except (aiohttp.ClientConnectionError, aiohttp.InvalidURL, TimeoutError) as exc:
            raise UnreachableError(str(exc) or type(exc).__name__) from None
        except aiohttp.ClientPayloadError as exc:
            raise UnreachableError(f"the answer broke off: {exc}") from None
        error = message.get("error")
        if isinstance(error, dict):
            raise RpcError(
                message.get("_status", 200), error.get("code"), str(error.get("message", "")), error.get("data")
            )
        result = message.get("result")
        if not isinstance(result, dict):
            raise RpcError(message.get("_status", 200), None, "the answer holds no result")
        return result


async def _answer(response: aiohttp.ClientResponse, request_id: int, progress: Progress | None) -> dict[str, Any]:
    """The JSON-RPC answer to `request_id`, from a JSON body or an SSE stream (progress handed on meanwhile);
    `_status` is the HTTP status. An HTTP error without a JSON-RPC body becomes one."""
    content_type = response.headers.get("Content-Type", "")
    if content_type.startswith("text/event-stream"):
        parser = SSEParser(MAX_ANSWER_CHARS)
        async for chunk in response.content.iter_any():
            for event in parser.feed(chunk):
                message = _json(event.data)
                if not isinstance(message, dict):
                    continue
                if message.get("method") == "notifications/progress" and progress is not None:
                    params = message.get("params")
                    progress(params if isinstance(params, dict) else {})
                elif message.get("id") == request_id:
                    return {**message, "_status": response.status}
        raise RpcError(response.status, None, "the answer's stream ended before its result")
    text = await response.text()
    message = _json(text)
    if isinstance(message, dict) and ("result" in message or "error" in message):
        return {**message, "_status": response.status}
    reason = f"HTTP {response.status} {response.reason or ''}".strip()
    detail = message.get("message") if isinstance(message, dict) else text.strip()[:200]
    raise RpcError(response.status, None, f"{reason}: {detail}" if detail else reason)


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None
