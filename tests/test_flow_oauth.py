"""End to end: a legacy server that requires OAuth (the mcp 1.x SDK's own resource-server support: a token
verifier and AuthSettings) behind the proxy, in both eras. Tokens are JWTs minted here with a local key; the
server reads its key set from a file. The proxy's public URL is the server's configured resource URL.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from yarl import URL

from proxy.edge._app_keys import POOL
from proxy.edge.app import create_app
from proxy.principals import Identity
from tests.support.oauth import ISSUER, Issuer
from tests.support.processes import Upstream, free_port, key_file, proxy_config
from tests.support.waiting import until
from tests.support.wire import modern_body, modern_headers, read_messages

Client = TestClient[web.Request, web.Application]
TASKS: dict[str, Any] = {"extensions": {"io.modelcontextprotocol/tasks": {}}}


@pytest.fixture(scope="module")
def oauth_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("oauth")


@pytest.fixture(scope="module")
def issuer(oauth_dir: Path) -> Issuer:
    return Issuer(oauth_dir)


@pytest.fixture(scope="module")
def proxy_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def oauth_upstream(issuer: Issuer, proxy_port: int) -> Iterator[Upstream]:
    """The resource server: its resource URL is the proxy's public URL, as in a sidecar deployment."""
    server = Upstream("--auth", str(issuer.jwks_path), ISSUER, f"http://127.0.0.1:{proxy_port}/mcp")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def oauth_proxy(oauth_upstream: Upstream, proxy_port: int, tmp_path: Path) -> AsyncIterator[Client]:
    config = proxy_config(
        oauth_upstream.url,
        tmp_path,
        security={"key_file": key_file(tmp_path)},
        tasks={"tools": {"sleep": {"mode": "required"}}},
    )
    client = TestClient(TestServer(create_app(config), host="127.0.0.1", port=proxy_port))
    await client.start_server()
    yield client
    await client.close()


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def modern(
    client: Client,
    method: str,
    params: dict[str, Any] | None = None,
    *,
    name: str | None = None,
    auth: str | None = None,
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One modern request, with `auth` as its Bearer token when given."""
    body = modern_body(method, params, capabilities=TASKS, request_id=7)
    headers = modern_headers(method, name, **({"Authorization": f"Bearer {auth}"} if auth is not None else {}))
    async with client.post("/mcp", json=body, headers=headers) as response:
        messages = await read_messages(response)
        return response.status, dict(response.headers), messages[-1]


COVERED: list[tuple[str, dict[str, Any] | None, str | None]] = [
    ("server/discover", None, None),
    ("tools/list", None, None),
    ("prompts/list", None, None),
    ("resources/list", None, None),
    ("tools/call", {"name": "test_simple_text", "arguments": {}}, "test_simple_text"),
    ("prompts/get", {"name": "test_simple_prompt"}, "test_simple_prompt"),
    ("resources/read", {"uri": "test://static-text"}, "test://static-text"),
    (
        "completion/complete",
        {
            "ref": {"type": "ref/prompt", "name": "test_prompt_with_arguments"},
            "argument": {"name": "arg1", "value": ""},
        },
        None,
    ),
    ("subscriptions/listen", {"notifications": {"toolsListChanged": True}}, None),
    ("tools/call", {"name": "sleep", "arguments": {"seconds": 0.1}}, "sleep"),  # a task for this tool
]


COVERED_IDS = [f"{method} {name}" if name else method for method, _, name in COVERED]


@pytest.mark.parametrize(("method", "params", "name"), COVERED, ids=COVERED_IDS)
async def test_a_modern_request_without_a_token_gets_the_servers_401_and_challenge(
    oauth_proxy: Client, method: str, params: dict[str, Any] | None, name: str | None
) -> None:
    status, headers, message = await modern(oauth_proxy, method, params, name=name)
    assert status == 401
    challenge = headers["WWW-Authenticate"]
    assert challenge.startswith("Bearer")
    assert "/.well-known/oauth-protected-resource/mcp" in challenge
    assert message["id"] == 7
    assert message["error"]["data"] == {"upstreamStatus": 401}


async def test_a_refused_token_is_401_and_a_token_without_the_scope_is_403_insufficient_scope(
    oauth_proxy: Client, issuer: Issuer
) -> None:
    status, headers, message = await modern(oauth_proxy, "tools/list", auth="not-a-token-the-server-knows")
    assert status == 401
    assert 'error="invalid_token"' in headers["WWW-Authenticate"]
    assert "error" in message
    expired = issuer.token(lifetime=-120)
    status, _, _ = await modern(oauth_proxy, "tools/list", auth=expired)
    assert status == 401
    status, headers, message = await modern(oauth_proxy, "tools/list", auth=issuer.token(scope="read"))
    assert status == 403
    assert 'error="insufficient_scope"' in headers["WWW-Authenticate"]
    assert message["error"]["data"] == {"upstreamStatus": 403}


async def test_an_accepted_token_is_served_and_a_caller_without_one_still_gets_401_right_after(
    oauth_proxy: Client, issuer: Issuer
) -> None:
    token = issuer.token()
    status, _, message = await modern(oauth_proxy, "server/discover", auth=token)
    assert status == 200, message
    assert message["result"]["capabilities"]["tools"] is not None
    status, _, message = await modern(oauth_proxy, "tools/list", auth=token)
    assert status == 200
    assert any(tool["name"] == "test_simple_text" for tool in message["result"]["tools"])
    call = {"name": "test_simple_text", "arguments": {}}
    status, _, message = await modern(oauth_proxy, "tools/call", call, name="test_simple_text", auth=token)
    assert status == 200
    assert message["result"]["content"][0]["text"].startswith("This is a simple text")
    for method, params, name in COVERED[:5]:
        status, _, _ = await modern(oauth_proxy, method, params, name=name)
        assert status == 401, method
        status, _, _ = await modern(oauth_proxy, method, params, name=name, auth="forged")
        assert status == 401, method


async def test_a_task_runs_under_the_callers_token_and_its_owner_reads_it(oauth_proxy: Client, issuer: Issuer) -> None:
    token = issuer.token("bob")
    params = {"name": "sleep", "arguments": {"seconds": 0.1}, "task": {}}
    status, _, created = await modern(oauth_proxy, "tools/call", params, name="sleep", auth=token)
    assert status == 200, created
    assert created["result"]["resultType"] == "task"
    task_id = created["result"]["taskId"]
    status, _, got = await modern(oauth_proxy, "tasks/get", {"taskId": task_id}, auth=token)
    assert status == 200
    assert got["result"]["taskId"] == task_id
    status, _, other = await modern(oauth_proxy, "tasks/get", {"taskId": task_id}, auth=issuer.token("eve"))
    assert other["error"]["code"] == -32602  # another caller's task is not found


async def test_the_metadata_and_the_embedded_authorization_servers_endpoints_are_relayed_for_both_eras(
    oauth_proxy: Client, proxy_port: int
) -> None:
    """By default the relay serves what an OAuth client needs: the server's protected-resource metadata, its
    authorization server's metadata, and the endpoints that metadata names on the server's origin (learned,
    since this upstream requires credentials). Nothing else the server serves is exposed."""
    async with oauth_proxy.get("/.well-known/oauth-protected-resource/mcp") as response:
        assert response.status == 200
        metadata = await response.json()
    assert metadata["resource"] == f"http://127.0.0.1:{proxy_port}/mcp"
    assert metadata["authorization_servers"] == [ISSUER + "/"]
    async with oauth_proxy.get("/.well-known/oauth-authorization-server") as response:
        assert response.status == 200
        assert (await response.json())["token_endpoint"] == f"http://127.0.0.1:{proxy_port}/oauth/token"
    form = b"grant_type=client_credentials"
    target = URL("/oauth/token?x=1&y=%2F", encoded=True)
    async with oauth_proxy.post(target, data=form, headers={"X-Forwarded-For": "10.0.0.1"}) as response:
        assert response.status == 200
        assert response.headers["X-Echo"] == "yes"
        echoed = await response.json()
    assert echoed["method"] == "POST"
    assert echoed["path"] == "/oauth/token"
    assert echoed["query"] == "x=1&y=%2F"
    assert echoed["body"] == "grant_type=client_credentials"
    assert echoed["headers"]["x-forwarded-for"] == "10.0.0.1, 127.0.0.1"
    assert echoed["headers"]["x-forwarded-host"] == f"127.0.0.1:{proxy_port}"
    assert echoed["headers"]["x-forwarded-proto"] == "http"
    for path in ("/oauth/authorize", "/oauth/register"):
        async with oauth_proxy.get(path) as response:
            assert response.headers.get("X-Echo") == "yes", path
    # Any other path of the server is not exposed: not a page, not an endpoint named elsewhere.
    for path in ("/echo", "/userinfo", "/oauth/token/more"):
        async with oauth_proxy.get(path) as response:
            assert response.status == 404, path
            assert response.headers.get("X-Echo") is None
            assert "not relayed" in (await response.json())["message"]
    # A legacy client's initialize without a token gets the server's own 401, whose metadata URL is served.
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
    async with oauth_proxy.post("/mcp", json=initialize, headers=headers) as response:
        assert response.status == 401
        assert "oauth-protected-resource" in response.headers["WWW-Authenticate"]
    # The proxy's own paths stay its own.
    async with oauth_proxy.get("/healthz") as response:
        assert await response.json() == {"status": "ok"}
    async with oauth_proxy.post("/healthz") as response:
        assert response.status == 405


async def test_the_relay_can_be_widened_narrowed_or_turned_off(
    oauth_upstream: Upstream, tmp_path: Path, make_proxy: Any
) -> None:
    everything: Client = await make_proxy(oauth_upstream.url, relay={"prefixes": ["/"]})
    async with everything.get("/echo") as response:
        assert response.status == 200  # `[/]`: every path, as before the default was narrowed
        assert response.headers["X-Echo"] == "yes"
    narrowed: Client = await make_proxy(
        oauth_upstream.url, relay={"prefixes": ["/.well-known/oauth-protected-resource"]}
    )
    async with narrowed.get("/.well-known/oauth-protected-resource/mcp") as response:
        assert response.status == 200
    for path in ("/.well-known/oauth-authorization-server", "/oauth/token", "/echo"):
        async with narrowed.get(path) as response:
            assert response.status == 404, path  # the endpoints follow their metadata: not relayed, not learned
    nothing: Client = await make_proxy(oauth_upstream.url, relay={"prefixes": []})
    for path in ("/.well-known/oauth-protected-resource/mcp", "/oauth/token"):
        async with nothing.get(path) as response:
            assert response.status == 404, path
    off: Client = await make_proxy(oauth_upstream.url, relay={"enabled": False})
    async with off.get("/.well-known/oauth-protected-resource/mcp") as response:
        assert response.status == 404


async def test_no_endpoint_is_learned_for_an_upstream_said_to_need_no_credentials(
    oauth_upstream: Upstream, make_proxy: Any
) -> None:
    client: Client = await make_proxy(oauth_upstream.url, security={"upstream_auth": "none"})
    async with client.get("/oauth/token") as response:
        assert response.status == 404
    async with client.get("/.well-known/oauth-authorization-server") as response:
        assert response.status == 200  # the metadata itself is under the default prefix


async def test_a_stdio_upstream_has_no_origin_to_relay_to(make_proxy: Any, tmp_path: Path) -> None:
    import sys

    client: Client = await make_proxy(
        None, upstream={"url": None, "command": [sys.executable, "-m", "tests.upstream", "--stdio"]}
    )
    async with client.get("/.well-known/oauth-protected-resource/mcp") as response:
        assert response.status == 404
        assert "stdio MCP server" in (await response.json())["message"]


async def test_the_readiness_probe_counts_a_401_as_an_upstream_that_answers(oauth_proxy: Client) -> None:
    async with oauth_proxy.get("/readyz") as response:
        assert response.status == 200, await response.text()


async def test_no_token_reaches_the_logs(oauth_proxy: Client, issuer: Issuer) -> None:
    good, scopeless = issuer.token("carol"), issuer.token("carol", scope="other")
    with structlog.testing.capture_logs() as events:
        for token in (good, scopeless, "opaque-secret-value"):
            for method, params, name in COVERED[:5]:
                await modern(oauth_proxy, method, params, name=name, auth=token)
        async with oauth_proxy.get("/oauth/token", headers=bearer(good)) as response:
            assert response.status == 200
    text = repr(events)
    assert events
    for secret in (good, scopeless, "opaque-secret-value", good.split(".")[2]):
        assert secret not in text


async def test_a_legacy_client_with_an_accepted_token_passes_through(oauth_proxy: Client, issuer: Issuer) -> None:
    initialize = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}},
    }
    headers = {
        "Content-Type": "application/json",
        "Accept": "application/json, text/event-stream",
        "Authorization": f"Bearer {issuer.token('erin')}",
    }
    async with oauth_proxy.post("/mcp", json=initialize, headers=headers) as response:
        assert response.status == 200
        assert response.headers["Mcp-Session-Id"]
        [message] = await read_messages(response)
    assert message["result"]["serverInfo"]["name"] == "legacy-fixture-upstream"


@pytest.mark.parametrize(("mode", "own_session"), [("detect", False), ("none", False), ("required", True)])
async def test_a_server_that_needs_no_credential_keeps_the_shared_discover_cache(
    make_proxy: Any, upstream: Upstream, mode: str, own_session: bool
) -> None:
    """A second caller's server/discover is answered from what the proxy already learned (no session of its
    own), unless the upstream is said to require credentials: then the caller's own session asks it."""
    client: Client = await make_proxy(upstream.url, security={"upstream_auth": mode})
    for token in ("first", "second"):
        status, _, message = await modern(client, "server/discover", auth=token)
        assert status == 200, message
    principals = [session.principal for session in client.app[POOL].sessions()]
    assert (Identity("Bearer second") in principals) is own_session


