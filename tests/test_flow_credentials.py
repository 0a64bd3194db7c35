"""End to end: `upstream.credentials`. A real token endpoint (Authlib, tests/support/token_server.py) exchanges the
callers' verified JWTs for tokens the upstream (the OAuth fixture server, which trusts only the endpoint's key)
accepts; a mounted map gives each caller its own headers or its own stdio processes' environment. Each caller
reaches the upstream with its own credential only, never the inbound token; refusals are explicit; a job whose
caller's token expired polls on with tokens renewed by the refresh token; an events watch of the legacy server's
changes subscribes upstream with its caller's credential; no credential is in a log or a span.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.edge._app_keys import POOL
from tests.support.clients import ClientFactory, Tasks
from tests.support.events import rpc
from tests.support.jobs import render_job
from tests.support.oauth import ISSUER, Issuer
from tests.support.processes import ROOT, Upstream, key_file, stdio_sessions
from tests.support.sdk import connect, text
from tests.support.token_server import TokenServer
from tests.support.waiting import until
from tests.support.wire import result_text

STDIO_SERVER = [sys.executable, "-m", "tests.upstream.faulty_stdio", "slow-start", "--seconds", "0"]


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def jwt_section(caller_issuer: Issuer) -> dict[str, Any]:
    return {"jwks_file": str(caller_issuer.jwks_path), "issuer": ISSUER}


def bearer(caller_issuer: Issuer, subject: str, lifetime: float = 600, **claims: Any) -> dict[str, str]:
    return {"Authorization": f"Bearer {caller_issuer.token(subject, lifetime=lifetime, **claims)}"}


async def token_claims(client: Tasks, headers: dict[str, str]) -> dict[str, Any]:
    status, message = await client.call("token_claims", {}, capabilities={}, headers=headers)
    assert status == 200, message
    answer: dict[str, Any] = json.loads(result_text(message))
    return answer


async def presented(client: Tasks, headers: dict[str, str]) -> set[str]:
    status, message = await client.call("seen_tokens", {}, capabilities={}, headers=headers)
    assert status == 200, message
    return set(json.loads(result_text(message)))


def span_text(exporter: InMemorySpanExporter) -> str:
    return json.dumps(
        [
            [
                span.name,
                dict(span.attributes or {}),
                [[event.name, dict(event.attributes or {})] for event in span.events],
            ]
            for span in exporter.get_finished_spans()
        ],
        default=str,
    )


# --- exchange ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("client_auth", ["client_secret_basic", "client_secret_post", "private_key_jwt"])
async def test_each_caller_reaches_the_upstream_with_its_own_exchanged_token_never_the_inbound_one(
    client_auth: str,
    tasks_client: ClientFactory,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    tmp_path: Path,
    spans: InMemorySpanExporter,
) -> None:
    overrides: dict[str, Any] = {"client_auth": client_auth}
    if client_auth == "private_key_jwt":
        overrides = {"client_secret_file": None, "private_key_jwt": {"key_file": str(token_endpoint.client_key_path)}}
    client = await tasks_client(
        protected_upstream.url,
        upstream={"credentials": token_endpoint.exchange_config(**overrides)},
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
    )
    alice, bob = bearer(caller_issuer, "alice"), bearer(caller_issuer, "bob")
    with structlog.testing.capture_logs() as logs:
        seen_by_alice = await token_claims(client, alice)
        seen_by_bob = await token_claims(client, bob)
        again = await token_claims(client, alice)  # the cached token: no second exchange
        sessions = client.client.app[POOL].open_sessions
        refreshed = bearer(caller_issuer, "alice", jti="second")  # the caller's next token: same owner, same session
        after_refresh = await token_claims(client, refreshed)
        seen = await presented(client, alice)
    assert seen_by_alice["sub"] == "alice", seen_by_alice
    assert seen_by_bob["sub"] == "bob"
    assert seen_by_alice["aud"] == seen_by_bob["aud"] == "legacy-upstream"
    alice_tokens = {sha(token) for token in token_endpoint.tokens_of("alice")}
    bob_tokens = {sha(token) for token in token_endpoint.tokens_of("bob")}
    assert seen_by_alice["token"] in alice_tokens
    assert seen_by_bob["token"] in bob_tokens
    assert again["token"] == seen_by_alice["token"]
    assert after_refresh["sub"] == "alice"
    assert client.client.app[POOL].open_sessions == sessions
    assert token_endpoint.count("exchange") == 2  # one per caller, then cached
    inbound = {sha(value.removeprefix("Bearer ")) for value in (alice["Authorization"], bob["Authorization"])}
    assert seen
    assert not inbound & seen  # the upstream never saw a caller's own token
    assert seen <= alice_tokens | bob_tokens | inbound
    secrets_written = [
        *(value.removeprefix("Bearer ") for value in (alice["Authorization"], bob["Authorization"])),
        *token_endpoint.tokens_of("alice"),
        *token_endpoint.tokens_of("bob"),
        *token_endpoint.grants,
        token_endpoint.client_secret,
    ]
    text = json.dumps(logs, default=str) + span_text(spans)
    assert "credential_exchanged" in text
    for secret in secrets_written:
        assert secret not in text


async def test_a_legacy_client_is_verified_and_relayed_with_its_exchanged_token_in_place_of_its_own(
    make_proxy: Any, protected_upstream: Upstream, token_endpoint: TokenServer, caller_issuer: Issuer, tmp_path: Path
) -> None:
    client = await make_proxy(
        protected_upstream.url,
        upstream={"credentials": token_endpoint.exchange_config()},
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
    )
    url = str(client.make_url("/mcp"))
    alice = bearer(caller_issuer, "alice")
    async with connect(url, headers=alice) as legacy:
        claims = json.loads(text(await legacy.session.call_tool("token_claims", {})))
        seen = set(json.loads(text(await legacy.session.call_tool("seen_tokens", {}))))
    assert claims["sub"] == "alice"
    assert claims["token"] in {sha(token) for token in token_endpoint.tokens_of("alice")}
    assert sha(alice["Authorization"].removeprefix("Bearer ")) not in seen
    response = await client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "ping"}, headers=_legacy_headers())
    assert response.status == 401  # a legacy caller the proxy cannot verify gets no credential made for it


def _legacy_headers() -> dict[str, str]:
    return {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


async def test_a_refused_exchange_is_401_with_the_endpoints_error_and_a_down_endpoint_503_never_forwarding(
    tasks_client: ClientFactory,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    tmp_path: Path,
) -> None:
    client = await tasks_client(
        protected_upstream.url,
        upstream={"credentials": token_endpoint.exchange_config(timeout_seconds=2)},
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
    )
    token_endpoint.refuse_subjects.add("mallory")
    mallory = bearer(caller_issuer, "mallory")
    status, message = await client.call("token_claims", {}, capabilities={}, headers=mallory)
    assert status == 401, message
    assert message["error"]["data"] == {"error": "invalid_grant"}
    assert "invalid_grant" in message["error"]["message"]

    status, message = await client.call("token_claims", {}, capabilities={}, headers={})  # anonymous: no credential
    assert status == 401, message
    status, message = await client.call("token_claims", {}, capabilities={}, headers={"Authorization": "Bearer opaque"})
    assert status == 401, message  # a token the proxy cannot verify names no owner to exchange for

    token_endpoint.down = True
    response = await client.client.post(
        "/mcp",
        json={
            "jsonrpc": "2.0",
            "id": 1,
            "method": "tools/call",
            "params": {"name": "token_claims", "arguments": {}, "_meta": _meta()},
        },
        headers={**_modern_headers("token_claims"), **bearer(caller_issuer, "carol")},
    )
    assert response.status == 503
    assert response.headers["Retry-After"].isdigit()
    token_endpoint.down = False
    seen = await presented(client, bearer(caller_issuer, "alice"))
    assert sha(mallory["Authorization"].removeprefix("Bearer ")) not in seen


def _meta() -> dict[str, Any]:
    return {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {}}


def _modern_headers(tool: str) -> dict[str, str]:
    return {
        "Accept": "application/json, text/event-stream",
        "MCP-Protocol-Version": "2026-07-28",
        "Mcp-Method": "tools/call",
        "Mcp-Name": tool,
    }


async def test_a_job_whose_callers_token_expired_polls_to_its_end_with_refreshed_tokens(
    tasks_client: ClientFactory,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    tmp_path: Path,
) -> None:
    """The suite's short version of the 90 s family with 20 s tokens: 9 s, tokens of 2 s, the caller's own
    token of 4 s. Polls after the caller's token expired are made with tokens the refresh token renewed."""
    token_endpoint.lifetime_seconds = 2
    client = await tasks_client(
        protected_upstream.url,
        upstream={"credentials": token_endpoint.exchange_config(renew_before_seconds=0.5)},
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
        jobs=render_job(poll_interval_ms=500),
    )
    started = bearer(caller_issuer, "alice", lifetime=4)
    task_id = await client.create("start_render", {"seconds": 9}, headers=started)

    async def settled() -> dict[str, Any] | None:
        task = await client.task(
            task_id, headers=bearer(caller_issuer, "alice")
        )  # the client polls with its own fresh ones
        return task if task["status"] in ("completed", "failed", "cancelled") else None

    done = await until(settled, "the job task did not settle", 30)
    assert done["status"] == "completed", done
    assert token_endpoint.count("refresh") >= 2  # renewed by refresh tokens after the caller's token expired
    assert len(token_endpoint.tokens_of("alice")) >= 4
    seen = await presented(client, bearer(caller_issuer, "alice"))
    assert sha(started["Authorization"].removeprefix("Bearer ")) not in seen


