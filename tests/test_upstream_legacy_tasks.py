"""The upstreams that run their own 2025-11-25 tasks, talked to directly (no proxy) with the mcp 1.x SDK client.

The fixture upstream's `--legacy-tasks` tools (tests/upstream/legacy_task_fixtures.py) must behave as the
2025-11-25 Tasks page describes (modelcontextprotocol.io/specification/2025-11-25/basic/utilities/tasks)
before the proxy is tested against them; the reference TypeScript server gets a smoke test over HTTP
and over stdio.
"""

from __future__ import annotations

from typing import Any

import mcp.types as mt
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.shared.context import RequestContext
from mcp.shared.exceptions import McpError

from tests.reference_server import EverythingServer
from tests.support.processes import Upstream
from tests.support.sdk import READ_TIMEOUT, Connection, connect, text
from tests.support.waiting import until

RELATED_TASK = "io.modelcontextprotocol/related-task"
TERMINAL = {"completed", "failed", "cancelled"}


async def status_reaches(conn: Connection, task_id: str, statuses: set[str]) -> mt.GetTaskResult:
    async def check() -> mt.GetTaskResult | None:
        task = await conn.tasks.get_task(task_id)
        return task if task.status in statuses else None

    result: mt.GetTaskResult = await until(check, f"task {task_id} in {statuses}")
    return result


# --- the fixture upstream with --legacy-tasks -------------------------------------------------------------