async def test_a_rerun_whose_stored_credential_expired_fails_saying_so(
    make_proxy: Any, oauth_upstream: Upstream, issuer: Issuer, tmp_path: Path
) -> None:
    sections: dict[str, Any] = {
        "store": {"path": str(tmp_path / "rerun.db")},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": {"tools": {"sleep": {"mode": "required", "on_restart": "rerun"}}},
    }
    lifetime = 3.0
    token = issuer.token("frank", lifetime=lifetime)
    expires = time.time() + lifetime
    first: Client = await make_proxy(oauth_upstream.url, **sections)
    params = {"name": "sleep", "arguments": {"seconds": 30}}
    status, _, created = await modern(first, "tools/call", params, name="sleep", auth=token)
    assert status == 200, created
    task_id = created["result"]["taskId"]
    await first.close()  # the process goes away with the call running
    await asyncio.sleep(max(0.0, expires + 1 - time.time()))  # the token's own lifetime, not a state of the proxy
    second: Client = await make_proxy(oauth_upstream.url, **sections)

    async def settled() -> dict[str, Any] | None:
        status, _, got = await modern(second, "tasks/get", {"taskId": task_id}, auth=token)
        assert status == 200, got
        return got if got["result"]["status"] != "working" else None

    got = await until(settled, "the task left working")
    assert got["result"]["status"] == "failed"
    message = got["result"]["error"]["message"]
    assert "refused the credential" in message
    assert "HTTP 401" in message
    await asyncio.sleep(0.5)
    _, _, again = await modern(second, "tasks/get", {"taskId": task_id}, auth=token)
    assert again["result"]["status"] == "failed"  # no retry loop: it stays failed


