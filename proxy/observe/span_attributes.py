"""What the spans of the MCP semantic conventions say about a request or a call, worked out from the request
alone: span names and their low-cardinality targets, the attributes of a SERVER and of a CLIENT span, the
error type an answer carries. Pure: no span is started or kept here, so this imports no OpenTelemetry (API or
SDK) and nothing of the proxy; `tracing` asks for these only for a span that records.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from mcp_types import PROTOCOL_VERSION_META_KEY

TASK_METHODS: Final = frozenset({"tasks/get", "tasks/update", "tasks/cancel", "tasks/result"})
TASK_ID: Final = "mcp.task.id"  # no semantic convention names a task id yet
# A SERVER span's attributes that the CLIENT span relaying its request copies.
_COPIED_PREFIXES: Final = ("gen_ai.", "mcp.method", "mcp.proto")


def text(value: object) -> str | None:
    return value if isinstance(value, str) else None


def target_of(method: str, params: Mapping[str, Any]) -> tuple[str | None, dict[str, str]]:
    """The low-cardinality target of the span name, and its attributes (tool or prompt name only: a resource
    URI may name anything and stays out)."""
    if method == "tools/call" and (name := text(params.get("name"))) is not None:
        return name, {"gen_ai.tool.name": name, "gen_ai.operation.name": "execute_tool"}
    if method == "prompts/get" and (name := text(params.get("name"))) is not None:
        return name, {"gen_ai.prompt.name": name}
    return None, {}


def span_name(method: str, target: str | None) -> str:
    return f"{method} {target}" if target else method


@dataclass(frozen=True, slots=True)
class RequestTarget:
    """What a request is about: its MCP method (None: no JSON-RPC message was read), the target of its span
    name, its HTTP method and the attributes of its SERVER span."""

    method: str | None
    target: str | None
    http_method: str
    attributes: Mapping[str, Any]

    @property
    def name(self) -> str:
        return span_name(self.method or self.http_method, self.target)

    def copied(self) -> RequestTarget:
        """Itself with only the attributes a relayed request's CLIENT span copies (spans below a legacy
        request's SERVER span see bytes only)."""
        kept = {key: value for key, value in self.attributes.items() if key.startswith(_COPIED_PREFIXES)}
        return replace(self, attributes=kept)


NO_REQUEST: Final = RequestTarget(None, None, "POST", {})  # relayed outside any SERVER span


def server_request(
    headers: Mapping[str, str],
    decoded: Mapping[str, Any],
    method: str | None,
    params: Mapping[str, Any],
    meta: Mapping[str, Any],
    *,
    era: str,
    http_method: str,
    peer: str | None,
) -> RequestTarget:
    """The SERVER span's description of one request: `decoded` its JSON-RPC message (empty if none was read),
    `method`, `params` and `meta` what it holds of them. `tasks/*` spans carry the task id."""
    attributes: dict[str, Any] = {"network.transport": "tcp", "network.protocol.name": "http", "mcp.era": era}
    if peer:
        attributes["client.address"] = peer
    target: str | None = None
    if method is None:  # no JSON-RPC message: a GET, a DELETE, a body not read or not JSON
        attributes["http.request.method"] = http_method
    else:
        attributes["mcp.method.name"] = method
        target, more = target_of(method, params)
        attributes.update(more)
        if (request_id := decoded.get("id")) is not None:
            attributes["jsonrpc.request.id"] = str(request_id)
        if method in TASK_METHODS and (task_id := text(params.get("taskId"))) is not None:
            attributes[TASK_ID] = task_id  # the link to the creating span comes once the record is read
    version = headers.get("MCP-Protocol-Version") or text(meta.get(PROTOCOL_VERSION_META_KEY))
    if version is None and method == "initialize":
        version = text(params.get("protocolVersion"))
    if version:
        attributes["mcp.protocol.version"] = version
    if era == "legacy" and (session_id := headers.get("Mcp-Session-Id")):
        attributes["mcp.session.id"] = session_id
    return RequestTarget(method, target, http_method, attributes)


def client_request(
    method: str | None, params: Any, transport: str, protocol_version: str | None, relayed: RequestTarget
) -> tuple[str | None, dict[str, Any]]:
    """The name (None: the one it started with) and attributes of the CLIENT span of one upstream request
    (`transport`: `tcp` for HTTP, `pipe` for stdio); `method` None: the request `relayed` describes."""
    attributes: dict[str, Any] = {"network.transport": transport}
    if transport == "tcp":
        attributes["network.protocol.name"] = "http"
    name: str | None = None
    if method is None:  # relayed: what the SERVER span knows of the request
        attributes.update(relayed.attributes)
        if relayed.method is None:
            attributes["http.request.method"] = relayed.http_method
        name = relayed.name
    else:
        target, more = target_of(method, params if isinstance(params, dict) else {})
        attributes["mcp.method.name"] = method
        attributes.update(more)
        if target:
            name = span_name(method, target)
    if protocol_version:
        attributes["mcp.protocol.version"] = protocol_version
    return name, attributes


def reply_error_type(message: Mapping[str, Any]) -> str | None:
    """The error type an answer carries: its JSON-RPC error code, `tool_error` for a CallToolResult with
    isError, None for a success."""
    error = message.get("error")
    if isinstance(error, dict):
        return str(error.get("code"))
    result = message.get("result")
    if isinstance(result, dict) and result.get("isError") is True:
        return "tool_error"
    return None
