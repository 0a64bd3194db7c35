"""End to end: input bridging. A legacy server's mid-call questions (elicitation, sampling, roots) reach a
2026-07-28 client as a task's `inputRequests` answered with `tasks/update` (the Tasks extension), or as MRTR
rounds of a synchronous request retried with `inputResponses` + `requestState` (basic/patterns/mrtr), in front
of the real mcp 1.x fixture upstream (imperative `ctx.elicit(...)` style). Every message is schema-checked by the
`Tasks` client.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import structlog.testing
from prometheus_client.parser import text_string_to_metric_families

from proxy.tasks.machine.state import MAX_OUTSTANDING_INPUTS
from tests.support.clients import ClientFactory, Tasks
from tests.support.ops import scrape
from tests.support.processes import Upstream, key_file
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until
from tests.support.wire import DECLARING, policies, result_text

ELICIT: dict[str, Any] = {"elicitation": {}}
EVERY_INPUT: dict[str, Any] = {"elicitation": {}, "sampling": {}, "roots": {}}
TASKING: dict[str, Any] = {**EVERY_INPUT, **DECLARING}
SAMPLED = {"role": "assistant", "content": {"type": "text", "text": "42"}, "model": "m", "stopReason": "endTurn"}


def accept(**content: Any) -> dict[str, Any]:
    return {"action": "accept", "content": content}


def content_text(result: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in result["content"])


async def input_required(client: Tasks, task_id: str, keys: int = 1) -> dict[str, Any]:
    return await client.until(
        task_id, lambda task: task["status"] == "input_required" and len(task["inputRequests"]) >= keys
    )


async def update(client: Tasks, task_id: str, responses: dict[str, Any]) -> dict[str, Any]:
    status, message = await client.post("tasks/update", {"taskId": task_id, "inputResponses": responses})
    assert status == 200, message
    return message


async def cancelled_upstream_calls(client: Tasks) -> int:
    return len(json.loads(await client.text("cancelled_requests", {})))


async def wait_for_cancellations(client: Tasks, count: int) -> None:

    async def seen() -> bool:
        return await cancelled_upstream_calls(client) >= count

    await until(seen, "the upstream never saw notifications/cancelled")


# --- inside a task -----------------------------------------------------------------------------------------


async def test_one_elicitation_in_a_task(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(ask_name={"mode": "required"}))
    with structlog.testing.capture_logs() as events:
        task_id = await client.create("ask_name", capabilities=TASKING)
        task = await input_required(client, task_id)
    [(key, request)] = task["inputRequests"].items()
    assert key == "elicitation-1"  # minted by the proxy, never the upstream's JSON-RPC id
    [logged] = [event for event in events if event["event"] == "task_input_required"]
    assert logged["task_id"] == task_id
    assert logged["keys"] == ["elicitation-1"]
    assert logged["methods"] == ["elicitation/create"]
    assert request["method"] == "elicitation/create"
    assert request["params"]["message"] == "What is your name?"
    assert request["params"]["mode"] == "form"
    assert request["params"]["requestedSchema"]["properties"] == {"name": {"type": "string"}}
    assert "id" not in request
    assert "jsonrpc" not in request
    message = await update(client, task_id, {key: accept(name="Ada")})
    assert message["result"]["resultType"] == "complete"  # an empty ack
    done = await client.settled(task_id)
    assert done["status"] == "completed"  # the same upstream call continued
    assert result_text(done) == "Hello, Ada"
    assert "inputRequests" not in done


async def test_two_concurrent_elicitations_answered_one_at_a_time(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(multi_input={"mode": "required"}), inputs={"gather_ms": 300})
    task_id = await client.create("multi_input", capabilities=TASKING)
    task = await client.until(task_id, lambda task: task["status"] == "input_required")
    requests = task["inputRequests"]
    assert sorted(requests) == ["elicitation-1", "elicitation-2"]  # both outstanding, gathered together
    by_field = {next(iter(r["params"]["requestedSchema"]["properties"])): key for key, r in requests.items()}
    await update(client, task_id, {by_field["name"]: accept(name="Ada"), "never-issued": accept(name="x")})
    partial = await client.until(task_id, lambda task: list(task.get("inputRequests", {})) == [by_field["color"]])
    assert partial["status"] == "input_required"  # a partial answer: the rest stays pending
    # An already answered key is ignored (and acked); the outstanding one resumes the call.
    await update(client, task_id, {by_field["name"]: accept(name="Eve"), by_field["color"]: accept(color="blue")})
    done = await client.settled(task_id)
    assert result_text(done) == "name=Ada; color=blue"


async def test_sampling_and_roots_in_a_task(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(sample={"mode": "required"}, list_roots={"mode": "required"}))
    sampled = await client.create("sample", {"prompt": "What is six times seven?"}, capabilities=TASKING)
    task = await input_required(client, sampled)
    [(key, request)] = task["inputRequests"].items()
    assert key == "sampling-1"
    assert request["method"] == "sampling/createMessage"
    assert request["params"]["messages"][0]["content"]["text"] == "What is six times seven?"
    assert request["params"]["maxTokens"] == 100
    await update(client, sampled, {key: SAMPLED})
    assert result_text(await client.settled(sampled)) == "42"

    rooted = await client.create("list_roots", capabilities=TASKING)
    task = await input_required(client, rooted)
    assert task["inputRequests"] == {"roots-1": {"method": "roots/list"}}
    await update(client, rooted, {"roots-1": {"roots": [{"uri": "file:///work", "name": "work"}]}})
    assert result_text(await client.settled(rooted)) == "file:///work"


async def test_keys_are_never_reused_over_a_tasks_life(tasks_client: ClientFactory) -> None:
    """A second question after the first was answered gets a new key."""
    client = await tasks_client(tasks=policies(test_input_required_result_multi_round={"mode": "required"}))
    task_id = await client.create("test_input_required_result_multi_round", capabilities=TASKING)
    first = await input_required(client, task_id)
    assert list(first["inputRequests"]) == ["elicitation-1"]
    await update(client, task_id, {"elicitation-1": accept(name="Ada")})
    second = await client.until(task_id, lambda task: "elicitation-2" in task.get("inputRequests", {}))
    assert list(second["inputRequests"]) == ["elicitation-2"]
    assert "color" in json.dumps(second["inputRequests"]["elicitation-2"])
    await update(client, task_id, {"elicitation-1": accept(color="red"), "elicitation-2": accept(color="blue")})
    assert result_text(await client.settled(task_id)) == "Multi-round complete for Ada who likes blue"


async def test_an_undeclared_capability_is_refused_upstream_and_nothing_hangs(tasks_client: ClientFactory) -> None:
    """Only questions the creating request's clientCapabilities cover become inputRequests; the
    upstream gets its answer at once (an elicitation is declined) and finishes the call."""
    client = await tasks_client(tasks=policies(ask_name={"mode": "required"}, sample={"mode": "required"}))
    declined = await client.create("ask_name", capabilities={**DECLARING, "sampling": {}})
    done = await client.settled(declined)
    assert done["status"] == "completed"
    assert result_text(done) == "No name given (action=decline)"
    refused = await client.create("sample", {"prompt": "hi"}, capabilities={**DECLARING, **ELICIT})
    assert (await client.settled(refused))["status"] in ("completed", "failed")  # the upstream decides; it ends
    metrics = await scrape(client.client.app)
    counts = {
        (sample.labels["method"], sample.labels["outcome"]): sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "mcp_tasks_proxy_input_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
    }
    assert counts[("elicitation/create", "refused")] == 1
    assert counts[("sampling/createMessage", "refused")] == 1


async def test_the_upstreams_ping_is_answered_inside_a_task(tasks_client: ClientFactory) -> None:
    """A ping is not a question: the proxy answers it and the task never shows it."""
    client = await tasks_client(tasks=policies(ping_client={"mode": "required"}))
    task_id = await client.create("ping_client", capabilities=TASKING)
    done = await client.settled(task_id)
    assert result_text(done) == "pong answered"


async def test_a_question_on_the_get_stream_belongs_to_the_one_open_call(tasks_client: ClientFactory) -> None:
    """The mcp 1.x SDK's `list_roots()` names no request and goes out on the session's GET stream. With
    one call open on the session it is that call's question, in a task and in a synchronous request alike."""
    client = await tasks_client(tasks=policies(list_roots_standalone={"mode": "required"}))
    task_id = await client.create("list_roots_standalone", capabilities=TASKING)
    task = await input_required(client, task_id)
    assert task["inputRequests"] == {"roots-1": {"method": "roots/list"}}
    await update(client, task_id, {"roots-1": {"roots": [{"uri": "file:///work"}]}})
    assert result_text(await client.settled(task_id)) == "file:///work"

    client = await tasks_client()
    params: dict[str, Any] = {"name": "list_roots_standalone", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params, capabilities=EVERY_INPUT)
    requests, state = round_one(message)
    retry = {**params, "inputResponses": {key: {"roots": []} for key in requests}, "requestState": state}
    _, message = await mrtr(client, "tools/call", retry, capabilities=EVERY_INPUT)
    assert content_text(message["result"]) == ""