async def test_the_proxys_own_paths_are_never_relayed_even_when_switched_off(
    make_proxy: Any, oauth_upstream: Upstream
) -> None:
    """Even with every path relayed: /metrics is not the upstream's, wherever the proxy serves its own."""
    for observability in ({"metrics": False}, {"metrics": True}):
        client: Client = await make_proxy(oauth_upstream.url, relay={"prefixes": ["/"]}, observability=observability)
        async with client.get("/metrics", headers={"Host": "attacker.example"}) as response:
            assert response.status == 404
            assert response.headers.get("X-Echo") is None


async def test_each_caller_has_its_own_tool_catalog_behind_the_param_header_check(
    oauth_proxy: Client, issuer: Issuer
) -> None:
    """The server lists `scoped_report` (with an `x-mcp-header` annotation) only to a token with the reports
    scope. The header check follows the caller's own catalog, whichever caller read the upstream's last."""
    reporter = issuer.token("carol", scope="mcp reports")
    plain = issuer.token("dave")
    call = {"name": "scoped_report", "arguments": {"tenant": "acme"}}
    for _ in range(2):  # each caller again after the other's catalog was read
        status, _, message = await modern(oauth_proxy, "tools/call", call, name="scoped_report", auth=reporter)
        assert status == 400, message
        assert "Mcp-Param-Tenant" in message["error"]["message"]
        status, _, message = await modern(oauth_proxy, "tools/call", call, name="scoped_report", auth=plain)
        assert status == 200, message
        assert message["result"]["content"][0]["text"] == "report for acme"
    headers = {"Authorization": f"Bearer {reporter}", "Mcp-Param-Tenant": "acme"}
    body = modern_body("tools/call", call, capabilities=TASKS, request_id=8)
    async with oauth_proxy.post(
        "/mcp", json=body, headers=modern_headers("tools/call", "scoped_report", **headers)
    ) as r:
        assert r.status == 200
        assert (await read_messages(r))[-1]["result"]["content"][0]["text"] == "report for acme"
    for token, listed in ((reporter, True), (plain, False)):
        status, _, message = await modern(oauth_proxy, "tools/list", auth=token)
        assert status == 200
        assert any(tool["name"] == "scoped_report" for tool in message["result"]["tools"]) is listed


