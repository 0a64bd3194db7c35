"""End to end against a third-party stdio server: the reference `@modelcontextprotocol/server-everything` in
stdio mode, run by the proxy (`upstream.command`). A smoke flow for a 2026-07-28 client: the tool list, a
synchronous call, a task, and an elicitation inside a task answered with tasks/update.

The server asks `roots/list` 350 ms after `initialized` (the proxy declares roots): on a process nobody holds
alone that question is refused, on a lent one it is the call's; neither may disturb the flow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.support.clients import Tasks
from tests.support.processes import stdio_upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until
from tests.support.wire import DECLARING, TASKING, policies, result_text

SLOW_TOOL = "trigger-long-running-operation"
ELICITING_TOOL = "trigger-elicitation-request"


@pytest.fixture
async def everything(
    make_proxy: Callable[..., Any],
    everything_stdio_argv: list[str],
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> Tasks:
    tasks = policies(**{SLOW_TOOL: {"mode": "required"}, ELICITING_TOOL: {"mode": "required"}})
    client = await make_proxy("", upstream=stdio_upstream(everything_stdio_argv), tasks=tasks)
    return Tasks(client, modern_schema, tasks_schema)


async def tool_names(client: Tasks) -> set[str]:
    status, message = await client.post("tools/list", {}, capabilities={})
    assert status == 200, message
    return {tool["name"] for tool in message["result"]["tools"]}


async def test_list_call_task_and_elicitation(everything: Tasks) -> None:
    client = everything

    async def listed() -> set[str] | None:  # the eliciting tool is registered once `initialized` arrived
        names = await tool_names(client)
        return names if ELICITING_TOOL in names else None

    names = await until(listed, f"{ELICITING_TOOL} never listed")
    assert {"echo", SLOW_TOOL} <= names

    assert await client.text("echo", {"message": "hi"}) == "Echo: hi"

    task_id = await client.create(SLOW_TOOL, {"duration": 1, "steps": 2}, capabilities=DECLARING)
    done = await client.settled(task_id)
    assert done["status"] == "completed", done
    assert result_text(done) == "Long running operation completed. Duration: 1 seconds, Steps: 2."

    task_id = await client.create(ELICITING_TOOL, {}, capabilities=TASKING)
    asked = await client.until(task_id, lambda task: task["status"] != "working")
    assert asked["status"] == "input_required", asked
    [(key, question)] = asked["inputRequests"].items()
    assert question["method"] == "elicitation/create"
    assert "name" in question["params"]["requestedSchema"]["required"]
    answer = {key: {"action": "accept", "content": {"name": "Ada Lovelace"}}}
    status, _ = await client.post("tasks/update", {"taskId": task_id, "inputResponses": answer}, capabilities=TASKING)
    assert status == 200
    done = await client.settled(task_id)
    assert done["status"] == "completed", done
    text = result_text(done)
    assert "User provided the requested information" in text
    assert "Ada Lovelace" in text
