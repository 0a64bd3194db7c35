"""End to end: a 2026-07-28 client → the proxy (real HTTP) → a real legacy upstream (mcp 1.x, own process).

Every message the proxy sends is validated against tests/schema/mcp-2026-07-28.schema.json.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.edge._app_keys import POOL
from proxy.principals import Identity
from tests.support.clients import post_and_leave
from tests.support.processes import Upstream
from tests.support.schemas import ModernSchema
from tests.support.waiting import until
from tests.support.wire import modern_body, modern_headers, read_messages

Client = TestClient[web.Request, web.Application]

NAME_PARAM = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}


async def rpc(
    client: Client,
    schema: ModernSchema,
    method: str,
    params: dict[str, Any] | None = None,
    *,
    request_id: int | str = 1,
    headers: dict[str, str] | None = None,
    **meta: Any,
) -> tuple[int, str, list[dict[str, Any]]]:
    """POST one modern request; returns (HTTP status, content type, every message), all schema-checked."""
    field = NAME_PARAM.get(method)
    name = (params or {}).get(field) if field else None
    response = await client.post(
        "/mcp",
        json=modern_body(method, params, request_id=request_id, **meta),
        headers={**modern_headers(method, name), **(headers or {})},
    )
    messages = await read_messages(response)
    schema.check_all(messages, method)
    return response.status, response.headers.get("Content-Type", ""), messages


async def call_tool(
    client: Client, schema: ModernSchema, tool: str, arguments: dict[str, Any] | None = None, **meta: Any
) -> tuple[int, str, list[dict[str, Any]]]:
    return await rpc(client, schema, "tools/call", {"name": tool, "arguments": arguments or {}}, **meta)


ASKABLE: dict[str, Any] = {"elicitation": {}}  # a client that could be asked: its calls get sessions of their own


def text_of(message: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in message["result"]["content"])


# --- discovery and forwarding -------------------------------------------------------------------------


async def test_discover_is_synthesized_from_the_upstream(proxy: Client, modern_schema: ModernSchema) -> None:
    """The proxy serves `server/discover` itself: the versions it serves, the upstream's capabilities without
    the legacy `tasks` block, the Tasks extension advertised, and the required ttlMs and cacheScope."""
    status, _, [message] = await rpc(proxy, modern_schema, "server/discover")
    assert status == 200
    result = message["result"]
    assert result["supportedVersions"] == ["2026-07-28"]
    assert result["capabilities"]["extensions"] == {"io.modelcontextprotocol/tasks": {}}
    assert "tasks" not in result["capabilities"]
    # listChanged/subscribe are kept: the proxy delivers them on subscriptions/listen streams.
    assert result["capabilities"]["resources"] == {"subscribe": True, "listChanged": True}
    assert result["capabilities"]["tools"] == {"listChanged": True}
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "legacy-fixture-upstream"
    assert result["ttlMs"] == 60_000
    assert result["cacheScope"] == "private"


async def test_tools_list_is_translated_and_stable(proxy: Client, modern_schema: ModernSchema) -> None:
    """`tools/list` gains resultType and cacheScope, and lists the same tools in the same order each time."""
    _, _, [first] = await rpc(proxy, modern_schema, "tools/list")
    _, _, [second] = await rpc(proxy, modern_schema, "tools/list", request_id=2)
    names = [tool["name"] for tool in first["result"]["tools"]]
    assert {"greet", "sleep", "ask_name", "test_simple_text"} <= set(names)
    assert names == [tool["name"] for tool in second["result"]["tools"]]
    assert first["result"]["resultType"] == "complete"
    assert first["result"]["cacheScope"] == "private"


async def test_sync_tool_call(proxy: Client, modern_schema: ModernSchema) -> None:
    status, content_type, [message] = await call_tool(proxy, modern_schema, "greet", {"name": "Ada"}, request_id=7)
    assert status == 200
    assert content_type.startswith("application/json")
    assert message["id"] == 7
    assert text_of(message) == "Hello, Ada!"
    assert message["result"]["resultType"] == "complete"


async def test_string_request_ids_are_echoed(proxy: Client, modern_schema: ModernSchema) -> None:
    _, _, [message] = await rpc(
        proxy, modern_schema, "tools/call", {"name": "echo", "arguments": {"text": "x"}}, request_id="req-9"
    )
    assert message["id"] == "req-9"


async def test_tool_error_result_is_data(proxy: Client, modern_schema: ModernSchema) -> None:
    _, _, [message] = await call_tool(proxy, modern_schema, "tool_error", {"message": "boom"})
    assert message["result"]["isError"] is True
    assert text_of(message) == "boom"


async def test_upstream_jsonrpc_error_passes_through(proxy: Client, modern_schema: ModernSchema) -> None:
    """Upstream JSON-RPC errors are data: same code and message, HTTP 200 (the spec leaves their HTTP status
    open)."""
    status, _, [message] = await call_tool(proxy, modern_schema, "raise_error", {"message": "nope", "code": -32000})
    assert status == 200
    assert message["error"]["code"] == -32000
    assert message["error"]["message"] == "nope"


async def test_upstream_method_not_found_is_http_404(proxy: Client, modern_schema: ModernSchema) -> None:
    """What the upstream does not implement, the proxy does not either: -32601 goes with HTTP 404."""
    status, _, [message] = await call_tool(proxy, modern_schema, "raise_error", {"message": "no such", "code": -32601})
    assert (status, message["error"]["code"]) == (404, -32601)


async def test_retired_upstream_codes_are_not_re_emitted(proxy: Client, modern_schema: ModernSchema) -> None:
    """-32042 (URL elicitation required) does not exist in 2026-07-28."""
    _, _, [message] = await call_tool(proxy, modern_schema, "raise_error", {"message": "url", "code": -32042})
    assert message["error"]["code"] == -32603


async def test_legacy_resource_not_found_becomes_invalid_params(proxy: Client, modern_schema: ModernSchema) -> None:
    """The legacy resource-not-found code -32002 becomes -32602 in 2026-07-28."""
    _, _, [message] = await rpc(proxy, modern_schema, "resources/read", {"uri": "test://does-not-exist"})
    assert message["error"]["code"] == -32602


async def test_resources_prompts_and_completion(proxy: Client, modern_schema: ModernSchema) -> None:
    _, _, [resources] = await rpc(proxy, modern_schema, "resources/list")
    assert any(item["uri"] == "test://static-text" for item in resources["result"]["resources"])
    _, _, [read] = await rpc(proxy, modern_schema, "resources/read", {"uri": "test://static-text"})
    assert read["result"]["contents"][0]["uri"] == "test://static-text"
    assert "ttlMs" in read["result"]
    _, _, [templates] = await rpc(proxy, modern_schema, "resources/templates/list")
    assert templates["result"]["resourceTemplates"]
    _, _, [prompts] = await rpc(proxy, modern_schema, "prompts/list")
    assert any(item["name"] == "test_simple_prompt" for item in prompts["result"]["prompts"])
    _, _, [prompt] = await rpc(proxy, modern_schema, "prompts/get", {"name": "test_simple_prompt"})
    assert prompt["result"]["messages"]
    _, _, [completion] = await rpc(
        proxy,
        modern_schema,
        "completion/complete",
        {
            "ref": {"type": "ref/prompt", "name": "test_prompt_with_arguments"},
            "argument": {"name": "arg1", "value": ""},
        },
    )
    assert "values" in completion["result"]["completion"]


# --- notifications -------------------------------------------------------------------------------------


async def test_progress_streams_only_when_the_client_asked(proxy: Client, modern_schema: ModernSchema) -> None:
    """With a progressToken the answer is an SSE stream of progress, then the result; without, JSON."""
    _, content_type, messages = await call_tool(proxy, modern_schema, "sleep", {"seconds": 0.35}, progressToken="tok")
    assert content_type.startswith("text/event-stream")
    progress = [m for m in messages if m.get("method") == "notifications/progress"]
    assert progress
    assert all(m["params"]["progressToken"] == "tok" for m in progress)
    assert text_of(messages[-1]) == "slept 0.35"
    _, content_type, messages = await call_tool(proxy, modern_schema, "sleep", {"seconds": 0.35})
    assert content_type.startswith("application/json")
    assert len(messages) == 1


async def test_log_messages_need_a_log_level(proxy: Client, modern_schema: ModernSchema) -> None:
    """No notifications/message without io.modelcontextprotocol/logLevel; filtered by level with it."""
    _, _, messages = await call_tool(proxy, modern_schema, "log", {"level": "warning", "message": "w"})
    assert [m for m in messages if "method" in m] == []
    kwargs = {"io.modelcontextprotocol/logLevel": "error"}
    _, _, messages = await call_tool(proxy, modern_schema, "log", {"level": "warning", "message": "w"}, **kwargs)
    assert [m for m in messages if "method" in m] == []
    kwargs = {"io.modelcontextprotocol/logLevel": "info"}
    _, _, messages = await call_tool(proxy, modern_schema, "log", {"level": "warning", "message": "w"}, **kwargs)
    logs = [m for m in messages if m.get("method") == "notifications/message"]
    assert [m["params"]["data"] for m in logs] == ["w"]


# --- server→client requests: never on the client's stream -----------------------------------------------


@pytest.mark.parametrize(
    ("tool", "capability"),
    [("sample", "sampling"), ("list_roots", "roots"), ("ask_name", "elicitation")],
)
async def test_undeclared_input_capability_is_minus_32021(
    proxy: Client, modern_schema: ModernSchema, tool: str, capability: str
) -> None:
    """No server→client request reaches the client; it is told what it would need (-32021, HTTP 400)."""
    status, content_type, messages = await call_tool(
        proxy, modern_schema, tool, {"prompt": "hi"} if tool == "sample" else {}
    )
    assert status == 400
    assert content_type.startswith("application/json")
    [message] = messages
    assert message["error"]["code"] == -32021
    assert message["error"]["data"]["requiredCapabilities"] == {capability: {}}
    # The upstream was answered and the call cancelled: the proxy still serves the next request at once.
    _, _, [again] = await call_tool(proxy, modern_schema, "greet", {"name": "x"})
    assert text_of(again) == "Hello, x!"


# --- cancellation: a closed client stream cancels; the upstream gets notifications/cancelled ----------


async def cancelled_upstream_ids(proxy: Client, schema: ModernSchema) -> list[Any]:
    _, _, [message] = await call_tool(proxy, schema, "cancelled_requests")
    ids: list[Any] = json.loads(text_of(message))
    return ids


async def test_client_disconnect_cancels_the_upstream_call(
    proxy: Client, upstream: Upstream, modern_schema: ModernSchema
) -> None:
    before = await cancelled_upstream_ids(proxy, modern_schema)
    await post_and_leave(
        proxy,
        modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 30}}),
        modern_headers("tools/call", "sleep"),
        upstream.url,
    )
    await wait_for_new_cancellation(proxy, modern_schema, before)


async def test_closing_a_progress_stream_cancels_the_upstream_call(proxy: Client, modern_schema: ModernSchema) -> None:
    """On the SSE path: the client reads the first progress event, then closes the stream."""
    before = await cancelled_upstream_ids(proxy, modern_schema)
    response = await proxy.post(
        "/mcp",
        json=modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 30}}, progressToken="p"),
        headers=modern_headers("tools/call", "sleep"),
    )
    assert response.headers["Content-Type"].startswith("text/event-stream")
    first = await asyncio.wait_for(response.content.readuntil(b"\n\n"), 10)
    assert b"notifications/progress" in first
    response.close()
    await wait_for_new_cancellation(proxy, modern_schema, before)


async def wait_for_new_cancellation(proxy: Client, schema: ModernSchema, before: list[Any]) -> None:

    async def seen() -> bool:
        return len(await cancelled_upstream_ids(proxy, schema)) > len(before)

    await until(seen, "the upstream never saw notifications/cancelled")


# --- upstream sessions --------------------------------------------------------------------------------


@pytest.mark.faults  # the upstream forgets the session: one of the fault cases (test_faults.py has the others)
async def test_expired_upstream_session_is_reinitialized(
    proxy: Client, modern_schema: ModernSchema, upstream: Upstream
) -> None:
    """A 404 for the session means re-initialize and retry, invisibly to the client: for the shared session
    (lists) and for a session lent to calls."""
    await call_tool(proxy, modern_schema, "greet", {"name": "a"}, capabilities=ASKABLE)  # a session of its own
    pool = proxy.app[POOL]
    [lent] = pool.spare_sessions(None)
    shared = pool.session(None)
    forgotten = {}
    for session in (shared, lent):
        assert session.session_id is not None
        forgotten[session] = session.session_id
        response = await proxy.session.delete(
            upstream.url,
            headers={"Mcp-Session-Id": session.session_id, "MCP-Protocol-Version": session.protocol_version},
        )
        assert response.status in (200, 204)
    _, _, [listed] = await rpc(proxy, modern_schema, "tools/list")
    assert listed["result"]["tools"]
    _, _, [message] = await call_tool(proxy, modern_schema, "greet", {"name": "b"}, capabilities=ASKABLE)
    assert text_of(message) == "Hello, b!"
    assert pool.spare_sessions(None) == [lent]  # the same session object, re-initialized
    for session, old_id in forgotten.items():
        assert session.session_id not in (None, old_id)


async def test_sessions_are_kept_per_principal(proxy: Client, modern_schema: ModernSchema) -> None:
    await rpc(proxy, modern_schema, "tools/list", headers={"Authorization": "Bearer one"})
    await rpc(proxy, modern_schema, "tools/list", headers={"Authorization": "Bearer two"})
    client = proxy.app[POOL]
    one, two = client.session(Identity("Bearer one")), client.session(Identity("Bearer two"))
    assert one is not two
    assert one.session_id is not None
    assert two.session_id is not None
    assert one.session_id != two.session_id


async def test_upstream_down_is_a_gateway_error(make_proxy: Callable[..., Any], modern_schema: ModernSchema) -> None:
    client: Client = await make_proxy("http://127.0.0.1:9/mcp")
    status, _, [message] = await call_tool(client, modern_schema, "greet", {"name": "x"})
    assert status == 502
    assert message["error"]["code"] == -32603
    assert message["id"] == 1


async def test_upstream_ping_is_answered_by_the_proxy(proxy: Client, modern_schema: ModernSchema) -> None:
    """The upstream's ping never reaches the modern client; the proxy answers it and the call goes on."""
    _, _, messages = await call_tool(proxy, modern_schema, "ping_client", progressToken="p")
    assert [m for m in messages if "method" in m] == []
    assert text_of(messages[-1]) == "pong answered"