async def test_url_elicitation_drops_the_legacy_id_and_needs_the_url_capability(tasks_client: ClientFactory) -> None:
    """`elicitationId` does not exist in 2026-07-28; URL mode needs the client to declare `elicitation.url`."""
    client = await tasks_client(tasks=policies(ask_url={"mode": "required"}))
    task_id = await client.create("ask_url", capabilities={**DECLARING, "elicitation": {"url": {}}})
    task = await input_required(client, task_id)
    [(key, request)] = task["inputRequests"].items()
    assert request["params"] == {
        "mode": "url",
        "message": "Open the page to give consent",
        "url": "https://consent.example/flow",
    }
    await update(client, task_id, {key: {"action": "accept"}})
    assert result_text(await client.settled(task_id)) == "url elicitation: action=accept"
    form_only = await client.create("ask_url", capabilities=TASKING)
    assert result_text(await client.settled(form_only)) == "url elicitation: action=decline"


async def test_an_invalid_answer_is_minus_32602_and_the_question_stays(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks=policies(ask_name={"mode": "required"}))
    task_id = await client.create("ask_name", capabilities=TASKING)
    await input_required(client, task_id)
    status, message = await client.post(
        "tasks/update", {"taskId": task_id, "inputResponses": {"elicitation-1": {"action": "maybe"}}}
    )
    assert status == 400
    assert message["error"]["code"] == -32602
    assert "inputResponses.elicitation-1" in message["error"]["message"]
    assert (await client.task(task_id))["status"] == "input_required"
    await update(client, task_id, {"elicitation-1": {"action": "cancel"}})
    assert result_text(await client.settled(task_id)) == "No name given (action=cancel)"


