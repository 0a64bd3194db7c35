"""End to end: `security.jwt`. The key set is served over HTTP by the test (it can be down or slow), tokens are
minted here, and the upstream is the OAuth fixture server that trusts the same key. A task belongs to the
issuer plus `sub`, so a refreshed token reads it; a JWT that fails verification is refused before anything.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import jwt
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.support.oauth import ISSUER, Issuer, claims, handmade
from tests.support.processes import Upstream
from tests.support.wire import modern_body, modern_headers, read_messages

Client = TestClient[web.Request, web.Application]
TASKS: dict[str, Any] = {"extensions": {"io.modelcontextprotocol/tasks": {}}}
AUDIENCE = "mcp-proxy"


class KeySetServer:
    """The issuer's JWKS endpoint: `mode` is ok, down (HTTP 503) or slow (answers after 5 s)."""

    def __init__(self, issuer: Issuer) -> None:
        self.issuer = issuer
        self.mode = "ok"
        self.fetches = 0
        self.app = web.Application()
        self.app.router.add_get("/jwks.json", self.serve)

    async def serve(self, request: web.Request) -> web.StreamResponse:
        self.fetches += 1
        if self.mode == "down":
            return web.Response(status=503)
        if self.mode == "slow":
            await asyncio.sleep(5)
        return web.json_response(self.issuer.jwks())


@pytest.fixture(scope="module")
def issuer(tmp_path_factory: pytest.TempPathFactory) -> Issuer:
    return Issuer(tmp_path_factory.mktemp("jwt"))


@pytest.fixture(scope="module")
def jwt_upstream(issuer: Issuer) -> Iterator[Upstream]:
    server = Upstream("--auth", str(issuer.jwks_path), ISSUER, "http://127.0.0.1:9/mcp")
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def keys(issuer: Issuer) -> AsyncIterator[tuple[KeySetServer, str]]:
    served = KeySetServer(issuer)
    server = TestServer(served.app, host="127.0.0.1")
    await server.start_server()
    yield served, str(server.make_url("/jwks.json"))
    await server.close()


def _jwt_config(keys_url: str) -> dict[str, Any]:
    return {
        "jwks_url": keys_url,
        "issuer": [ISSUER, "https://other-issuer.example"],
        "audience": AUDIENCE,
        "jwks_refetch_seconds": 3600,
        "jwks_timeout_seconds": 0.5,
    }


@pytest.fixture
async def jwt_proxy(make_proxy: Any, jwt_upstream: Upstream, keys: tuple[KeySetServer, str], tmp_path: Path) -> Client:
    client: Client = await make_proxy(
        jwt_upstream.url,
        security={"jwt": _jwt_config(keys[1]), "key_file": str(_key(tmp_path))},
        tasks={"tools": {"sleep": {"mode": "required"}}},
    )
    return client


def _key(tmp_path: Path) -> Path:
    path = tmp_path / "deployment.key"
    path.write_text("k" * 64)
    return path