async def test_a_job_whose_credential_cannot_be_renewed_fails_saying_so(
    tasks_client: ClientFactory,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    tmp_path: Path,
) -> None:
    token_endpoint.lifetime_seconds = 2
    token_endpoint.refresh_tokens = (
        False  # the endpoint gives no refresh token: nothing renews it past the caller's token
    )
    client = await tasks_client(
        protected_upstream.url,
        upstream={"credentials": token_endpoint.exchange_config(renew_before_seconds=0.5)},
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
        jobs=render_job(poll_interval_ms=500),
    )
    task_id = await client.create("start_render", {"seconds": 30}, headers=bearer(caller_issuer, "alice", lifetime=3))

    async def settled() -> dict[str, Any] | None:
        task = await client.task(task_id, headers=bearer(caller_issuer, "alice"))
        return task if task["status"] != "working" else None

    done = await until(settled, "the job task did not settle", 20)
    assert done["status"] == "failed", done
    assert "can no longer be renewed" in done["statusMessage"]
    assert "gave no refresh token" in done["statusMessage"]


# --- secrets ---------------------------------------------------------------------------------------------------


async def test_secrets_give_each_caller_its_own_headers_and_refuse_one_without_an_entry(
    tasks_client: ClientFactory,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    tmp_path: Path,
) -> None:
    alice_token = token_endpoint.issue("alice", "legacy-upstream", "mcp", "operator", "static")["access_token"]
    bob_token = token_endpoint.issue("bob", "legacy-upstream", "mcp", "operator", "static")["access_token"]
    users = tmp_path / "users"
    users.mkdir()
    (users / "alice").write_text(json.dumps({"Authorization": f"Bearer {alice_token}"}))
    (users / "bob").write_text(json.dumps({"Authorization": f"Bearer {bob_token}"}))
    client = await tasks_client(
        protected_upstream.url,
        upstream={"credentials": {"mode": "secrets", "secrets": {"path": str(users)}}},
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
    )
    assert (await token_claims(client, bearer(caller_issuer, "alice")))["token"] == sha(alice_token)
    assert (await token_claims(client, bearer(caller_issuer, "bob")))["token"] == sha(bob_token)
    status, message = await client.call("token_claims", {}, capabilities={}, headers=bearer(caller_issuer, "carol"))
    assert status == 403, message
    assert "no upstream credential" in message["error"]["message"]
    (users / "bob").unlink()  # picked up as the config is: bob is refused from then on

    async def bob_refused() -> bool:
        status, _ = await client.call("token_claims", {}, capabilities={}, headers=bearer(caller_issuer, "bob"))
        return status == 403

    await until(bob_refused, "a removed entry was not picked up", 10)


