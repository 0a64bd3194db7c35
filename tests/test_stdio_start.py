"""Starting a stdio server the way `uvx`/`npx` do: slowly, and needing the proxy's trust store and outbound
proxy settings. Real server processes (tests/upstream/faulty_stdio.py) behind a real proxy on loopback."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import structlog.testing
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.support.processes import children, stdio_upstream
from tests.support.waiting import until
from tests.support.wire import modern_body, modern_headers, read_messages

Client = TestClient[web.Request, web.Application]
Start = Callable[..., Awaitable[Client]]
ANSWER_BOUND_SECONDS = 20.0


@pytest.fixture
async def stdio_proxy(make_proxy: Callable[..., Any]) -> AsyncIterator[Start]:
    """Proxies in front of `faulty_stdio slow-start`; afterwards every server process is gone."""
    before = children()
    started: list[Client] = []

    async def start(seconds: float, **upstream: Any) -> Client:
        command = [sys.executable, "-m", "tests.upstream.faulty_stdio", "slow-start", "--seconds", str(seconds)]
        fields = {"stop_grace_seconds": 1, **upstream}
        client: Client = await make_proxy("", upstream=stdio_upstream(command, **fields))
        started.append(client)
        return client

    yield start
    for client in started:
        await client.close()
    assert children() == before, "a server process was left behind"


async def call(client: Client, tool: str) -> tuple[int, Any]:
    body = modern_body("tools/call", {"name": tool, "arguments": {}})

    async def post() -> tuple[int, Any]:
        response = await client.post("/mcp", json=body, headers=modern_headers("tools/call", tool))
        return response.status, (await read_messages(response))[-1]

    return await asyncio.wait_for(post(), ANSWER_BOUND_SECONDS)


def error_text(message: Any) -> str:
    return str(message.get("error", {}).get("message", ""))


async def test_the_server_sees_the_trust_store_and_proxy_variables_but_not_other_secrets(
    stdio_proxy: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", "/etc/ssl/corporate-ca.pem")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")
    monkeypatch.setenv("no_proxy", "localhost,.svc")
    monkeypatch.setenv("UV_CACHE_DIR", "/var/cache/uv")
    monkeypatch.setenv("SOME_API_TOKEN", "not-for-the-server")
    client = await stdio_proxy(0)
    status, message = await call(client, "environment")
    assert status == 200, message
    environment = json.loads(message["result"]["content"][0]["text"])
    assert environment["SSL_CERT_FILE"] == "/etc/ssl/corporate-ca.pem"
    assert environment["HTTPS_PROXY"] == "http://proxy.internal:3128"
    assert environment["no_proxy"] == "localhost,.svc"
    assert environment["UV_CACHE_DIR"] == "/var/cache/uv"
    assert "SOME_API_TOKEN" not in environment


async def test_a_server_slower_than_its_start_timeout_is_reported_as_slow_not_as_crashing(
    stdio_proxy: Start,
) -> None:
    """Each start times out (504 saying so); once the backoff holds starts back, its 503 says why, and never
    that the server crashed or is started again in 0.0 s."""
    answers: list[tuple[int, Any]] = []
    with structlog.testing.capture_logs() as events:
        client = await stdio_proxy(30, start_timeout_seconds=1)

        async def backed_off() -> bool:
            answers.append(await call(client, "echo"))
            return answers[-1][0] == 503

        await until(backed_off, lambda: f"never a 503 during the backoff: {answers}", ANSWER_BOUND_SECONDS)
    for status, message in answers:
        assert status in (503, 504), message
        assert "did not answer initialize within 1 s" in error_text(message)
        assert "crashing" not in error_text(message)
    waiting = error_text(next(message for status, message in answers if status == 503))
    assert "times in a row); it is started again in" in waiting
    assert "started again in 0.0 s" not in waiting
    slow = [event for event in events if event["event"] == "upstream_process_still_starting"]
    assert slow, "a slow start was not logged"
    assert all(event["start_timeout_seconds"] == 1 for event in slow)


async def test_a_server_that_answers_within_its_start_timeout_starts_and_its_slowness_is_logged(
    stdio_proxy: Start,
) -> None:
    with structlog.testing.capture_logs() as events:
        client = await stdio_proxy(2, start_timeout_seconds=8)
        status, message = await call(client, "echo")
    assert status == 200, message
    assert [event for event in events if event["event"] == "upstream_process_still_starting"]
    initialized = [event for event in events if event["event"] == "upstream_session_initialized"]
    assert initialized
    assert initialized[0]["start_seconds"] >= 2
