"""Legacy (2025-06-18 / 2025-11-25) → 2026-07-28 translation of results, errors and notifications; pure
functions of decoded JSON. Sans-IO: must not import aiohttp, asyncio or the store."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, Final

from mcp_types import (
    CLIENT_CAPABILITIES_META_KEY,
    CLIENT_INFO_META_KEY,
    LOG_LEVEL_META_KEY,
    PROTOCOL_VERSION_META_KEY,
    SERVER_INFO_META_KEY,
)
from mcp_types import jsonrpc as codes
from mcp_types.methods import CACHEABLE_METHODS

from proxy.errors import RequestId
from proxy.wire import trace_context
from proxy.wire.envelope import SUPPORTED_VERSIONS, TASKS_EXTENSION
from proxy.wire.jsonrpc import JSON, error_message, result_message

# Legacy-only `_meta` keys that must not reach a modern client (absent from the 2026-07-28 wire).
LEGACY_META_KEYS: Final = frozenset(
    {
        "io.modelcontextprotocol/related-task",
        "io.modelcontextprotocol/model-immediate-response",
    }
)

# Codes in the spec-reserved band that 2026-07-28 defines; any other code in -32020…-32099 (e.g. the retired
# -32042) must not be re-emitted.
_RESERVED_BAND: Final = range(-32099, -32019)
_DEFINED_IN_BAND: Final = frozenset(
    {codes.HEADER_MISMATCH, codes.MISSING_REQUIRED_CLIENT_CAPABILITY, codes.UNSUPPORTED_PROTOCOL_VERSION}
)
_RESOURCE_NOT_FOUND_LEGACY: Final = -32002

LOG_LEVELS: Final = ("debug", "info", "notice", "warning", "error", "critical", "alert", "emergency")


def _without_legacy_meta(value: JSON) -> JSON:
    """A shallow copy of `value` whose `_meta` lacks the legacy-only keys (copying only what changes)."""
    copied = dict(value)
    meta = copied.get("_meta")
    if isinstance(meta, dict) and LEGACY_META_KEYS & meta.keys():
        kept = {key: item for key, item in meta.items() if key not in LEGACY_META_KEYS}
        if kept:
            copied["_meta"] = kept
        else:
            del copied["_meta"]
    return copied


def complete_result(method: str, legacy: JSON, server_info: JSON | None, cache: tuple[int, str] | None) -> JSON:
    """Decorate a legacy result for a modern client: resultType "complete" (legacy results have none),
    serverInfo in `_meta`, ttlMs + cacheScope on cacheable methods, legacy `_meta` stripped.

    Containers that change are copied, the rest is shared with `legacy`: results can be large and are relayed
    on the hot path, so there is no deep copy.
    """
    result = _without_legacy_meta(legacy)
    result.pop("resultType", None)
    if method == "tools/list":
        _strip_task_support(result)
    result["resultType"] = "complete"
    if cache is not None and method in CACHEABLE_METHODS:
        result["ttlMs"], result["cacheScope"] = cache
    if server_info is not None:
        meta = result.get("_meta")
        result["_meta"] = {**(meta if isinstance(meta, dict) else {}), SERVER_INFO_META_KEY: server_info}
    return result


def final_message(
    request_id: RequestId,
    method: str,
    result: JSON | None,
    error: JSON | None,
    server_info: JSON | None,
    cache: tuple[int, str] | None,
) -> JSON:
    """The modern answer to a request, from the upstream's final result or JSON-RPC error: the one place
    where a final answer is translated. Upstream errors are data: translated, never re-wrapped."""
    if error is not None:
        return error_message(request_id, error_object(error))
    return result_message(request_id, complete_result(method, result or {}, server_info, cache))


def _strip_task_support(result: JSON) -> None:
    """Legacy `execution.taskSupport` means nothing on the 2026 wire, whose Tool has no such field (task
    policy is the proxy's)."""
    tools = result.get("tools")
    if not isinstance(tools, list):
        return
    stripped = []
    for tool in tools:
        execution = tool.get("execution") if isinstance(tool, dict) else None
        if isinstance(execution, dict) and "taskSupport" in execution:
            tool = dict(tool)
            remaining = {key: item for key, item in execution.items() if key != "taskSupport"}
            if remaining:
                tool["execution"] = remaining
            else:
                del tool["execution"]
        stripped.append(tool)
    result["tools"] = stripped


def error_object(legacy: JSON) -> JSON:
    """Translate an upstream legacy JSON-RPC error object: -32002 → -32602; undefined reserved codes → -32603."""
    error = copy.deepcopy(legacy)
    code = error.get("code")
    if not isinstance(code, int) or isinstance(code, bool):
        return {"code": codes.INTERNAL_ERROR, "message": "Upstream sent a malformed error", "data": error}
    if code == _RESOURCE_NOT_FOUND_LEGACY:
        error["code"] = codes.INVALID_PARAMS
    elif code in _RESERVED_BAND and code not in _DEFINED_IN_BAND:
        error = {
            "code": codes.INTERNAL_ERROR,
            "message": f"Upstream error {code}: {error.get('message', '')}".strip(),
        }
    if not isinstance(error.get("message"), str):
        error["message"] = str(error.get("message", "Upstream error"))
    return error


def server_capabilities(legacy: JSON) -> JSON:
    """Upstream capabilities as the proxy serves them to a modern client.

    The legacy `tasks` block goes (a server with the Tasks extension must not advertise it) and the extension
    is advertised instead. `listChanged` and `subscribe` stay as the upstream declared them: the proxy
    delivers those notifications on `subscriptions/listen` streams from its upstream session's GET stream.
    """
    capabilities: JSON = {}
    for key in ("logging", "completions", "experimental"):
        if isinstance(legacy.get(key), dict):
            capabilities[key] = copy.deepcopy(legacy[key])
    for key, flags in (
        ("prompts", ("listChanged",)),
        ("resources", ("subscribe", "listChanged")),
        ("tools", ("listChanged",)),
    ):
        declared = legacy.get(key)
        if isinstance(declared, dict):
            capabilities[key] = {flag: True for flag in flags if declared.get(flag) is True}
    extensions = legacy.get("extensions")
    capabilities["extensions"] = copy.deepcopy(extensions) if isinstance(extensions, dict) else {}
    capabilities["extensions"][TASKS_EXTENSION] = {}
    return capabilities


# `subscriptions/listen` filter field → (capability, flag) the upstream must have declared, and the notification.
LIST_CHANGED: Final = {
    "toolsListChanged": ("tools", "notifications/tools/list_changed"),
    "promptsListChanged": ("prompts", "notifications/prompts/list_changed"),
    "resourcesListChanged": ("resources", "notifications/resources/list_changed"),
}
SUBSCRIPTION_ID_META_KEY: Final = "io.modelcontextprotocol/subscriptionId"


def honoured_filter(wanted: JSON, legacy_capabilities: JSON) -> JSON:
    """The subset of a listen request's filter the proxy can deliver (the ack's `notifications`)."""
    honoured: JSON = {}
    for field, (capability, _) in LIST_CHANGED.items():
        declared = legacy_capabilities.get(capability)
        if wanted.get(field) is True and isinstance(declared, dict) and declared.get("listChanged") is True:
            honoured[field] = True
    uris = wanted.get("resourceSubscriptions")
    resources = legacy_capabilities.get("resources")
    if isinstance(uris, list) and uris and isinstance(resources, dict) and resources.get("subscribe") is True:
        honoured["resourceSubscriptions"] = [uri for uri in dict.fromkeys(uris) if isinstance(uri, str)]
    return honoured


def listen_notification(message: JSON, honoured: JSON, subscription_id: int | str) -> JSON | None:
    """An upstream GET-stream notification as a listen-stream notification, if this subscription asked for it
    (the server MUST NOT send types the client did not request), tagged with the subscription id."""
    method = message.get("method")
    params = message.get("params")
    params = dict(params) if isinstance(params, dict) else {}
    if method == "notifications/resources/updated":
        if params.get("uri") not in honoured.get("resourceSubscriptions", ()):
            return None
    elif not any(honoured.get(field) and method == name for field, (_, name) in LIST_CHANGED.items()):
        return None
    meta = params.get("_meta")
    params["_meta"] = {**(meta if isinstance(meta, dict) else {}), SUBSCRIPTION_ID_META_KEY: subscription_id}
    for key in LEGACY_META_KEYS:
        params["_meta"].pop(key, None)
    return {"jsonrpc": "2.0", "method": method, "params": params}


def discover_result(initialize_result: JSON, cache: tuple[int, str]) -> JSON:
    """`server/discover` (which a legacy upstream lacks), synthesized from the upstream's InitializeResult:
    the versions the proxy serves, the translated capabilities, and the required ttlMs and cacheScope."""
    legacy_capabilities = initialize_result.get("capabilities")
    result: JSON = {
        "resultType": "complete",
        "supportedVersions": list(SUPPORTED_VERSIONS),
        "capabilities": server_capabilities(legacy_capabilities if isinstance(legacy_capabilities, dict) else {}),
        "ttlMs": cache[0],
        "cacheScope": cache[1],
    }
    instructions = initialize_result.get("instructions")
    if isinstance(instructions, str):
        result["instructions"] = instructions
    server_info = implementation(initialize_result)
    if server_info is not None:
        result["_meta"] = {SERVER_INFO_META_KEY: server_info}
    return result


# The last InitializeResult `implementation` read, and what it found: every modern call asks for the same one.
_implementation: tuple[JSON | None, JSON | None] = (None, None)


def implementation(initialize_result: JSON) -> JSON | None:
    """The upstream's serverInfo, if it is a valid Implementation (name and version strings): a copy, made once
    per InitializeResult (the same copy each time after that; nothing writes to it)."""
    global _implementation
    source, found = _implementation
    if source is initialize_result:
        return found
    info = initialize_result.get("serverInfo")
    found = None
    if isinstance(info, dict) and isinstance(info.get("name"), str) and isinstance(info.get("version"), str):
        found = copy.deepcopy(info)
    _implementation = (initialize_result, found)
    return found


def relay_notification(message: JSON, progress_token: str | int | None, log_level: str | None) -> JSON | None:
    """Which upstream notifications on a call's stream reach the modern client, and how.

    Progress only when the client sent a progressToken (re-tagged with it); log messages only when it set a
    logLevel and the message is at or above it. Everything else stays behind.
    """
    method = message.get("method")
    params = message.get("params")
    if not isinstance(params, dict):
        return None
    if method == "notifications/progress":
        if progress_token is None:
            return None
        return {**message, "params": {**_without_legacy_meta(params), "progressToken": progress_token}}
    if method == "notifications/message":
        if log_level is None or log_level not in LOG_LEVELS:
            return None
        level = params.get("level")
        if level not in LOG_LEVELS or LOG_LEVELS.index(level) < LOG_LEVELS.index(log_level):
            return None
        return {**message, "params": _without_legacy_meta(params)}
    return None


# Server→client requests a legacy server may send mid-call to ask the user or the model something; on the
# modern wire they travel only as `inputRequests` (basic/patterns/mrtr).
INPUT_METHODS: Final = frozenset({"elicitation/create", "sampling/createMessage", "roots/list"})


def required_capability(server_request_method: str, params: Any) -> JSON:
    """The ClientCapabilities a modern client needs to receive an upstream server→client request."""
    if server_request_method == "sampling/createMessage":
        return {"sampling": {}}
    if server_request_method == "roots/list":
        return {"roots": {}}
    if server_request_method == "elicitation/create":
        mode = params.get("mode") if isinstance(params, dict) else None
        return {"elicitation": {"url": {}}} if mode == "url" else {"elicitation": {}}
    return {}


# Per-request `_meta` keys of the modern envelope; they describe the client to the proxy, not to the upstream.
MODERN_META_KEYS: Final = frozenset(
    {PROTOCOL_VERSION_META_KEY, CLIENT_CAPABILITIES_META_KEY, CLIENT_INFO_META_KEY, LOG_LEVEL_META_KEY}
)
# Params the legacy server never sees: the envelope (filtered below), the legacy `task` opt-in (ignored by the
# Tasks extension) and the MRTR retry fields, which the proxy answers itself.
_NOT_FORWARDED: Final = frozenset({"_meta", "task", "inputResponses", "requestState"})


def upstream_params(params: Mapping[str, Any]) -> JSON:
    """The params the legacy server sees: no modern envelope keys, no legacy `task` opt-in (a modern client's
    `task` param is ignored, never an opt-in), no MRTR retry fields."""
    forwarded = {key: value for key, value in params.items() if key not in _NOT_FORWARDED}
    meta = params.get("_meta")
    if isinstance(meta, dict):
        kept = {key: value for key, value in meta.items() if key not in MODERN_META_KEYS}
        if kept and trace_context.has_trace_key(kept):
            # Trace context in `_meta` is parsed, never copied (protocol.md §3.14): what does not parse is dropped.
            kept = {key: value for key, value in kept.items() if key not in trace_context.TRACE_KEYS}
            kept.update(trace_context.parsed(meta))
        if kept:
            forwarded["_meta"] = kept
    return forwarded


def trace_headers(meta: Mapping[str, Any], http_headers: Mapping[str, str]) -> dict[str, str]:
    """Trace context for the upstream request's HTTP headers, parsed (W3C Trace Context, W3C Baggage): the
    request's HTTP headers, else its `_meta` keys. `traceparent` and `tracestate` come from one source, the
    first with a valid traceparent (a tracestate belongs to its traceparent); `baggage` from the first where it
    parses. What does not parse is dropped, never forwarded, so nothing here can split a header line."""
    if not trace_context.has_trace_key(http_headers) and not trace_context.has_trace_key(meta):
        return {}  # the common case: no trace context at all
    from_headers = trace_context.parsed(http_headers)
    from_meta = trace_context.parsed(meta)
    found = from_headers if "traceparent" in from_headers else from_meta
    found = {key: value for key, value in found.items() if key != "baggage"}
    if (baggage := from_headers.get("baggage", from_meta.get("baggage"))) is not None:
        found["baggage"] = baggage
    return found
