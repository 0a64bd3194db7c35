"""Task handles through real clients nobody here wrote (`tests/support/real_clients.py`): the mcp 1.x Python
client and the TypeScript SDK 1.x client (legacy era), the MCP Inspector CLI (`--protocol-era legacy`), and the
mcp 2.x Python client (2026-07-28, without the Tasks extension), each with its own 10 s request timeout.

A `handle` tool that works longer than the hold answers a handle within the hold + 1 s; `task_result` then gives
the tool's own result; the upstream ran it once; another principal gets "no such task"; `task_cancel` stops the
upstream call; a question asked mid-call is answered through `task_status` / `task_respond`. Over an HTTP upstream
(legacy clients through the pass-through), and over a stdio one (legacy clients through the proxy's own legacy
front). The Inspector's modern era declares Tasks: it sees none of it. The hold and the work are short here (a
hold of 1 s, or 3 s before stdio, and 2 s more of work) to keep the suite fast; the guide and the closing note of
the handles issue give the 20 s / 30 s figures.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.support.processes import Upstream, stdio_upstream
from tests.support.real_clients import (
    KINDS,
    Answer,
    InspectorCli,
    RealClient,
    as_call_tool_result,
    is_no_such_task,
    real_client,
)
from tests.support.waiting import until
from tests.upstream.handle_fixtures import story

Client = TestClient[web.Request, web.Application]

SYNTHESISED = {"task_status", "task_result", "task_cancel", "task_respond"}
ALICE = {"Authorization": "Bearer alice-token"}
BOB = {"Authorization": "Bearer bob-token"}
TOOLS = {"tools": {"long_report": {"without_tasks": "handle"}}}
# The hold: 1 s before an HTTP upstream; 3 s before a stdio one, whose server processes take a second or two to
# start on a busy machine (a call that could be asked a question runs on a process of its own, so a question
# comes only once that process runs). A tool that works 2 s longer than the hold answers a handle.
HOLDS_MS = {"http": 1000, "stdio": 3000}


@dataclass
class Proxied:
    url: str
    hold_ms: int

    @property
    def work_seconds(self) -> float:
        return self.hold_ms / 1000 + 2


# Every client over an HTTP upstream; over a stdio one (whose legacy clients the proxy's own front serves) all
# but the Inspector CLI, which opens a session, and so a server process, for each request.
PAIRS = [("http", kind) for kind in KINDS] + [("stdio", kind) for kind in KINDS if kind != "inspector"]


@pytest.fixture
async def proxied(request: pytest.FixtureRequest, make_proxy: Callable[..., Any], upstream: Upstream) -> Proxied:
    """A proxy with `long_report` as a `handle` tool, in front of the fixture over HTTP or over stdio."""
    hold_ms = HOLDS_MS[request.param]
    sections = {"tasks": TOOLS, "handles": {"hold_ms": hold_ms}}
    if request.param == "http":
        proxy: Client = await make_proxy(upstream.url, **sections)
    else:
        proxy = await make_proxy("", upstream=stdio_upstream(), **sections)
    return Proxied(str(proxy.make_url("/mcp")), hold_ms)


def new_key() -> str:
    return f"report-{uuid.uuid4().hex[:12]}"


async def handle_of(
    client: RealClient, proxied: Proxied, arguments: dict[str, Any], status: str | None = "working"
) -> Answer:
    """A call of `long_report` that answers a handle in `status` within the hold + 1 s (beyond what a client that
    connects for each request spends connecting)."""
    setup_ms = await client.setup_ms()
    answer = await client.call("long_report", arguments)
    assert answer.error is None, answer.error
    assert answer.elapsed_ms - setup_ms < proxied.hold_ms + 1000, (answer.elapsed_ms, setup_ms)
    as_call_tool_result(answer.result or {})  # a plain, valid tool result
    handle = answer.structured
    assert status is None or handle["status"] == status, handle
    assert handle["taskId"] in answer.text  # the text tells a model what to call next, with the id
    assert "task_result" in answer.text
    return answer


async def result_of(client: RealClient, task_id: str) -> Answer:
    """`task_result` until the task has settled (each call waits up to the hold for it)."""
    for _ in range(20):
        answer = await client.call("task_result", {"taskId": task_id})
        assert answer.error is None, answer.error
        structured = (answer.result or {}).get("structuredContent") or {}
        if structured.get("taskId") != task_id or structured.get("status") not in ("working", "input_required"):
            return answer
        assert structured["pollAfterSeconds"] >= 1
    raise AssertionError("the task never settled")


@pytest.mark.parametrize(("proxied", "kind"), PAIRS, indirect=["proxied"])
async def test_a_long_tool_answers_a_handle_then_its_own_result_and_runs_once(
    kind: str, proxied: Proxied, tmp_path: Path
) -> None:
    key = new_key()
    async with real_client(kind, proxied.url, ALICE, tmp_path) as client:
        tools = {tool["name"]: tool for tool in await client.list()}
        assert set(tools) >= SYNTHESISED
        assert all("outputSchema" not in tools[name] for name in SYNTHESISED)
        assert "outputSchema" not in tools["long_report"]  # a handle would not fit it
        handle = await handle_of(client, proxied, {"key": key, "seconds": proxied.work_seconds})
        result = await result_of(client, handle.structured["taskId"])
    report = result.structured
    assert (report["key"], report["runs"], report.get("approved")) == (key, 1, None)
    assert result.result is not None
    assert result.result.get("isError") in (False, None)
    assert key in result.text  # the tool's own text content too
    assert story(key) == ["started", "finished"]  # the upstream ran it once


@pytest.mark.parametrize(("proxied", "kind"), PAIRS, indirect=["proxied"])
async def test_another_principal_gets_no_such_task(kind: str, proxied: Proxied, tmp_path: Path) -> None:
    key = new_key()
    async with real_client(kind, proxied.url, ALICE, tmp_path) as alice:
        handle = await handle_of(alice, proxied, {"key": key, "seconds": proxied.work_seconds})
        task_id = handle.structured["taskId"]
        async with real_client(kind, proxied.url, BOB, tmp_path) as bob:
            answers = [
                await bob.call("task_status", {"taskId": task_id}),
                await bob.call("task_result", {"taskId": task_id, "wait_seconds": 0}),
                await bob.call("task_cancel", {"taskId": task_id}),
                await bob.call("task_respond", {"taskId": task_id, "inputResponses": {}}),
                await bob.call("task_status", {"taskId": "task_" + "A" * 32}),  # made up
                await bob.call("task_status", {"taskId": "../" + task_id}),  # malformed
            ]
        assert all(is_no_such_task(answer) for answer in answers), [answer.text for answer in answers]
        assert len({answer.text for answer in answers}) == 1  # nothing tells them apart
        result = await result_of(alice, task_id)  # bob's cancel stopped nothing
    assert result.structured["runs"] == 1
    assert story(key) == ["started", "finished"]


@pytest.mark.parametrize(("proxied", "kind"), PAIRS, indirect=["proxied"])
async def test_task_cancel_stops_the_upstream_call(kind: str, proxied: Proxied, tmp_path: Path) -> None:
    key = new_key()
    async with real_client(kind, proxied.url, ALICE, tmp_path) as client:
        handle = await handle_of(client, proxied, {"key": key, "seconds": 60})
        task_id = handle.structured["taskId"]
        await until(lambda: story(key) == ["started"], "the upstream never started the call")
        cancelled = await client.call("task_cancel", {"taskId": task_id})
        assert cancelled.structured["status"] == "cancelled", cancelled.text
        await until(lambda: story(key) == ["started", "cancelled"], f"the upstream call was not stopped: {story(key)}")
        result = await client.call("task_result", {"taskId": task_id})
    assert result.result is not None
    assert result.result["isError"] is True
    assert "cancelled" in result.text


@pytest.mark.parametrize(("proxied", "kind"), PAIRS, indirect=["proxied"])
async def test_a_question_mid_call_is_answered_through_the_task_tools(
    kind: str, proxied: Proxied, tmp_path: Path
) -> None:
    key = new_key()
    async with real_client(kind, proxied.url, ALICE, tmp_path) as client:
        # The question ends the hold at once (timed in test_flow_handles.py): the handle says the task waits for
        # an answer, unless the call's own server process started only after the hold (a stdio upstream on a
        # busy machine): then task_status shows the question once it is asked.
        handle = await handle_of(client, proxied, {"key": key, "seconds": 0.2, "ask": True}, status=None)
        task_id = handle.structured["taskId"]

        async def asked() -> Answer | None:
            status = await client.call("task_status", {"taskId": task_id})
            return status if status.structured["status"] == "input_required" else None

        status = await until(asked, "the task never showed the question")
        questions = status.structured["inputRequests"]
        [(question_key, question)] = questions.items()
        assert question["method"] == "elicitation/create"
        assert question["params"]["message"] == f"Approve report {key}?"
        responded = await client.call(
            "task_respond",
            {"taskId": task_id, "inputResponses": {question_key: {"action": "accept", "content": {"approve": True}}}},
        )
        assert responded.structured["answered"] == [question_key], responded.text
        result = await result_of(client, task_id)
    assert (result.structured["key"], result.structured["approved"]) == (key, True)
    assert story(key) == ["started", "asked", "answered", "finished"]


async def test_the_inspectors_modern_era_declares_tasks_and_sees_no_handles(
    make_proxy: Callable[..., Any], upstream: Upstream, tmp_path: Path
) -> None:
    """The Inspector CLI's modern era declares the Tasks extension: no synthesised tools in its list, the tool's
    own `outputSchema` kept, and the long call is a task it follows itself, ending with the tool's result."""
    proxy: Client = await make_proxy(upstream.url, tasks=TOOLS, handles={"hold_ms": 1000})
    inspector = InspectorCli(str(proxy.make_url("/mcp")), ALICE, tmp_path, era="modern")
    tools = {tool["name"]: tool for tool in await inspector.list()}
    assert not SYNTHESISED & set(tools)
    assert "outputSchema" in tools["long_report"]
    key = new_key()
    answer = await inspector.call("long_report", {"key": key, "seconds": 1.5})
    assert answer.error is None, answer.error
    assert answer.structured == {"key": key, "runs": 1, "approved": None}
    assert story(key) == ["started", "finished"]
