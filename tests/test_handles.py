"""proxy/front/handles/tools.py: the synthesised tools' names and definitions, a tools/list page for a client without
the Tasks extension, the arguments read before any store is asked, and the answers a model reads. Pure."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from proxy.config.schema import TasksConfig
from proxy.front.handles import tools
from proxy.wire.jsonrpc import RawJSON
from proxy.wire.tasks import TaskRecord, TaskStatus, new_task_id

TASKS = TasksConfig.model_validate(
    {
        "tools": {
            "slow": {"without_tasks": "handle"},
            "never": {"without_tasks": "handle", "mode": "forbidden"},
            "quick": {},
        }
    }
)
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}}


def tool(name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "inputSchema": {"type": "object"}, "outputSchema": SCHEMA, **extra}


def record(status: TaskStatus = TaskStatus.WORKING, **fields: Any) -> TaskRecord:
    values: dict[str, Any] = {
        "task_id": new_task_id(),
        "principal": "p",
        "tool": "slow",
        "status": status,
        "created_at_ms": 1_800_000_000_000,
        "updated_at_ms": 1_800_000_000_500,
        "ttl_ms": 60_000,
        "poll_interval_ms": 2500,
        "owner": "me",
        "on_restart": "fail",
        "request": {},
        **fields,
    }
    return TaskRecord(**values)


def test_the_prefix_names_the_tools_and_only_those_are_recognised() -> None:
    names = tools.names("proxy_")
    assert names.all == ("proxy_task_status", "proxy_task_result", "proxy_task_cancel", "proxy_task_respond")
    assert names.base_of("proxy_task_result") == "task_result"
    assert names.base_of("task_result") is None
    assert names.base_of("proxy_task_other") is None
    assert names.base_of(None) is None
    assert tools.names("").base_of("task_cancel") == "task_cancel"


def test_definitions_declare_no_output_schema_and_require_the_task_id() -> None:
    defined = tools.definitions(tools.names("x_"), 20_000)
    assert [tool["name"] for tool in defined] == list(tools.names("x_").all)
    for definition in defined:
        assert "outputSchema" not in definition
        assert "taskId" in definition["inputSchema"]["required"]
        assert definition["description"]
    respond = defined[-1]
    assert respond["inputSchema"]["required"] == ["taskId", "inputResponses"]
    assert "20 s" in defined[1]["description"]  # task_result says how long it waits at most


def test_the_last_page_gets_the_task_tools_and_handle_tools_lose_their_output_schema() -> None:
    names = tools.names("")
    page = {"tools": [tool("slow"), tool("quick"), tool("never"), tool("never", execution={"taskSupport": "required"})]}
    listed, clashes = tools.listed(page, TASKS, names, 1000)
    assert clashes == []
    slow, quick, never, required = listed["tools"][:4]
    assert "outputSchema" not in slow
    assert quick["outputSchema"] == SCHEMA  # not a handle tool
    assert never["outputSchema"] == SCHEMA  # forbidden: always held
    assert "outputSchema" not in required  # ... unless the upstream runs it only as a task
    assert [tool["name"] for tool in listed["tools"][4:]] == list(names.all)
    assert page["tools"][0]["outputSchema"] == SCHEMA  # the upstream's page is not changed


def test_a_page_with_a_next_cursor_gets_no_task_tools() -> None:
    listed, _ = tools.listed({"tools": [tool("slow")], "nextCursor": "2"}, TASKS, tools.names(""), 1000)
    assert [tool["name"] for tool in listed["tools"]] == ["slow"]
    assert listed["nextCursor"] == "2"


def test_an_upstream_tool_of_a_synthesised_name_is_left_out_and_named() -> None:
    listed, clashes = tools.listed({"tools": [tool("task_status")]}, TASKS, tools.names(""), 1000)
    assert clashes == ["task_status"]
    assert [tool["name"] for tool in listed["tools"]].count("task_status") == 1
    assert "outputSchema" not in listed["tools"][0]  # the proxy's own


@pytest.mark.parametrize(
    ("arguments", "valid"),
    [
        ({"taskId": "task_" + "a" * 32}, True),
        ({"taskId": "task_" + "-_" * 16}, True),
        ({"taskId": "task_" + "a" * 31}, False),
        ({"taskId": "task_" + "a" * 33}, False),
        ({"taskId": "task_" + "a" * 31 + "/"}, False),
        ({"taskId": "task_" + "a" * 31 + "\n"}, False),
        ({"taskId": 7}, False),
        ({}, False),
        (["task_" + "a" * 32], False),
        (None, False),
    ],
)
def test_only_ids_of_the_shape_the_proxy_mints_are_looked_up(arguments: Any, valid: bool) -> None:
    assert (tools.task_id_of(arguments) is not None) is valid


def test_every_minted_id_has_that_shape() -> None:
    assert all(tools.task_id_of({"taskId": new_task_id()}) is not None for _ in range(1000))


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 20.0), (5, 5.0), (2.5, 2.5), (60, 20.0), (-1, 0.0), (0, 0.0), ("5", None), (True, None), (math.inf, None)],
)
def test_task_result_waits_the_smaller_of_its_wait_and_the_hold(value: Any, seconds: float | None) -> None:
    arguments = {} if value is None else {"wait_seconds": value}
    assert tools.wait_seconds_of(arguments, 20_000) == seconds


def test_a_completed_task_answers_its_own_tool_result_as_it_was() -> None:
    own = {"content": [{"type": "text", "text": "done"}], "structuredContent": {"n": 1}, "isError": True}
    stored = RawJSON(json.dumps({**own, "resultType": "complete"}))
    assert tools.outcome_result(record(TaskStatus.COMPLETED, result=stored)) == own


@pytest.mark.parametrize("status", [TaskStatus.FAILED, TaskStatus.CANCELLED])
def test_a_failed_or_cancelled_task_is_an_error_result_saying_so(status: TaskStatus) -> None:
    error = {"code": -32603, "message": "boom"} if status is TaskStatus.FAILED else None
    answer = tools.outcome_result(record(status, error=error, status_message="why not"))
    assert answer["isError"] is True
    assert status.value in answer["content"][0]["text"]
    assert "why not" in answer["content"][0]["text"]
    assert answer["structuredContent"]["status"] == status.value


def test_a_handle_tells_a_model_what_to_call_next_and_when() -> None:
    working = record()
    handle = tools.handle_result(working, tools.names("p_"), 20_000)
    said = handle["content"][0]["text"]
    assert f'p_task_result with {{"taskId": "{working.task_id}"}}' in said
    assert "20 s" in said
    assert "p_task_status" in said
    assert "p_task_cancel" in said
    assert handle["isError"] is False
    assert handle["structuredContent"]["pollAfterSeconds"] == math.ceil(2500 / 1000)
    assert handle["structuredContent"]["taskId"] == working.task_id
    question = {"method": "elicitation/create", "params": {"mode": "form", "message": "Go on?"}}
    waiting = record(TaskStatus.INPUT_REQUIRED, input_requests={"elicitation-1": question})
    asked = tools.handle_result(waiting, tools.names("p_"), 20_000)
    assert asked["structuredContent"]["inputRequests"] == {"elicitation-1": question}
    assert 'elicitation-1 (elicitation/create: "Go on?")' in asked["content"][0]["text"]
    assert "p_task_respond" in asked["content"][0]["text"]


def test_a_status_never_carries_the_result() -> None:
    done = record(TaskStatus.COMPLETED, result=RawJSON('{"content":[]}'))
    status = tools.status_result(done, tools.names(""))
    assert "result" not in status["structuredContent"]
    assert "pollAfterSeconds" not in status["structuredContent"]  # it has settled
    assert "task_result" in status["content"][0]["text"]


def test_a_legacy_body_is_read_only_when_it_may_concern_the_handles() -> None:
    def call(name: str) -> bytes:
        return json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name}}).encode()

    plain, prefixed = tools.served(TASKS, ""), tools.served(TASKS, "p_")
    assert tools.may_concern(call("slow"), plain)
    assert tools.may_concern(call("task_result"), plain)
    assert not tools.may_concern(call("quick"), plain)  # relayed unread, as without handles
    assert not tools.may_concern(call("task_result"), prefixed)  # not a synthesised name under that prefix
    assert tools.may_concern(call("p_task_result"), prefixed)
    assert tools.may_concern(b'{"jsonrpc":"2.0","id":1,"method":"tools/list"}', plain)
    assert not tools.may_concern(b'{"jsonrpc":"2.0","id":1,"method":"prompts/list"}', plain)
    # The tool's name after an argument called "name", and the method after the params: still found.
    late = b'{"params":{"arguments":{"name":"x"},"name":"slow"},"id":1,"jsonrpc":"2.0","method":"tools/call"}'
    assert tools.may_concern(late, plain)
    every = tools.served(TasksConfig.model_validate({"tools": {"slow_*": {"without_tasks": "handle"}}}), "")
    assert tools.may_concern(call("anything"), every)  # a glob: any call may be one
    assert every.may_serve("anything")
    assert not plain.may_serve("quick")