async def modern(
    client: Client, method: str, params: dict[str, Any] | None = None, *, authorization: str | None = None
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = modern_body(method, params, capabilities=TASKS, request_id=3)
    name = params.get("name") if params else None
    extra = {"Authorization": authorization} if authorization is not None else {}
    async with client.post("/mcp", json=body, headers=modern_headers(method, name, **extra)) as response:
        return response.status, dict(response.headers), (await read_messages(response))[-1]


async def test_a_refreshed_token_reads_its_owners_task_and_another_owner_cannot(
    jwt_proxy: Client, issuer: Issuer
) -> None:
    first = issuer.token("alice", aud=AUDIENCE, jti="1")
    status, _, created = await modern(
        jwt_proxy, "tools/call", {"name": "sleep", "arguments": {"seconds": 0.1}}, authorization=f"Bearer {first}"
    )
    assert status == 200, created
    task_id = created["result"]["taskId"]
    refreshed = issuer.token("alice", aud=AUDIENCE, jti="2", iat=int(time.time()) + 1)
    assert refreshed != first
    status, _, got = await modern(jwt_proxy, "tasks/get", {"taskId": task_id}, authorization=f"Bearer {refreshed}")
    assert status == 200, got
    assert got["result"]["taskId"] == task_id
    bob = issuer.token("bob", aud=AUDIENCE)
    status, _, other = await modern(jwt_proxy, "tasks/get", {"taskId": task_id}, authorization=f"Bearer {bob}")
    assert other["error"]["code"] == -32602
    # The same subject from another accepted issuer is another owner.
    foreign = issuer.token("alice", aud=AUDIENCE, iss="https://other-issuer.example")
    status, _, other = await modern(jwt_proxy, "tasks/get", {"taskId": task_id}, authorization=f"Bearer {foreign}")
    assert other["error"]["code"] == -32602


def _rejected(issuer: Issuer) -> dict[str, str]:
    now = int(time.time())
    good = claims(aud=AUDIENCE)
    return {
        "expired": issuer.token(aud=AUDIENCE, lifetime=-300),
        "wrong issuer": issuer.token(aud=AUDIENCE, iss="https://evil.example"),
        "wrong audience": issuer.token(aud="someone-else"),
        "no audience": issuer.token(),
        "no subject": handmade_signed(issuer, {k: v for k, v in good.items() if k != "sub"}),
        "bad signature": _swap_signature(issuer.token(aud=AUDIENCE), issuer.token("mallory", aud=AUDIENCE)),
        "alg none": handmade({"alg": "none", "typ": "JWT", "kid": issuer.kid}, good, None),
        "HS256 with the public key": handmade({"alg": "HS256", "kid": issuer.kid}, good, issuer.public_pem()),
        "not yet valid": issuer.token(aud=AUDIENCE, nbf=now + 3600),
        "undecodable header": "e30x.e30.AAAA",
        "non-ASCII algorithm": handmade({"alg": 'RS256\u00e9"\n', "kid": issuer.kid}, good, b"x"),
    }


def handmade_signed(issuer: Issuer, payload: dict[str, Any]) -> str:
    return jwt.encode(payload, issuer.key, algorithm="RS256", headers={"kid": issuer.kid})


def _swap_signature(token: str, donor: str) -> str:
    return token.rsplit(".", 1)[0] + "." + donor.rsplit(".", 1)[1]


REJECTED = [
    "expired",
    "wrong issuer",
    "wrong audience",
    "no audience",
    "no subject",
    "bad signature",
    "alg none",
    "HS256 with the public key",
    "not yet valid",
    "undecodable header",
    "non-ASCII algorithm",
]


@pytest.mark.parametrize("case", REJECTED)
async def test_a_jwt_that_fails_is_401_invalid_token_before_any_task_lookup(
    jwt_proxy: Client, issuer: Issuer, case: str
) -> None:
    token = _rejected(issuer)[case]
    with structlog.testing.capture_logs() as events:
        status, headers, message = await modern(
            jwt_proxy, "tasks/get", {"taskId": "task_unknown"}, authorization=f"Bearer {token}"
        )
    assert status == 401, message
    assert headers["WWW-Authenticate"].startswith('Bearer error="invalid_token"')
    assert message["id"] == 3
    assert message["error"]["code"] == -32600
    assert "Unauthorized" in message["error"]["message"]
    logged = repr(events)
    assert events
    assert token not in logged
    assert all(part not in logged for part in token.split(".") if len(part) > 8)


@pytest.mark.parametrize(
    "authorization",
    ["Bearer", "Bearer ", "Basic YWxpY2U6c2VjcmV0", "bearer a b c", "Bearer ...", "Token x.y.z", "Bearer \t"],
)
async def test_malformed_authorization_values_are_opaque_and_the_upstream_refuses_them(
    jwt_proxy: Client, authorization: str
) -> None:
    status, headers, message = await modern(jwt_proxy, "tools/list", authorization=authorization)
    assert status == 401, message
    assert "WWW-Authenticate" in headers
    assert "error" in message


async def test_a_huge_token_is_refused_without_a_server_error(jwt_proxy: Client) -> None:
    shaped = "Bearer " + "a" * 6000 + "." + "b" * 1000 + ".c"
    status, _, message = await modern(jwt_proxy, "tools/list", authorization=shaped)
    assert status == 401
    assert "error" in message
    oversized = "Bearer " + "a" * 20_000
    body = modern_body("tools/list", None, capabilities=TASKS)
    async with jwt_proxy.post("/mcp", json=body, headers=modern_headers("tools/list", Authorization=oversized)) as r:
        assert 400 <= r.status < 500


async def test_keys_that_cannot_be_fetched_give_503_and_nothing_is_remembered(
    jwt_proxy: Client, issuer: Issuer, keys: tuple[KeySetServer, str]
) -> None:
    served, _ = keys
    token = issuer.token("dora", aud=AUDIENCE)
    served.mode = "down"
    status, headers, message = await modern(jwt_proxy, "tools/list", authorization=f"Bearer {token}")
    assert status == 503
    assert "keys" in message["error"]["message"]
    assert headers["Retry-After"]
    served.mode = "slow"
    started = time.monotonic()
    status, _, message = await modern(jwt_proxy, "tools/list", authorization=f"Bearer {token}")
    assert status == 503
    assert time.monotonic() - started < 4  # jwks_timeout_seconds, not the key server's 5 s
    served.mode = "ok"
    status, _, message = await modern(jwt_proxy, "tools/list", authorization=f"Bearer {token}")
    assert status == 200, message
    assert message["result"]["tools"]


async def test_unknown_key_ids_cost_at_most_one_refetch_per_interval(
    jwt_proxy: Client, issuer: Issuer, keys: tuple[KeySetServer, str]
) -> None:
    served, _ = keys
    status, _, _ = await modern(jwt_proxy, "tools/list", authorization=f"Bearer {issuer.token(aud=AUDIENCE)}")
    assert status == 200
    assert served.fetches == 1

    for number in range(5):
        forged = jwt.encode(claims(aud=AUDIENCE), issuer.key, algorithm="RS256", headers={"kid": f"made-up-{number}"})
        status, headers, _ = await modern(jwt_proxy, "tools/list", authorization=f"Bearer {forged}")
        assert status == 401
        assert 'error="invalid_token"' in headers["WWW-Authenticate"]
    assert served.fetches == 2  # one refetch for the first unknown kid, then none within jwks_refetch_seconds


async def test_an_expired_jwt_gets_401_on_discover_even_after_its_owner_filled_the_cache(
    jwt_proxy: Client, issuer: Issuer
) -> None:
    valid = issuer.token("erin", aud=AUDIENCE)
    status, _, message = await modern(jwt_proxy, "server/discover", authorization=f"Bearer {valid}")
    assert status == 200, message
    assert message["result"]["capabilities"]["tools"] is not None
    expired = issuer.token("erin", aud=AUDIENCE, lifetime=-300)
    status, headers, message = await modern(jwt_proxy, "server/discover", authorization=f"Bearer {expired}")
    assert status == 401, message
    assert 'error="invalid_token"' in headers["WWW-Authenticate"]
    assert "result" not in message


async def test_listen_streams_are_counted_per_owner_not_per_token(
    make_proxy: Any, jwt_upstream: Upstream, keys: tuple[KeySetServer, str], tmp_path: Path, issuer: Issuer
) -> None:
    """Two tokens of one owner (a client that refreshed its token) share the owner's listen streams."""
    client: Client = await make_proxy(
        jwt_upstream.url,
        security={"jwt": _jwt_config(keys[1]), "key_file": str(_key(tmp_path))},
        limits={"max_listen_streams_per_principal": 2},
    )
    body = modern_body("subscriptions/listen", {"notifications": {"toolsListChanged": True}}, request_id="l")
    opened: list[Any] = []

    async def listen(token: str) -> tuple[int, dict[str, Any] | None]:
        headers = modern_headers("subscriptions/listen", Authorization=f"Bearer {token}")
        response = await client.post("/mcp", json=body, headers=headers)
        if response.status != 200:
            return response.status, (await read_messages(response))[-1]
        await response.content.readline()  # the acknowledgement has started the stream
        opened.append(response)
        return 200, None

    try:
        first = issuer.token("frank", aud=AUDIENCE, jti="1")
        refreshed = issuer.token("frank", aud=AUDIENCE, jti="2")
        assert (await listen(first))[0] == 200
        assert (await listen(refreshed))[0] == 200
        status, message = await listen(issuer.token("frank", aud=AUDIENCE, jti="3"))
        assert status == 429, message
        assert message is not None
        assert message["error"]["data"] == {"limit": "max_listen_streams_per_principal", "max": 2}
        assert (await listen(issuer.token("grace", aud=AUDIENCE)))[0] == 200  # another owner has a share of its own
    finally:
        for response in opened:
            response.close()