async def test_stdio_secrets_give_each_caller_processes_with_its_own_environment_only(
    tasks_client: ClientFactory, caller_issuer: Issuer, tmp_path: Path
) -> None:
    users = tmp_path / "users.yaml"
    users.write_text(json.dumps({"alice": {"SERVICE_TOKEN": "alice-secret-1"}, "bob": {"SERVICE_TOKEN": "bob-secret"}}))
    client = await tasks_client(
        "http://unused.invalid/mcp",
        upstream={
            "url": None,
            "command": STDIO_SERVER,
            "cwd": str(ROOT),
            "max_processes": 4,
            "credentials": {"mode": "secrets", "secrets": {"path": str(users)}},
        },
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
    )

    tokens = {subject: bearer(caller_issuer, subject) for subject in ("alice", "bob", "carol")}

    async def environment(subject: str) -> dict[str, str]:
        status, message = await client.call("environment", {}, capabilities={}, headers=tokens[subject])
        assert status == 200, message
        found: dict[str, str] = json.loads(result_text(message))
        return found

    alice, bob = await environment("alice"), await environment("bob")
    assert alice["SERVICE_TOKEN"] == "alice-secret-1"
    assert bob["SERVICE_TOKEN"] == "bob-secret"
    for seen in (alice, bob):
        assert "secret" not in json.dumps({name: value for name, value in seen.items() if name != "SERVICE_TOKEN"})
        for header in tokens.values():  # no caller's inbound token in any server's environment
            assert header["Authorization"].removeprefix("Bearer ") not in json.dumps(seen)
    pids = {session.pid for session in stdio_sessions(client)}
    assert len(pids - {None}) >= 2  # each caller's own process

    status, message = await client.call("environment", {}, capabilities={}, headers=tokens["carol"])
    assert status == 403, message

    users.write_text(json.dumps({"alice": {"SERVICE_TOKEN": "alice-secret-2"}}))  # rotated, and bob removed

    async def rotated() -> bool:
        return (await environment("alice"))["SERVICE_TOKEN"] == "alice-secret-2"

    await until(rotated, "a rotated entry did not reach a new process", 15)