async def test_initialize_advertises_tasks_for_tools_call(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        capabilities = conn.init.capabilities.model_dump(exclude_none=True)
    assert capabilities["tasks"] == {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}


async def test_tools_list_declares_task_support(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        listed = {tool.name: tool for tool in (await conn.session.list_tools()).tools}
    modes = {name: tool.execution.taskSupport for name, tool in listed.items() if tool.execution}
    assert modes == {
        "legacy_task_required": "required",
        "legacy_task_optional": "optional",
        "legacy_task_elicit": "required",
        "legacy_task_tool_error": "required",
        "legacy_task_raises": "required",
    }
    assert all(listed[name].description for name in modes)
    assert "greet" in listed  # the ordinary fixture tools are still there


async def test_default_fixture_has_no_task_tools_or_capability(upstream: Upstream) -> None:
    async with connect(upstream.url) as conn:
        tools = (await conn.session.list_tools()).tools
        assert conn.init.capabilities.tasks is None
    assert not [tool.name for tool in tools if tool.name.startswith("legacy_task_") or tool.execution]


async def test_required_task_runs_to_completion_with_status_and_progress(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        created = await conn.tasks.call_tool_as_task(
            "legacy_task_required", {"seconds": 0.4}, ttl=60_000, meta={"progressToken": "p1"}
        )
        assert set(created.model_dump(by_alias=True, exclude_none=True)) == {"task"}  # nested, nothing else
        assert created.task.status == "working"
        assert created.task.ttl == 60_000
        assert created.task.pollInterval == 500
        task_id = created.task.taskId

        done = await status_reaches(conn, task_id, TERMINAL)
        assert done.status == "completed"
        result = await conn.tasks.get_task_result(task_id, mt.CallToolResult)
        assert text(result) == "done after 0.4s"
        assert result.isError is False
        assert result.meta == {RELATED_TASK: {"taskId": task_id}}

        progress = await until(lambda: _progress_of(conn, task_id), "four progress notifications")
        assert [note.params.progress for note in progress] == [1, 2, 3, 4]
        assert {note.params.progressToken for note in progress} == {"p1"}
        statuses = [note.params for note in conn.seen(mt.TaskStatusNotification) if note.params.taskId == task_id]
        assert [params.statusMessage for params in statuses][:4] == [f"step {n}/4" for n in range(1, 5)]
        assert statuses[-1].status == "completed"


async def _progress_of(conn: Connection, task_id: str) -> list[mt.ProgressNotification]:
    notes = conn.seen(mt.ProgressNotification)
    tagged = [note for note in notes if note.params.meta and note.params.meta.model_dump().get(RELATED_TASK)]
    mine = [note for note in tagged if note.params.meta.model_dump()[RELATED_TASK]["taskId"] == task_id]
    return mine if len(mine) == 4 else []


async def test_required_tool_without_task_is_method_not_found(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        with pytest.raises(McpError) as raised:
            await conn.session.call_tool("legacy_task_required", {})
    assert raised.value.error.code == mt.METHOD_NOT_FOUND


async def test_optional_tool_answers_inline_or_as_a_task(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        inline = await conn.session.call_tool("legacy_task_optional", {"seconds": 0})
        assert text(inline) == "optional done"
        created = await conn.tasks.call_tool_as_task("legacy_task_optional", {"seconds": 0.1})
        # tasks/result blocks until the task is terminal.
        result = await conn.tasks.get_task_result(created.task.taskId, mt.CallToolResult)
        assert text(result) == "optional done"
        assert (await conn.tasks.get_task(created.task.taskId)).status == "completed"


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (mt.ElicitResult(action="accept", content={"name": "Ann"}), "Hello, Ann!"),
        (mt.ElicitResult(action="decline"), "declined"),
    ],
)
async def test_elicitation_is_delivered_through_tasks_result(
    legacy_task_upstream: Upstream, answer: mt.ElicitResult, expected: str
) -> None:
    asked: list[mt.ElicitRequestParams] = []

    async def elicit(context: RequestContext[ClientSession, Any], params: mt.ElicitRequestParams) -> mt.ElicitResult:
        asked.append(params)
        return answer

    async with connect(legacy_task_upstream.url, elicit) as conn:
        task_id = (await conn.tasks.call_tool_as_task("legacy_task_elicit", {})).task.taskId
        await status_reaches(conn, task_id, {"input_required"})
        assert asked == []  # queued for the task: nothing reaches the client before it calls tasks/result

        result = await conn.tasks.get_task_result(task_id, mt.CallToolResult)
        assert text(result) == expected
        assert (await conn.tasks.get_task(task_id)).status == "completed"

    [params] = asked
    assert isinstance(params, mt.ElicitRequestFormParams)
    assert params.message == "What is your name?"
    assert params.requestedSchema["properties"] == {"name": {"type": "string"}}
    assert params.meta is not None
    assert params.meta.model_dump()[RELATED_TASK] == {"taskId": task_id}


async def test_cancel_marks_the_task_cancelled_once(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        task_id = (await conn.tasks.call_tool_as_task("legacy_task_required", {"seconds": 30})).task.taskId
        cancelled = await conn.tasks.cancel_task(task_id)
        assert cancelled.status == "cancelled"
        assert (await conn.tasks.get_task(task_id)).status == "cancelled"
        with pytest.raises(McpError) as again:
            await conn.tasks.cancel_task(task_id)
        assert again.value.error.code == mt.INVALID_PARAMS
        # The SDK answers tasks/result of a cancelled task with an empty result (only the related-task tag).
        payload = await conn.tasks.get_task_result(task_id, mt.GetTaskPayloadResult)
        assert payload.model_dump(by_alias=True, exclude_none=True) == {"_meta": {RELATED_TASK: {"taskId": task_id}}}


async def test_cancelling_leaves_the_session_usable(legacy_task_upstream: Upstream) -> None:
    async def elicit(context: RequestContext[ClientSession, Any], params: mt.ElicitRequestParams) -> mt.ElicitResult:
        raise AssertionError("the cancelled task must not ask anything")

    async with connect(legacy_task_upstream.url, elicit) as conn:
        short = (await conn.tasks.call_tool_as_task("legacy_task_tool_error", {"seconds": 0.3})).task.taskId
        waiting = (await conn.tasks.call_tool_as_task("legacy_task_elicit", {})).task.taskId
        await status_reaches(conn, waiting, {"input_required"})
        assert (await conn.tasks.cancel_task(short)).status == "cancelled"
        assert (await conn.tasks.cancel_task(waiting)).status == "cancelled"
        # This task ends after the cancelled short one would have: the session must still be there.
        later = (await conn.tasks.call_tool_as_task("legacy_task_required", {"seconds": 0.6})).task.taskId
        result = await conn.tasks.get_task_result(later, mt.CallToolResult)
        assert text(result) == "done after 0.6s"
        assert [(await conn.tasks.get_task(task)).status for task in (short, waiting)] == ["cancelled", "cancelled"]


@pytest.mark.parametrize(("sdk_default", "status"), [(False, "failed"), (True, "completed")])
async def test_tool_error_result_and_its_task_status(
    legacy_task_upstream: Upstream, sdk_default: bool, status: str
) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        task_id = (
            await conn.tasks.call_tool_as_task("legacy_task_tool_error", {"sdk_default": sdk_default})
        ).task.taskId
        done = await status_reaches(conn, task_id, TERMINAL)
        result = await conn.tasks.get_task_result(task_id, mt.CallToolResult)
    assert done.status == status  # 2025-11-25 says failed; the SDK on its own says completed
    assert result.isError is True
    assert text(result) == "tool failed"


async def test_raising_tool_fails_and_tasks_result_is_a_json_rpc_error(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        task_id = (await conn.tasks.call_tool_as_task("legacy_task_raises", {"seconds": 0.1})).task.taskId
        done = await status_reaches(conn, task_id, TERMINAL)
        with pytest.raises(McpError) as raised:
            await conn.tasks.get_task_result(task_id, mt.CallToolResult)
    assert done.status == "failed"
    assert done.statusMessage == "legacy_task_raises: simulated failure"
    assert raised.value.error.code == mt.INTERNAL_ERROR
    assert raised.value.error.message == "legacy_task_raises: simulated failure"


async def test_raising_tool_with_sdk_default_gives_an_empty_result(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as conn:
        task_id = (await conn.tasks.call_tool_as_task("legacy_task_raises", {"sdk_default": True})).task.taskId
        assert (await status_reaches(conn, task_id, TERMINAL)).status == "failed"
        payload = await conn.tasks.get_task_result(task_id, mt.GetTaskPayloadResult)
    assert payload.model_dump(by_alias=True, exclude_none=True) == {"_meta": {RELATED_TASK: {"taskId": task_id}}}


async def test_tasks_belong_to_the_session_that_created_them(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as owner, connect(legacy_task_upstream.url) as other:
        task_id = (await owner.tasks.call_tool_as_task("legacy_task_required", {"seconds": 0.1})).task.taskId
        with pytest.raises(McpError) as foreign:
            await other.tasks.get_task(task_id)
        assert foreign.value.error.code == mt.INVALID_PARAMS
        assert (await other.tasks.list_tasks()).tasks == []
        assert task_id in [task.taskId for task in (await owner.tasks.list_tasks()).tasks]


async def test_a_closed_session_does_not_stop_tasks_in_another(legacy_task_upstream: Upstream) -> None:
    async with connect(legacy_task_upstream.url) as survivor:
        async with connect(legacy_task_upstream.url) as leaving:
            await leaving.tasks.call_tool_as_task("legacy_task_required", {"seconds": 0})
        # `leaving` has sent DELETE and its server session ended.
        task_id = (await survivor.tasks.call_tool_as_task("legacy_task_required", {"seconds": 0.1})).task.taskId
        result = await survivor.tasks.get_task_result(task_id, mt.CallToolResult)
    assert text(result) == "done after 0.1s"


# --- the reference TypeScript server ------------------------------------------------------------------------


def _research_tool(tools: list[mt.Tool]) -> mt.Tool | None:
    return next((tool for tool in tools if tool.name == "simulate-research-query"), None)


async def test_everything_over_http_lists_a_task_required_tool(everything: EverythingServer) -> None:
    async with connect(everything.url) as conn:
        assert conn.init.serverInfo.name == "mcp-servers/everything"
        capabilities = conn.init.capabilities.model_dump(exclude_none=True)
        assert capabilities["tasks"] == {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}

        async def listed() -> mt.Tool | None:
            # Its task tool is registered when `notifications/initialized` arrives.
            return _research_tool((await conn.session.list_tools()).tools)

        tool: mt.Tool = await until(listed, "simulate-research-query in tools/list", timeout_seconds=5)
    assert tool.model_dump(exclude_none=True)["execution"] == {"taskSupport": "required"}
    assert set(tool.inputSchema["properties"]) == {"topic", "ambiguous"}


async def test_everything_over_stdio_lists_the_same_tool(everything_stdio_argv: list[str]) -> None:
    command, *args = everything_stdio_argv
    async with (
        stdio_client(StdioServerParameters(command=command, args=args)) as (read, write),
        ClientSession(read, write, READ_TIMEOUT) as session,
    ):
        init = await session.initialize()
        tool = _research_tool((await session.list_tools()).tools)
    assert init.serverInfo.name == "mcp-servers/everything"
    assert tool is not None
    assert tool.model_dump(exclude_none=True)["execution"] == {"taskSupport": "required"}
