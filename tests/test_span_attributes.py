"""What a span says about a request, worked out without a tracer: SERVER and CLIENT span names and
attributes, what a relayed request's CLIENT span copies, the error type an answer carries."""

from __future__ import annotations

from typing import Any

from proxy.observe.span_attributes import (
    NO_REQUEST,
    TASK_ID,
    client_request,
    reply_error_type,
    server_request,
)


def test_a_tool_call_is_named_after_its_tool_and_keeps_no_argument() -> None:
    params: dict[str, Any] = {
        "name": "add",
        "arguments": {"a": 1},
        "_meta": {"io.modelcontextprotocol/protocolVersion": "v"},
    }
    message = {"jsonrpc": "2.0", "id": 7, "method": "tools/call", "params": params}
    request = server_request(
        {}, message, "tools/call", params, params["_meta"], era="modern", http_method="POST", peer="10.0.0.1"
    )
    assert request.name == "tools/call add"
    assert request.attributes == {
        "network.transport": "tcp",
        "network.protocol.name": "http",
        "mcp.era": "modern",
        "client.address": "10.0.0.1",
        "mcp.method.name": "tools/call",
        "gen_ai.tool.name": "add",
        "gen_ai.operation.name": "execute_tool",
        "jsonrpc.request.id": "7",
        "mcp.protocol.version": "v",
    }


def test_a_task_read_carries_the_task_id_and_a_legacy_request_its_session() -> None:
    params = {"taskId": "t-1"}
    headers = {"MCP-Protocol-Version": "2025-06-18", "Mcp-Session-Id": "s-1"}
    request = server_request(
        headers,
        {"method": "tasks/get", "params": params},
        "tasks/get",
        params,
        {},
        era="legacy",
        http_method="POST",
        peer=None,
    )
    assert request.name == "tasks/get"
    assert request.attributes[TASK_ID] == "t-1"
    assert request.attributes["mcp.session.id"] == "s-1"
    assert request.attributes["mcp.protocol.version"] == "2025-06-18"
    assert "client.address" not in request.attributes


def test_a_relayed_request_copies_only_what_names_it() -> None:
    params = {"name": "greet"}
    server = server_request(
        {"Mcp-Session-Id": "s"}, {"id": 1}, "prompts/get", params, {}, era="legacy", http_method="POST", peer="p"
    ).copied()
    assert dict(server.attributes) == {"mcp.method.name": "prompts/get", "gen_ai.prompt.name": "greet"}
    name, attributes = client_request(None, None, "tcp", None, server)
    assert name == "prompts/get greet"
    assert attributes == {
        "network.transport": "tcp",
        "network.protocol.name": "http",
        "mcp.method.name": "prompts/get",
        "gen_ai.prompt.name": "greet",
    }
    unread = server_request({}, {}, None, {}, {}, era="legacy", http_method="GET", peer=None).copied()
    assert client_request(None, None, "tcp", None, unread) == (
        "GET",
        {"network.transport": "tcp", "network.protocol.name": "http", "http.request.method": "GET"},
    )


def test_an_upstream_request_keeps_its_started_name_unless_it_has_a_target() -> None:
    assert client_request("ping", None, "pipe", "v", NO_REQUEST) == (
        None,
        {"network.transport": "pipe", "mcp.method.name": "ping", "mcp.protocol.version": "v"},
    )
    name, attributes = client_request("tools/call", {"name": "add"}, "pipe", None, NO_REQUEST)
    assert name == "tools/call add"
    assert attributes["gen_ai.tool.name"] == "add"


def test_the_error_type_of_an_answer() -> None:
    assert reply_error_type({"error": {"code": -32602}}) == "-32602"
    assert reply_error_type({"result": {"isError": True}}) == "tool_error"
    assert reply_error_type({"result": {"isError": False}}) is None
    assert reply_error_type({"result": {}}) is None