async def test_an_events_watch_subscribes_upstream_with_its_callers_own_credential_and_relays_the_update(
    tasks_client: ClientFactory,
    protected_upstream: Upstream,
    token_endpoint: TokenServer,
    caller_issuer: Issuer,
    tmp_path: Path,
) -> None:
    """A verified caller's `resource.updated` poll makes the proxy hold a watch of that URI upstream; the watch
    acts for the caller's verified owner, so its `resources/subscribe` carries the caller's own upstream
    credential (never the inbound token, which may expire long before the watch does)."""
    uri = "test://watched-resource"
    alice_token = token_endpoint.issue("alice", "legacy-upstream", "mcp", "operator", "static")["access_token"]
    users = tmp_path / "users"
    users.mkdir()
    (users / "alice").write_text(json.dumps({"Authorization": f"Bearer {alice_token}"}))
    client = await tasks_client(
        protected_upstream.url,
        events={"enabled": True},
        upstream={"credentials": {"mode": "secrets", "secrets": {"path": str(users)}}},
        security={"jwt": jwt_section(caller_issuer), "key_file": key_file(tmp_path)},
    )
    alice = bearer(caller_issuer, "alice")
    inbound = alice["Authorization"].removeprefix("Bearer ")

    async def poll(cursor: str | None) -> dict[str, Any]:
        params = {"name": "resource.updated", "arguments": {"uri": uri}, "cursor": cursor}
        status, message = await rpc(client.client, "events/poll", params, principal=inbound)
        assert status == 200, message
        result: dict[str, Any] = message["result"]
        return result

    async def tool(name: str, arguments: dict[str, Any]) -> str:
        status, message = await client.call(name, arguments, capabilities={}, headers=alice)
        assert status == 200, message
        return result_text(message)

    start = await poll(None)

    async def subscribed_upstream() -> bool:
        return await tool("update_resource", {"uri": uri}) == "notified 1 subscriber(s)"

    await until(subscribed_upstream, "the watch never subscribed to the resource upstream", 15)
    found: list[dict[str, Any]] = []

    async def arrived() -> bool:
        found.extend((await poll(start["cursor"]))["events"])
        return bool(found)

    await until(arrived, "the legacy server's update never reached the caller's poll", 10)
    assert (found[0]["name"], found[0]["data"]) == ("resource.updated", {"uri": uri})
    subscriptions = json.loads(await tool("subscriptions_made", {}))
    assert subscriptions
    assert all(made == {"uri": uri, "sub": "alice", "token": sha(alice_token)} for made in subscriptions), subscriptions
    seen = await presented(client, alice)
    assert sha(alice_token) in seen
    assert sha(inbound) not in seen  # the caller's own token never reached the upstream
