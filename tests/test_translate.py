"""wire/translate.py: legacy results, errors and notifications as a modern client must see them."""

from __future__ import annotations

from typing import Any

from multidict import CIMultiDict

from proxy.wire.translate import (
    complete_result,
    discover_result,
    error_object,
    honoured_filter,
    listen_notification,
    relay_notification,
    required_capability,
    server_capabilities,
    trace_headers,
    upstream_params,
)

SERVER_INFO = {"name": "up", "version": "1.0"}
CACHE = (60_000, "private")


def test_every_result_gets_result_type_complete_and_server_info() -> None:
    """Legacy results carry no resultType; every 2026-07-28 result must, and should name the server in
    `_meta`."""
    result = complete_result("tools/call", {"content": [], "isError": False}, SERVER_INFO, CACHE)
    assert result["resultType"] == "complete"
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"] == SERVER_INFO
    assert "ttlMs" not in result  # tools/call results are not cacheable


def test_cacheable_results_carry_ttl_and_scope() -> None:
    """The lists and resources/read are cacheable results: they carry ttlMs and cacheScope
    (server/utilities/caching)."""
    for method in ("tools/list", "prompts/list", "resources/list", "resources/templates/list", "resources/read"):
        result = complete_result(method, {}, None, CACHE)
        assert (result["ttlMs"], result["cacheScope"]) == CACHE, method


def test_legacy_meta_and_task_support_are_stripped_and_input_is_not_mutated() -> None:
    legacy: dict[str, Any] = {
        "tools": [{"name": "a", "inputSchema": {"type": "object"}, "execution": {"taskSupport": "optional"}}],
        "_meta": {"io.modelcontextprotocol/related-task": {"taskId": "x"}, "keep/me": 1},
    }
    result = complete_result("tools/list", legacy, None, CACHE)
    assert "execution" not in result["tools"][0]
    assert result["_meta"] == {"keep/me": 1}
    assert legacy["tools"][0]["execution"] == {"taskSupport": "optional"}
    assert "io.modelcontextprotocol/related-task" in legacy["_meta"]


def test_resource_not_found_becomes_invalid_params() -> None:
    """-32002 must not be emitted by a 2026-07-28 server."""
    error = error_object({"code": -32002, "message": "Resource not found", "data": {"uri": "test://x"}})
    assert error == {"code": -32602, "message": "Resource not found", "data": {"uri": "test://x"}}


def test_undefined_reserved_codes_are_not_re_emitted() -> None:
    error = error_object({"code": -32042, "message": "URL elicitation required", "data": {"elicitations": []}})
    assert error["code"] == -32603
    assert "-32042" in error["message"]


def test_ordinary_codes_pass_through() -> None:
    for code in (-32602, -32603, -32000, -32601, 42):
        assert error_object({"code": code, "message": "m"}) == {"code": code, "message": "m"}


def test_malformed_error_objects_become_internal_errors() -> None:
    assert error_object({"message": "no code"})["code"] == -32603
    assert error_object({"code": -32602})["message"] == "Upstream error"


def test_server_capabilities_translate_the_legacy_shape() -> None:
    """The legacy tasks block goes, the extension is advertised, flags stay booleans."""
    legacy = {
        "tools": {"listChanged": True},
        "prompts": {"listChanged": False},
        "resources": {"subscribe": True, "listChanged": "yes"},
        "logging": {},
        "tasks": {"requests": {"tools": {"call": {}}}},
    }
    assert server_capabilities(legacy) == {
        "logging": {},
        "prompts": {},
        "resources": {"subscribe": True},
        "tools": {"listChanged": True},
        "extensions": {"io.modelcontextprotocol/tasks": {}},
    }


def test_honoured_filter_keeps_only_what_the_upstream_can_deliver() -> None:
    capabilities = {"tools": {"listChanged": True}, "prompts": {}, "resources": {"subscribe": True}}
    wanted = {
        "toolsListChanged": True,
        "promptsListChanged": True,
        "resourcesListChanged": True,
        "resourceSubscriptions": ["a", "b", "a"],
    }
    assert honoured_filter(wanted, capabilities) == {"toolsListChanged": True, "resourceSubscriptions": ["a", "b"]}
    assert honoured_filter({"toolsListChanged": False}, capabilities) == {}
    assert honoured_filter({"resourceSubscriptions": ["a"]}, {"resources": {}}) == {}


def test_listen_notifications_are_filtered_and_tagged() -> None:
    honoured = {"toolsListChanged": True, "resourceSubscriptions": ["test://a"]}
    tools = {"jsonrpc": "2.0", "method": "notifications/tools/list_changed"}
    assert listen_notification(tools, honoured, 7) == {
        "jsonrpc": "2.0",
        "method": "notifications/tools/list_changed",
        "params": {"_meta": {"io.modelcontextprotocol/subscriptionId": 7}},
    }
    prompts = {"jsonrpc": "2.0", "method": "notifications/prompts/list_changed"}
    assert listen_notification(prompts, honoured, 7) is None
    updated = {"jsonrpc": "2.0", "method": "notifications/resources/updated", "params": {"uri": "test://a"}}
    relayed = listen_notification(updated, honoured, "s")
    assert relayed is not None
    assert relayed["params"] == {"uri": "test://a", "_meta": {"io.modelcontextprotocol/subscriptionId": "s"}}
    other = {"jsonrpc": "2.0", "method": "notifications/resources/updated", "params": {"uri": "test://b"}}
    assert listen_notification(other, honoured, 7) is None
    assert listen_notification({"jsonrpc": "2.0", "method": "notifications/message"}, honoured, 7) is None