async def test_principal_and_trace_context_travel_upstream(proxy: Client, modern_schema: ModernSchema) -> None:
    trace = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    _, _, [message] = await rpc(
        proxy,
        modern_schema,
        "tools/call",
        {"name": "whoami", "arguments": {}},
        headers={"Authorization": "Bearer abc", "traceparent": trace},
    )
    assert json.loads(text_of(message)) == {"authorization": "Bearer abc", "traceparent": trace}
    _, _, [message] = await call_tool(proxy, modern_schema, "whoami", traceparent=trace)
    assert json.loads(text_of(message)) == {"authorization": None, "traceparent": trace}


@pytest.fixture(scope="module", params=["--stateless", "--json-response"])
def variant_upstream(request: pytest.FixtureRequest) -> Iterator[Upstream]:
    server = Upstream(request.param)
    server.start()
    yield server
    server.stop()


async def test_upstream_variants(
    make_proxy: Callable[..., Any], variant_upstream: Upstream, modern_schema: ModernSchema
) -> None:
    """A stateless upstream (no Mcp-Session-Id) and one that answers application/json instead of SSE."""
    client: Client = await make_proxy(variant_upstream.url)
    _, _, [message] = await call_tool(client, modern_schema, "greet", {"name": "v"})
    assert text_of(message) == "Hello, v!"
    _, _, [listed] = await rpc(client, modern_schema, "tools/list")
    assert listed["result"]["tools"]
    stateless = "--stateless" in variant_upstream.flags
    assert (client.app[POOL].session(None).session_id is None) == stateless


