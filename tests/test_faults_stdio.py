"""Fault tests (`faults` marker) for stdio upstreams: misbehaving servers (tests/upstream/faulty_stdio.py) in
front of which the proxy must answer every request within a bound and leave no process behind.

Each test counts the children of the test process (the proxy runs in it) before the proxy starts and after
its cleanup: equal, so every server process it started was stopped and reaped.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.edge._app_keys import POOL
from proxy.upstream.stdio.session import StdioSession
from tests.support.processes import children, stdio_upstream
from tests.support.waiting import until
from tests.support.wire import HEADERS, INITIALIZE, modern_body, modern_headers, read_messages

pytestmark = pytest.mark.faults

Client = TestClient[web.Request, web.Application]
ANSWER_BOUND_SECONDS = 15.0  # generous: every request is answered well within it (or the proxy hangs)


def faulty(mode: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "tests.upstream.faulty_stdio", mode, *options]


Start = Callable[..., Awaitable[Client]]


@pytest.fixture
async def faulty_proxy(make_proxy: Callable[..., Any]) -> AsyncIterator[Start]:
    """Start proxies in front of a faulty server; afterwards close them and count the children."""
    before = children()
    started: list[Client] = []

    async def start(mode: str, *options: str, **upstream: Any) -> Client:
        fields = {"connect_timeout_seconds": 3, "stop_grace_seconds": 1, **upstream}
        client: Client = await make_proxy(
            "",
            upstream=stdio_upstream(faulty(mode, *options), **fields),
            observability={"readiness_max_age_seconds": 0.5},  # readiness asks again soon after a crash
        )
        started.append(client)
        return client

    yield start
    for client in started:
        await client.close()
    assert children() == before, "a server process was left behind"


async def call(client: Client, tool: str = "echo", arguments: dict[str, Any] | None = None) -> tuple[int, Any]:
    """A modern tools/call, answered within the bound."""
    params = {"name": tool, "arguments": arguments if arguments is not None else {"text": "x"}}
    body = modern_body("tools/call", params)

    async def post() -> tuple[int, Any]:
        response = await client.post("/mcp", json=body, headers=modern_headers("tools/call", tool))
        return response.status, (await read_messages(response))[-1]

    return await asyncio.wait_for(post(), ANSWER_BOUND_SECONDS)


async def until_answered(client: Client, wanted: Callable[[int, Any], bool], what: str) -> tuple[int, Any]:
    """Call again (each call answered within the bound) until an answer is the wanted one."""
    last: list[tuple[int, Any]] = []

    async def answered() -> tuple[int, Any] | None:
        last[:] = [await call(client)]
        return last[0] if wanted(*last[0]) else None

    answer: tuple[int, Any] = await until(answered, lambda: f"never {what}; last: {last}", ANSWER_BOUND_SECONDS)
    return answer


def error_text(message: Any) -> str:
    return str(message.get("error", {}).get("message", ""))


async def test_a_server_that_exits_at_start(faulty_proxy: Start, tmp_path: Path) -> None:
    """A server that started with the proxy, died, and now exits at each start: the proxy starts one again for
    requests; once it keeps crashing, requests get 503 saying so until its backoff has passed, then a fresh
    start is tried. (One that exits at the proxy's own start stops that start: tests/test_startup.py.)"""
    healthy = tmp_path / "healthy"
    healthy.write_text("")
    client = await faulty_proxy("exit-at-start", "--healthy-while", str(healthy))
    healthy.unlink()
    for session in client.app[POOL].sessions():  # the shared process, and the spare started beside it
        assert isinstance(session, StdioSession)
        if session.process is not None and session.process.pid is not None:
            os.kill(session.process.pid, signal.SIGKILL)
    _, crashed = await until_answered(
        client,
        lambda status, message: status == 502 and "during initialize" in error_text(message),
        "a 502 for a server that exited at start",
    )
    assert "exited with code 3 during initialize" in error_text(crashed)
    _, waiting = await until_answered(client, lambda status, message: status == 503, "a 503 while it keeps crashing")
    assert "keeps crashing" in error_text(waiting)
    assert "it is started again in" in error_text(waiting)
    ready = await asyncio.wait_for(client.get("/readyz"), ANSWER_BOUND_SECONDS)
    assert ready.status == 503
    legacy = await asyncio.wait_for(client.post("/mcp", json=INITIALIZE, headers=HEADERS), ANSWER_BOUND_SECONDS)
    assert legacy.status in (200, 503)  # refused during the backoff, or an error answer from the crashed process
    assert "error" in await legacy.json()


async def test_a_server_that_writes_garbage_between_its_answers(faulty_proxy: Start) -> None:
    client = await faulty_proxy("garbage")
    with structlog.testing.capture_logs() as events:
        for text in ("one", "two"):
            status, message = await call(client, arguments={"text": text})
            assert status == 200, message
            assert message["result"]["content"][0]["text"] == f'{{"text": "{text}"}}'
    assert any(event["event"] == "upstream_stdout_malformed" for event in events)  # skipped, and said so


@pytest.mark.parametrize("options", [(), ("--ignore-sigterm",)])
async def test_a_server_that_never_answers_initialize(faulty_proxy: Start, options: tuple[str, ...]) -> None:
    client = await faulty_proxy("no-initialize", *options, start_timeout_seconds=1)
    _, timed_out = await until_answered(client, lambda status, message: status == 504, "a 504 for initialize")
    assert "did not answer initialize within 1 s" in error_text(timed_out)
    legacy = await asyncio.wait_for(client.post("/mcp", json=INITIALIZE, headers=HEADERS), ANSWER_BOUND_SECONDS)
    assert legacy.status in (503, 504)  # timed out, or refused while it counts as crashing


async def test_a_server_that_floods_stderr(faulty_proxy: Start) -> None:
    client = await faulty_proxy("stderr-flood")
    with structlog.testing.capture_logs() as events:
        for _ in range(3):
            status, message = await call(client)
            assert status == 200, message
        await client.close()  # the last count of suppressed lines is logged when the server has exited
    logged = [event for event in events if event["event"] == "upstream_stderr"]
    assert len(logged) <= 200  # rate-limited: megabytes of stderr, a bounded number of log lines
    assert any(event["event"] == "upstream_stderr_suppressed" for event in events)


async def test_a_server_that_writes_a_line_over_the_cap(faulty_proxy: Start) -> None:
    with structlog.testing.capture_logs() as events:
        client = await faulty_proxy("huge-line", "--bytes", str(2 * 1024 * 1024), max_line_bytes=1024 * 1024)
        status, message = await call(client)
        assert status in (502, 503), message  # killed with its call, or refused while it keeps crashing

        def killed() -> bool:
            exits = [event["reason"] for event in events if event["event"] == "upstream_process_exited"]
            return any("upstream.max_line_bytes" in reason for reason in exits)

        await until(killed, "the process was not killed for its line", ANSWER_BOUND_SECONDS)
