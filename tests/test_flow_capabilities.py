"""End to end, for both kinds of upstream: a 2026-07-28 client that declared nothing it could be asked calls a
tool that samples the mcp 1.x SDK's default way, `ctx.session.create_message(...)`, which names no request
(over HTTP it goes out on the session's GET stream; over stdio nothing names a request). The client is told
what it lacks (-32021 with `data.requiredCapabilities`, HTTP 400) instead of getting the tool's reaction to a
refused question. Real fixture servers (mcp 1.x), real processes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from proxy.edge._app_keys import POOL
from tests.support.clients import Tasks, upstream_calls_open
from tests.support.processes import Upstream, stdio_upstream
from tests.support.schemas import ModernSchema, SchemaValidator

NOTHING: dict[str, Any] = {}  # the client's capabilities: nothing it could be asked, no Tasks extension

Start = Callable[..., Awaitable[Tasks]]


@pytest.fixture(params=["http", "stdio"])
def start_proxy(
    request: pytest.FixtureRequest,
    make_proxy: Callable[..., Any],
    upstream: Upstream,
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> Start:
    """A proxy in front of the project fixture, over HTTP or as a stdio server the proxy runs itself (its start
    imports the mcp SDK, slow on a busy machine, hence the generous start timeout)."""

    async def start(**sections: dict[str, Any]) -> Tasks:
        if request.param == "stdio":
            stdio = stdio_upstream()
            sections["upstream"] = {**stdio, **sections.get("upstream", {})}
            client = await make_proxy("", **sections)
        else:
            client = await make_proxy(upstream.url, **sections)
        return Tasks(client, modern_schema, tasks_schema)

    return start


def assert_lacks_sampling(status: int, message: dict[str, Any]) -> None:
    assert status == 400, message
    assert message["error"]["code"] == -32021, message
    assert message["error"]["data"]["requiredCapabilities"] == {"sampling": {}}


async def test_a_question_naming_no_request_is_the_only_running_calls(start_proxy: Start) -> None:
    """The call runs on the caller's shared session with nothing else: the question can only be its own."""
    client = await start_proxy()
    assert await client.text("echo", {"text": "warm"}) == "warm"  # the shared session (and GET stream) exists
    status, message = await client.call("sample_standalone", capabilities=NOTHING)
    assert_lacks_sampling(status, message)
    assert await client.text("echo", {"text": "after"}) == "after"  # the upstream was answered: it serves on


async def test_a_tool_seen_asking_gets_a_session_of_its_own_beside_other_calls(start_proxy: Start) -> None:
    """Once seen asking, the tool's calls no longer share the session: with another call running on the shared
    one (where a question naming no request would be nobody's), the question is still attributed."""
    client = await start_proxy()
    assert_lacks_sampling(*await client.call("sample_standalone", capabilities=NOTHING))
    pool = client.client.app[POOL]
    assert pool.questions.asked_before("tools/call sample_standalone")

    sleeper = Tasks(client.client, client.core, client.tasks)  # a second caller (same principal): its own ids
    sleeping = asyncio.get_running_loop().create_task(sleeper.call("sleep", {"seconds": 10}, capabilities=NOTHING))
    await upstream_calls_open(client.client, 1, timeout_seconds=20)
    [shared] = [session for session in pool.sessions() if session.in_flight]
    status, message = await client.call("sample_standalone", capabilities=NOTHING)
    assert_lacks_sampling(status, message)
    assert shared.in_flight == 1  # the sampling call ran elsewhere; the sleeping call still runs
    status, slept = await sleeping
    assert status == 200, slept
    assert slept["result"]["content"][0]["text"] == "slept 10"


async def test_a_client_that_declared_sampling_is_asked(start_proxy: Start) -> None:
    """The same tool for a client that can answer: the question reaches it as an MRTR round."""
    client = await start_proxy()
    status, message = await client.call("sample_standalone", capabilities={"sampling": {}})
    assert status == 200, message
    result = message["result"]
    assert result["resultType"] == "input_required"
    [(key, question)] = result["inputRequests"].items()
    assert question["method"] == "sampling/createMessage"
    answer = {"role": "assistant", "content": {"type": "text", "text": "hi"}, "model": "m"}
    retry = {
        "name": "sample_standalone",
        "arguments": {},
        "inputResponses": {key: answer},
        "requestState": result["requestState"],
    }
    status, message = await client.post("tools/call", retry, capabilities={"sampling": {}})
    assert status == 200, message
    assert message["result"]["content"][0]["text"] == "hi"
