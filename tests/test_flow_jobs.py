"""A legacy job family (start_render / render_status / render_result / cancel_render, tests/upstream/job_fixtures.py)
served as one tool whose call is a native task (`jobs:` config): the proxy reads the job id from the start
tool's answer, polls the status tool, and ends the task as the mapped state says, with the result tool's answer.
Tasks extension: a declaring client gets a task, any other the job's final result on its request.
"""

from __future__ import annotations

from typing import Any

from tests.support.clients import ClientFactory, Tasks
from tests.support.jobs import render_job, render_stats
from tests.support.wire import HEADERS, INITIALIZE, read_messages, result_text

RUNNING = "running"


async def jobs_client(tasks_client: ClientFactory, **job: Any) -> Tasks:
    return await tasks_client(jobs=render_job(**job))


async def test_a_job_is_one_task_whose_progress_shows_and_whose_result_is_the_result_tools_answer(
    tasks_client: ClientFactory,
) -> None:
    client = await jobs_client(tasks_client)
    before = await render_stats(client)
    task_id = await client.create("start_render", {"seconds": 1.5})
    working = await client.until(task_id, lambda task: str(task.get("statusMessage", "")).endswith("%"))
    assert working["status"] == "working"
    done = await client.settled(task_id)
    assert done["status"] == "completed", done
    assert result_text(done).startswith("rendered render-")
    assert done["result"]["structuredContent"]["frames"] == 24
    after = await render_stats(client)
    assert after["starts"] == before["starts"] + 1  # started once; the client polled the proxy, not the job
    assert after["status_calls"] > before["status_calls"]


async def test_an_id_answered_as_json_text_is_read_through_json(tasks_client: ClientFactory) -> None:
    client = await jobs_client(tasks_client)
    task_id = await client.create("start_render", {"seconds": 0.3, "answer": "text"})
    done = await client.settled(task_id)
    assert done["status"] == "completed", done
    assert result_text(done).startswith("rendered render-")


async def test_a_failed_job_fails_the_task_with_its_error_message(tasks_client: ClientFactory) -> None:
    client = await jobs_client(tasks_client)
    task_id = await client.create("start_render", {"seconds": 0.3, "outcome": "failed"})
    done = await client.settled(task_id)
    assert done["status"] == "failed", done
    assert done["error"]["message"].endswith(": out of memory")


async def test_a_job_cancelled_upstream_ends_the_task_cancelled(tasks_client: ClientFactory) -> None:
    client = await jobs_client(tasks_client)
    task_id = await client.create("start_render", {"seconds": 0.3, "outcome": "cancelled"})
    done = await client.settled(task_id)
    assert done["status"] == "cancelled", done


async def test_tasks_cancel_calls_the_cancel_tool_and_the_task_ends_cancelled(tasks_client: ClientFactory) -> None:
    client = await jobs_client(tasks_client)
    before = await render_stats(client)
    task_id = await client.create("start_render", {"seconds": 30})
    await client.until(task_id, lambda task: str(task.get("statusMessage", "")).endswith("%"))
    status, message = await client.post("tasks/cancel", {"taskId": task_id})
    assert status == 200, message
    done = await client.settled(task_id)
    assert done["status"] == "cancelled", done
    after = await render_stats(client)
    assert after["cancels"] == before["cancels"] + 1


async def test_a_status_tool_that_errors_now_and_then_is_polled_again_until_the_job_ends(
    tasks_client: ClientFactory,
) -> None:
    client = await jobs_client(tasks_client)
    task_id = await client.create("start_render", {"seconds": 0.5, "flaky": True})
    done = await client.settled(task_id, timeout_seconds=20)
    assert done["status"] == "completed", done


async def test_a_client_without_the_tasks_extension_gets_the_final_result_on_its_request(
    tasks_client: ClientFactory,
) -> None:
    client = await jobs_client(tasks_client)
    status, message = await client.call("start_render", {"seconds": 0.5}, capabilities={})
    assert status == 200, message
    result = message["result"]
    assert result["resultType"] == "complete", result
    assert result["content"][0]["text"].startswith("rendered render-")


async def test_a_start_tool_answer_without_an_id_fails_the_call_with_that_answer(tasks_client: ClientFactory) -> None:
    client = await jobs_client(tasks_client, job_id="structuredContent.missing")
    status, message = await client.call("start_render", {"seconds": 0.3})
    assert status == 200, message
    error = message["error"]
    assert "no job id at `structuredContent.missing`" in error["message"]
    assert error["data"]["result"]["structuredContent"]["job_id"].startswith("render-")


async def test_a_start_tool_error_is_the_calls_answer(tasks_client: ClientFactory) -> None:
    client = await jobs_client(tasks_client)
    status, message = await client.call("start_render", {"seconds": -1})  # refused by the tool's schema
    assert status == 200, message
    assert message["result"]["isError"] is True, message


async def test_hidden_helpers_are_left_out_of_a_modern_clients_tools_list(tasks_client: ClientFactory) -> None:
    client = await jobs_client(tasks_client)
    status, message = await client.post("tools/list", {})
    assert status == 200, message
    names = {tool["name"] for tool in message["result"]["tools"]}
    assert "start_render" in names
    assert not {"render_status", "render_result", "cancel_render"} & names
    shown = await jobs_client(tasks_client, hide_helpers=False)
    status, message = await shown.post("tools/list", {})
    assert {"render_status", "render_result", "cancel_render"} <= {tool["name"] for tool in message["result"]["tools"]}


async def test_a_legacy_client_passes_through_untouched_and_sees_every_tool(tasks_client: ClientFactory) -> None:
    http = (await jobs_client(tasks_client)).client
    response = await http.post("/mcp", json=INITIALIZE, headers=HEADERS)
    assert response.status == 200
    session = {**HEADERS, "Mcp-Session-Id": response.headers["Mcp-Session-Id"]}
    await read_messages(response)
    initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    assert (await http.post("/mcp", json=initialized, headers=session)).status == 202
    listing = {"jsonrpc": "2.0", "id": 2, "method": "tools/list", "params": {}}
    [answer] = await read_messages(await http.post("/mcp", json=listing, headers=session))
    names = {tool["name"] for tool in answer["result"]["tools"]}
    assert {"start_render", "render_status", "render_result", "cancel_render"} <= names


async def test_a_state_the_config_does_not_map_keeps_the_task_working_and_shows_in_its_status_message(
    tasks_client: ClientFactory,
) -> None:
    unmapped = {"done": "completed", "failed": "failed", "cancelled": "cancelled"}  # no `running`
    job = render_job()["start_render"]
    client = await jobs_client(tasks_client, status={**job["status"], "states": unmapped})
    task_id = await client.create("start_render", {"seconds": 1.5})
    working = await client.until(task_id, lambda task: str(task.get("statusMessage", "")).startswith("running: "))
    assert working["status"] == "working"
    assert working["statusMessage"].endswith("%")
    done = await client.settled(task_id)
    assert done["status"] == "completed", done