async def test_cancel_while_input_required(tasks_client: ClientFactory, own_upstream: Upstream) -> None:
    client = await tasks_client(own_upstream.url, tasks=policies(ask_name={"mode": "required"}))
    task_id = await client.create("ask_name", capabilities=TASKING)
    await input_required(client, task_id)
    status, _ = await client.post("tasks/cancel", {"taskId": task_id})
    assert status == 200
    task = await client.task(task_id)
    assert task["status"] == "cancelled"
    assert "inputRequests" not in task
    await wait_for_cancellations(client, 1)  # the parked upstream call was told (notifications/cancelled)
    status, _ = await client.post("tasks/update", {"taskId": task_id, "inputResponses": {"elicitation-1": {}}})
    assert status == 200  # still an ack; nothing to deliver


async def test_an_upstream_asking_too_much_at_once_is_refused_beyond_the_limit(tasks_client: ClientFactory) -> None:
    """At most MAX_OUTSTANDING_INPUTS open questions per call: the rest are declined upstream at once."""
    client = await tasks_client(tasks=policies(ask_many={"mode": "required"}), inputs={"gather_ms": 1000})
    task_id = await client.create("ask_many", {"count": MAX_OUTSTANDING_INPUTS + 2}, capabilities=TASKING)
    task = await input_required(client, task_id, keys=MAX_OUTSTANDING_INPUTS)
    assert len(task["inputRequests"]) == MAX_OUTSTANDING_INPUTS
    await update(client, task_id, {key: accept(ok=True) for key in task["inputRequests"]})
    done = await client.settled(task_id)
    assert result_text(done) == f"accepted={MAX_OUTSTANDING_INPUTS} declined=2"