async def test_x_mcp_header_params_are_validated(proxy: Client, modern_schema: ModernSchema) -> None:
    """The proxy processes the body, so it checks Mcp-Param-* against the upstream tool's annotations."""
    arguments = {"region": "eu-west", "count": 3}
    ok_headers = {"Mcp-Param-Region": "eu-west", "Mcp-Param-Count": "3"}
    status, _, [message] = await rpc(
        proxy, modern_schema, "tools/call", {"name": "header_params", "arguments": arguments}, headers=ok_headers
    )
    assert status == 200
    assert json.loads(text_of(message)) == {"region": "eu-west", "count": 3, "verbose": False}
    for headers in ({"Mcp-Param-Region": "eu-west"}, {**ok_headers, "Mcp-Param-Region": "us-east"}):
        status, _, [message] = await rpc(
            proxy, modern_schema, "tools/call", {"name": "header_params", "arguments": arguments}, headers=headers
        )
        assert (status, message["error"]["code"]) == (400, -32020)


async def test_upstream_stream_closed_early_is_resumed(proxy: Client, modern_schema: ModernSchema) -> None:
    """The upstream closes the call's SSE stream (2025-11-25 transports: SEP-1699 polling); the proxy resumes it with
    GET + Last-Event-ID and the modern client just gets the result."""
    _, _, [message] = await call_tool(proxy, modern_schema, "test_reconnection")
    assert "Reconnection test completed successfully" in text_of(message)