@pytest.fixture(scope="module")
def oauth_task_upstream(issuer: Issuer) -> Iterator[Upstream]:
    """The resource server that also runs 2025-11-25 tasks; it lists `legacy_task_required` (a tool it runs
    only as its own task) to tokens with the reports scope only."""
    server = Upstream("--auth", str(issuer.jwks_path), ISSUER, "http://127.0.0.1:9/mcp", "--legacy-tasks")
    server.start()
    yield server
    server.stop()


async def test_each_caller_has_its_own_task_support_facts(
    make_proxy: Any, oauth_task_upstream: Upstream, issuer: Issuer
) -> None:
    """For a caller that did not declare the Tasks extension, a tool the server lists to it as task-only is
    refused by the proxy (-32021); a caller the server does not list it to gets the server's own answer."""
    client: Client = await make_proxy(oauth_task_upstream.url)
    reporter = issuer.token("carol", scope="mcp reports")
    plain = issuer.token("dave")
    call = {"name": "legacy_task_required", "arguments": {"seconds": 0}}
    body = modern_body("tools/call", call, capabilities={}, request_id=9)
    for _ in range(2):  # each caller again after the other's catalog was read
        for token, task_only in ((reporter, True), (plain, False)):
            headers = modern_headers("tools/call", "legacy_task_required", Authorization=f"Bearer {token}")
            async with client.post("/mcp", json=body, headers=headers) as response:
                message = (await read_messages(response))[-1]
            assert (message["error"]["code"] == -32021) is task_only, message


async def test_tasks_bound_to_raw_tokens_are_warned_about_once_the_upstream_is_found_to_require_them(
    oauth_upstream: Upstream, make_proxy: Any, issuer: Issuer
) -> None:
    """`detect` finds out at the first refusal; with `security.jwt` a refreshed token keeps its tasks: no warning."""
    with structlog.testing.capture_logs() as events:
        raw: Client = await make_proxy(oauth_upstream.url)
        await modern(raw, "tools/list")  # refused without a token: the upstream requires credentials
        await modern(raw, "tools/list")
    warned = [event for event in events if event["event"] == "tasks_bound_to_raw_tokens"]
    assert len(warned) == 1
    assert "set security.jwt" in warned[0]["hint"]
    jwks = issuer.jwks_path
    with structlog.testing.capture_logs() as events:
        verified: Client = await make_proxy(
            oauth_upstream.url, security={"jwt": {"jwks_file": str(jwks), "issuer": ISSUER}}
        )
        await modern(verified, "tools/list")
    assert not [event for event in events if event["event"] == "tasks_bound_to_raw_tokens"]