async def test_a_task_waiting_for_input_holds_no_running_slot(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks={**policies(ask_name={"mode": "required"}), "max_running": 1})
    parked = await client.create("ask_name", capabilities=TASKING)
    await input_required(client, parked)
    other = await client.create("ask_name", capabilities=TASKING)  # not refused: the first one waits for input
    await input_required(client, other)
    for task_id in (parked, other):
        await update(client, task_id, {"elicitation-1": accept(name="Ada")})
        assert result_text(await client.settled(task_id)) == "Hello, Ada"


async def test_a_question_during_the_window_makes_the_call_a_task_at_once(tasks_client: ClientFactory) -> None:
    """A declaring client and an optional tool: the question goes to the task, whatever is left of the window."""
    client = await tasks_client(tasks=policies(ask_name={"mode": "optional", "sync_window_ms": 60_000}))
    task_id = await asyncio.wait_for(client.create("ask_name", capabilities=TASKING), 20)
    task = await client.task(task_id)  # readable at once, with the question already in it
    assert task["status"] == "input_required"
    assert list(task["inputRequests"]) == ["elicitation-1"]


async def test_a_rerun_after_restart_asks_again_under_a_new_key(
    make_proxy: Callable[..., Any],
    own_upstream: Upstream,
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
    tmp_path: Any,
) -> None:
    """Keys stay unique across a re-run (the count of issued keys is stored); the creating request's
    capabilities are stored too, so the re-run's question is relayed."""
    sections = {
        "store": {"path": str(tmp_path / "inputs.db")},
        "security": {"key_file": key_file(tmp_path)},
        "tasks": policies(ask_name={"mode": "required", "on_restart": "rerun"}),
    }
    first = Tasks(await make_proxy(own_upstream.url, **sections), modern_schema, tasks_schema)
    task_id = await first.create("ask_name", capabilities=TASKING)
    await input_required(first, task_id)
    await first.client.close()
    second = Tasks(await make_proxy(own_upstream.url, **sections), modern_schema, tasks_schema)
    task = await second.until(task_id, lambda task: "elicitation-2" in task.get("inputRequests", {}))
    assert list(task["inputRequests"]) == ["elicitation-2"]
    await update(second, task_id, {"elicitation-1": accept(name="Old"), "elicitation-2": accept(name="New")})
    assert result_text(await second.settled(task_id)) == "Hello, New"


# --- synchronous requests: MRTR ------------------------------------------------------------------------------