async def test_concurrent_calls_reuse_the_sessions_lent_to_earlier_calls(
    proxy: Client, modern_schema: ModernSchema
) -> None:
    """Each running call whose client could be asked has an upstream session of its own; once calls end, their
    sessions are lent again instead of new ones being initialized."""

    async def round_of(count: int) -> set[str | None]:
        results = await asyncio.gather(
            *(
                call_tool(proxy, modern_schema, "echo", {"text": f"n{index}"}, capabilities=ASKABLE)
                for index in range(count)
            )
        )
        assert sorted(text_of(message) for _, _, [message] in results) == sorted(f"n{index}" for index in range(count))
        return {session.session_id for session in proxy.app[POOL].spare_sessions(None)}

    first = await round_of(20)
    assert 1 <= len(first) <= 20
    second = await round_of(len(first))
    assert second == first  # no session was initialized for the second round


async def test_configured_upstream_headers_win(
    make_proxy: Callable[..., Any], upstream: Upstream, modern_schema: ModernSchema
) -> None:
    client: Client = await make_proxy(upstream.url, upstream={"headers": {"Authorization": "Bearer static"}})
    _, _, [message] = await rpc(
        client,
        modern_schema,
        "tools/call",
        {"name": "whoami", "arguments": {}},
        headers={"Authorization": "Bearer client"},
    )
    assert json.loads(text_of(message))["authorization"] == "Bearer static"