def test_discover_result_is_synthesized_from_initialize() -> None:
    """`server/discover`: versions the proxy serves, instructions, serverInfo in `_meta` (no top-level
    serverInfo), and the required ttlMs and cacheScope."""
    result = discover_result(
        {
            "protocolVersion": "2025-11-25",
            "capabilities": {"prompts": {}},
            "serverInfo": SERVER_INFO,
            "instructions": "hi",
        },
        CACHE,
    )
    assert result["resultType"] == "complete"
    assert result["supportedVersions"] == ["2026-07-28"]
    assert result["instructions"] == "hi"
    assert result["_meta"] == {"io.modelcontextprotocol/serverInfo": SERVER_INFO}
    assert (result["ttlMs"], result["cacheScope"]) == CACHE
    assert "serverInfo" not in result


def test_progress_is_relayed_only_with_a_progress_token() -> None:
    """Progress is request-scoped: relayed only when the client sent a progressToken, re-tagged with it."""
    note: dict[str, Any] = {
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": {"progressToken": 3, "progress": 1},
    }
    assert relay_notification(note, None, None) is None
    relayed = relay_notification(note, "client-token", None)
    assert relayed is not None
    assert relayed["params"]["progressToken"] == "client-token"
    assert note["params"]["progressToken"] == 3  # the upstream's message is not changed in place


def test_log_messages_are_relayed_only_at_or_above_the_requested_level() -> None:
    def note(level: str) -> dict[str, Any]:
        return {"jsonrpc": "2.0", "method": "notifications/message", "params": {"level": level, "data": "x"}}

    assert relay_notification(note("error"), None, None) is None
    assert relay_notification(note("info"), None, "warning") is None
    assert relay_notification(note("warning"), None, "warning") is not None
    assert relay_notification(note("emergency"), None, "debug") is not None
    assert relay_notification(note("bogus"), None, "debug") is None


def test_other_notifications_stay_behind() -> None:
    for method in ("notifications/tools/list_changed", "notifications/resources/updated", "notifications/tasks/status"):
        assert relay_notification({"jsonrpc": "2.0", "method": method, "params": {}}, "t", "debug") is None


def test_required_capability_per_input_method() -> None:
    assert required_capability("sampling/createMessage", {}) == {"sampling": {}}
    assert required_capability("roots/list", None) == {"roots": {}}
    assert required_capability("elicitation/create", {"message": "x"}) == {"elicitation": {}}
    assert required_capability("elicitation/create", {"mode": "url"}) == {"elicitation": {"url": {}}}


TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
OTHER_TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_trace_headers_come_parsed_from_the_http_headers_else_from_meta() -> None:
    """W3C Trace Context: a value that does not parse is dropped, never forwarded; a tracestate travels with
    the traceparent it belongs to."""
    headers = CIMultiDict({"TraceParent": TRACEPARENT, "tracestate": "rojo=1"})
    meta = {"traceparent": OTHER_TRACEPARENT, "tracestate": "congo=2", "baggage": "user=alice"}
    assert trace_headers(meta, headers) == {"traceparent": TRACEPARENT, "tracestate": "rojo=1", "baggage": "user=alice"}
    broken = CIMultiDict({"traceparent": TRACEPARENT + "x", "tracestate": "rojo=1"})
    assert trace_headers(meta, broken) == {
        "traceparent": OTHER_TRACEPARENT,
        "tracestate": "congo=2",
        "baggage": "user=alice",
    }
    assert trace_headers({}, CIMultiDict()) == {}


def test_trace_context_with_a_line_break_never_becomes_a_header() -> None:
    injected = {
        "traceparent": TRACEPARENT + "\r\nX-Injected: yes",
        "tracestate": "rojo=1\nX-Injected: yes",
        "baggage": "a=1\r\n\r\nPOST /mcp HTTP/1.1",
    }
    assert trace_headers(injected, CIMultiDict()) == {}
    assert trace_headers({}, CIMultiDict({"baggage": "a=1\x00"})) == {}


def test_the_meta_forwarded_upstream_keeps_only_trace_context_that_parses() -> None:
    params: dict[str, Any] = {
        "name": "echo",
        "_meta": {
            "io.modelcontextprotocol/protocolVersion": "2026-07-28",
            "traceparent": TRACEPARENT + "\r\nX-Injected: yes",
            "tracestate": "rojo=1",
            "baggage": " user=alice ",
            "progressToken": 7,
        },
    }
    assert upstream_params(params) == {"name": "echo", "_meta": {"progressToken": 7, "baggage": "user=alice"}}
    params["_meta"]["traceparent"] = TRACEPARENT
    assert upstream_params(params)["_meta"] == {
        "progressToken": 7,
        "traceparent": TRACEPARENT,
        "tracestate": "rojo=1",
        "baggage": "user=alice",
    }