async def mrtr(
    client: Tasks,
    method: str,
    params: dict[str, Any],
    *,
    capabilities: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    return await client.post(
        method, params, capabilities=ELICIT if capabilities is None else capabilities, headers=headers
    )


def round_one(message: dict[str, Any]) -> tuple[dict[str, Any], str]:
    result = message["result"]
    assert result["resultType"] == "input_required", message
    assert "taskId" not in result
    state = result["requestState"]
    assert isinstance(state, str)
    assert state
    return result["inputRequests"], state


async def test_sync_mrtr_round_trip_over_two_rounds(tasks_client: ClientFactory) -> None:
    client = await tasks_client()
    params: dict[str, Any] = {"name": "test_input_required_result_multi_round", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params)
    requests, state = round_one(message)
    assert list(requests) == ["elicitation-1"]
    assert "Step 1" in requests["elicitation-1"]["params"]["message"]

    retry = {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": state}
    _, message = await mrtr(client, "tools/call", retry)
    requests, second_state = round_one(message)  # the upstream asked again: another round
    assert list(requests) == ["elicitation-2"]
    assert second_state != state

    final = {**params, "inputResponses": {"elicitation-2": accept(color="blue")}, "requestState": second_state}
    status, message = await mrtr(client, "tools/call", final)
    assert status == 200
    assert message["result"]["resultType"] == "complete"
    assert content_text(message["result"]) == "Multi-round complete for Ada who likes blue"

    status, replayed = await mrtr(client, "tools/call", retry)  # a requestState is single use
    assert status == 400
    assert replayed["error"]["code"] == -32602
    assert "already used" in replayed["error"]["message"]


async def test_a_tampered_or_foreign_request_state_is_refused(tasks_client: ClientFactory) -> None:
    """Integrity, principal, method and params binding of `requestState`; each failure is -32602 and the call stays
    parked for its genuine retry."""
    client = await tasks_client()
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    alice = {"Authorization": "Bearer alice"}
    _, message = await mrtr(client, "tools/call", params, headers=alice)
    _, state = round_one(message)
    answer = {"elicitation-1": accept(name="Ada")}
    body = state[:-1] + ("A" if state[-1] != "A" else "B")
    refusals = [
        ({**params, "inputResponses": answer, "requestState": body}, alice, "failed verification"),
        ({**params, "inputResponses": answer, "requestState": state + "x"}, alice, "failed verification"),
        ({**params, "inputResponses": answer, "requestState": state}, {"Authorization": "Bearer eve"}, "another"),
        ({**params, "arguments": {"x": 1}, "inputResponses": answer, "requestState": state}, alice, "another"),
        ({**params, "inputResponses": answer, "requestState": 7}, alice, "requestState"),
    ]
    for retry, headers, words in refusals:
        status, refused = await mrtr(client, "tools/call", retry, headers=headers)
        assert status == 400, refused
        assert refused["error"]["code"] == -32602
        assert words in refused["error"]["message"]
    status, refused = await mrtr(
        client, "prompts/get", {"name": "ask_name", "inputResponses": answer, "requestState": state}, headers=alice
    )
    assert refused["error"]["code"] == -32602  # bound to the method too
    _, message = await mrtr(
        client, "tools/call", {**params, "inputResponses": answer, "requestState": state}, headers=alice
    )
    assert content_text(message["result"]) == "Hello, Ada"


async def test_an_expired_request_state_is_refused_and_the_parked_call_cancelled(
    tasks_client: ClientFactory, own_upstream: Upstream
) -> None:
    client = await tasks_client(own_upstream.url, inputs={"request_state_ttl_ms": 300})
    before = await cancelled_upstream_calls(client)
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params)
    _, state = round_one(message)
    await wait_for_cancellations(client, before + 1)  # nobody resumed it: cancelled upstream after its expiry
    status, refused = await mrtr(
        client, "tools/call", {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": state}
    )
    assert status == 400
    assert refused["error"]["code"] == -32602
    assert "expired" in refused["error"]["message"]


async def test_an_invalid_answer_leaves_the_call_parked(tasks_client: ClientFactory) -> None:
    client = await tasks_client()
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params)
    _, state = round_one(message)
    for bad in ({"elicitation-1": 12345}, {"elicitation-1": {"action": "sure"}}):
        status, refused = await mrtr(client, "tools/call", {**params, "inputResponses": bad, "requestState": state})
        assert status == 400
        assert refused["error"]["code"] == -32602
    # A retry that answers nothing is asked again, not refused, with a new state; the old one is spent.
    _, message = await mrtr(client, "tools/call", {**params, "inputResponses": None, "requestState": state})
    requests, new_state = round_one(message)
    assert list(requests) == ["elicitation-1"]
    answer = {"elicitation-1": accept(name="Ada")}
    status, refused = await mrtr(client, "tools/call", {**params, "inputResponses": answer, "requestState": state})
    assert refused["error"]["code"] == -32602
    _, message = await mrtr(client, "tools/call", {**params, "inputResponses": answer, "requestState": new_state})
    assert content_text(message["result"]) == "Hello, Ada"


async def test_a_partial_retry_is_asked_again_for_the_rest(tasks_client: ClientFactory) -> None:
    """Missing answers on a retry re-issue the InputRequiredResult (with a new state), not an error."""
    client = await tasks_client(inputs={"gather_ms": 300})
    params: dict[str, Any] = {"name": "test_input_required_result_multiple_inputs", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params, capabilities=EVERY_INPUT)
    requests, state = round_one(message)
    methods = {request["method"]: key for key, request in requests.items()}
    assert sorted(methods) == ["elicitation/create", "roots/list", "sampling/createMessage"]
    partial = {methods["elicitation/create"]: accept(name="Ada")}
    _, message = await mrtr(
        client, "tools/call", {**params, "inputResponses": partial, "requestState": state}, capabilities=EVERY_INPUT
    )
    rest, state = round_one(message)
    assert sorted(rest) == sorted([methods["roots/list"], methods["sampling/createMessage"]])
    answers = {methods["roots/list"]: {"roots": []}, methods["sampling/createMessage"]: SAMPLED}
    _, message = await mrtr(
        client, "tools/call", {**params, "inputResponses": answers, "requestState": state}, capabilities=EVERY_INPUT
    )
    assert content_text(message["result"]) == "Name: Ada; Greeting: 42; Roots: 0"


async def test_only_declared_questions_are_asked_the_rest_declined(tasks_client: ClientFactory) -> None:
    """No elicitation/create to a client without `elicitation`; its sampling question is still asked."""
    client = await tasks_client(inputs={"gather_ms": 300})
    params: dict[str, Any] = {"name": "test_input_required_result_capabilities", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params, capabilities={"sampling": {}})
    requests, state = round_one(message)
    assert [request["method"] for request in requests.values()] == ["sampling/createMessage"]
    # The declined elicitation is not held against the client once it answered what it was asked.
    retry = {**params, "inputResponses": dict.fromkeys(requests, SAMPLED), "requestState": state}
    status, message = await mrtr(client, "tools/call", retry, capabilities={"sampling": {}})
    assert status == 200, message
    assert content_text(message["result"]) == "capabilities-ok: received elicit_input,sample_input"


async def test_prompts_get_and_resources_read_ask_through_mrtr(tasks_client: ClientFactory) -> None:
    """The two methods besides tools/call that may answer `input_required`."""
    client = await tasks_client()
    params: dict[str, Any] = {"name": "test_input_required_result_prompt"}
    _, message = await mrtr(client, "prompts/get", params)
    requests, state = round_one(message)
    [key] = requests
    _, message = await mrtr(
        client, "prompts/get", {**params, "inputResponses": {key: accept(context="docs")}, "requestState": state}
    )
    assert message["result"]["messages"][0]["content"]["text"] == "Prompt with context: docs"

    params = {"uri": "test://elicited-resource"}
    _, message = await mrtr(client, "resources/read", params)
    requests, state = round_one(message)
    [key] = requests
    _, message = await mrtr(
        client, "resources/read", {**params, "inputResponses": {key: accept(word="blue")}, "requestState": state}
    )
    result = message["result"]
    assert result["contents"][0]["text"] == "word=blue"
    assert result["ttlMs"] == 60_000
    assert result["cacheScope"] == "private"


async def test_too_many_parked_calls_are_refused(tasks_client: ClientFactory) -> None:
    client = await tasks_client(inputs={"max_parked": 1})
    _, message = await mrtr(client, "tools/call", {"name": "ask_name", "arguments": {}})
    round_one(message)
    with structlog.testing.capture_logs() as events:
        status, refused = await mrtr(client, "tools/call", {"name": "ask_name", "arguments": {}})
    # The question of the call that could not be parked was declined upstream (it ends by itself).
    declined = [event for event in events if event["event"] == "input_request_refused"]
    assert [(event["input_method"], event["reason"]) for event in declined] == [("elicitation/create", "detached")]
    assert status == 503
    assert refused["error"]["code"] == -32603
    assert refused["error"]["data"] == {"limit": "max_parked", "max": 1}


async def test_resolve_input_first_asks_synchronously_then_makes_a_task(tasks_client: ClientFactory) -> None:
    """The MRTR round is settled before the task exists; the resumed call becomes the task (no requestState
    on it)."""
    policy = {"mode": "required", "resolve_input_first": True, "sync_window_ms": 300}
    client = await tasks_client(tasks=policies(test_tool_with_task=policy))
    params: dict[str, Any] = {"name": "test_tool_with_task", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params, capabilities=TASKING)
    requests, state = round_one(message)
    [key] = requests
    retry = {**params, "inputResponses": {key: accept(name="Ada")}, "requestState": state}
    status, message = await mrtr(client, "tools/call", retry, capabilities=TASKING)
    assert status == 200
    created = message["result"]
    assert created["resultType"] == "task"
    assert "requestState" not in created
    assert "inputRequests" not in created
    done = await client.settled(created["taskId"])
    assert result_text(done) == "Task completed for Ada"


async def test_resolve_input_first_answers_a_quick_optional_call_synchronously(tasks_client: ClientFactory) -> None:
    policy = {"mode": "optional", "resolve_input_first": True, "sync_window_ms": 5000}
    client = await tasks_client(tasks=policies(ask_name=policy))
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params, capabilities=TASKING)
    _, state = round_one(message)
    retry = {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": state}
    _, message = await mrtr(client, "tools/call", retry, capabilities=TASKING)
    assert message["result"]["resultType"] == "complete"
    assert content_text(message["result"]) == "Hello, Ada"


async def test_poll_to_sync_asks_through_mrtr(tasks_client: ClientFactory) -> None:
    """A required tool for a client without the extension (`undeclared_required: wait`): its question is an
    MRTR round, and the answer comes once the internal task settles."""
    client = await tasks_client(tasks={**policies(ask_name={"mode": "required"}), "undeclared_required": "wait"})
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params)
    _, state = round_one(message)
    retry = {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": state}
    _, message = await mrtr(client, "tools/call", retry)
    assert content_text(message["result"]) == "Hello, Ada"


async def test_a_sync_question_the_client_cannot_answer_is_minus_32021(tasks_client: ClientFactory) -> None:
    """With MRTR: nothing the client declared is asked, so it is told what it lacks (-32021, HTTP 400)."""
    client = await tasks_client()
    status, message = await mrtr(client, "tools/call", {"name": "sample", "arguments": {"prompt": "x"}})
    assert status == 400
    assert message["error"]["code"] == -32021
    assert message["error"]["data"]["requiredCapabilities"] == {"sampling": {}}


async def test_replicas_sharing_the_key_say_where_the_call_is_parked(
    tasks_client: ClientFactory, tmp_path: Any
) -> None:
    """A retry may land on another replica: with `inputs.secret_file` shared, that replica verifies the state
    and names the problem; without the key, the state is just invalid."""
    secret = tmp_path / "state.key"
    secret.write_bytes(b"0123456789abcdef" * 4)
    first = await tasks_client(inputs={"secret_file": str(secret)})
    second = await tasks_client(inputs={"secret_file": str(secret)})
    stranger = await tasks_client()
    params: dict[str, Any] = {"name": "ask_name", "arguments": {}}
    _, message = await mrtr(first, "tools/call", params)
    _, state = round_one(message)
    retry = {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": state}
    _, refused = await mrtr(second, "tools/call", retry)
    assert "another proxy process" in refused["error"]["message"]
    _, refused = await mrtr(stranger, "tools/call", retry)
    assert "failed verification" in refused["error"]["message"]
    _, message = await mrtr(first, "tools/call", retry)
    assert content_text(message["result"]) == "Hello, Ada"


async def test_an_upstream_lost_while_waiting_for_input_fails_the_task_and_the_retry(
    tasks_client: ClientFactory, own_upstream: Upstream
) -> None:
    """Nothing hangs on a dead upstream: a task waiting for input fails with the upstream's error, and the
    retry of a parked synchronous call gets it too (a gateway error, not a stale question)."""
    client = await tasks_client(own_upstream.url, tasks=policies(ask_name={"mode": "required"}))
    task_id = await client.create("ask_name", capabilities=TASKING)
    await input_required(client, task_id)
    params: dict[str, Any] = {"name": "test_input_required_result_multi_round", "arguments": {}}
    _, message = await mrtr(client, "tools/call", params)
    _, state = round_one(message)
    own_upstream.stop()
    failed = await client.settled(task_id)
    assert failed["status"] == "failed"
    assert failed["error"]["code"] == -32603
    assert "Upstream" in failed["error"]["message"]
    retry = {**params, "inputResponses": {"elicitation-1": accept(name="Ada")}, "requestState": state}
    status, message = await mrtr(client, "tools/call", retry)
    assert status in (502, 504), message
    assert message["error"]["code"] == -32603
