"""The audit log answers who called what, when, with which outcome: one JSON line per modern request (a
synchronous call, a task's creation, each MRTR round, a refusal) and per task transition, against the legacy
fixture upstream on loopback. No argument value, answer, result or credential is ever in it."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import aiohttp

from tests.support.clients import ClientFactory
from tests.support.processes import ProxyProcess, Upstream
from tests.support.waiting import until
from tests.support.wire import modern_body, modern_headers, result_text

SECRET = "s3cr3t-audit-7d2e"
ALICE = {"Authorization": f"Bearer {SECRET}-token"}


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_requests_and_task_transitions_are_audited_without_any_value(
    tasks_client: ClientFactory, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    client = await tasks_client(audit={"path": str(audit)}, tasks={"tools": {"counted": {"mode": "required"}}})

    _, message = await client.call("echo", {"text": f"{SECRET}-argument"}, headers=ALICE)
    assert SECRET in result_text(message)
    task_id = await client.create("counted", {"key": f"{SECRET}-key", "seconds": 0}, headers=ALICE)
    await client.until(task_id, lambda task: task["status"] == "completed", headers=ALICE)
    # An MRTR round: the question, then the retry carrying the answer.
    _, asked = await client.call("ask_name", capabilities={"elicitation": {}}, headers=ALICE)
    assert asked["result"]["resultType"] == "input_required", asked
    [key] = asked["result"]["inputRequests"]
    retry = {
        "name": "ask_name",
        "arguments": {},
        "requestState": asked["result"]["requestState"],
        "inputResponses": {key: {"action": "accept", "content": {"name": f"{SECRET}-answer"}}},
    }
    _, answered = await client.post("tools/call", retry, capabilities={"elicitation": {}}, headers=ALICE)
    assert SECRET in result_text(answered)
    # A refusal: a task method from a client that did not declare the extension.
    status, refused = await client.post("tasks/get", {"taskId": task_id}, capabilities={}, headers=ALICE)
    assert (status, refused["error"]["code"]) == (400, -32021)

    async def settled_line() -> bool:
        return any(line.get("outcome") == "completed" for line in lines(audit))

    await until(settled_line, "the task's settlement was never audited")
    written = lines(audit)
    assert SECRET not in audit.read_text()  # no argument, answer, result or token: in no line
    assert all({"time", "replica", "kind", "outcome"} <= line.keys() for line in written)
    assert len({line["replica"] for line in written}) == 1
    requests = [line for line in written if line["kind"] == "request"]
    sync = next(line for line in requests if line.get("tool") == "echo")
    assert (sync["method"], sync["outcome"], sync["status"]) == ("tools/call", "complete", 200)
    assert len(sync["principal"]) == 64  # the keyed hash, never the header's value
    assert "subject" not in sync  # an opaque token has none
    assert sync["duration_ms"] >= 0
    created = next(line for line in requests if line.get("tool") == "counted")
    assert (created["outcome"], created["task_id"]) == ("task", task_id)
    assert created["principal"] == sync["principal"]
    rounds = [line for line in requests if line.get("tool") == "ask_name"]
    assert [line["outcome"] for line in rounds] == ["input_required", "complete"]
    polls = [line for line in requests if line["method"] == "tasks/get" and line.get("task_id") == task_id]
    assert {line["outcome"] for line in polls} >= {"complete", "refused"}
    refusal = polls[-1]
    assert (refusal["outcome"], refusal["code"], refusal["status"]) == ("refused", -32021, 400)
    transitions = [line["outcome"] for line in written if line["kind"] == "task" and line["task_id"] == task_id]
    assert transitions[0] == "created"
    assert transitions[-1] == "completed"
    task_line = next(line for line in written if line["kind"] == "task")
    assert (task_line["tool"], task_line["method"], task_line["principal"]) == (
        "counted",
        "tools/call",
        sync["principal"],
    )


async def test_a_cancel_is_audited_as_the_request_and_as_the_tasks_stop(
    tasks_client: ClientFactory, tmp_path: Path
) -> None:
    audit = tmp_path / "audit.jsonl"
    client = await tasks_client(audit={"path": str(audit)}, tasks={"tools": {"sleep": {"mode": "required"}}})
    task_id = await client.create("sleep", {"seconds": 30})
    await client.post("tasks/cancel", {"taskId": task_id})

    async def stopped() -> list[str] | None:
        found = [line["outcome"] for line in lines(audit) if line["kind"] == "task" and line["task_id"] == task_id]
        return found if "stopped" in found else None

    outcomes = await until(stopped, "the stop was never audited")
    assert outcomes[0] == "created"
    cancel = [line for line in lines(audit) if line["kind"] == "request" and line["method"] == "tasks/cancel"]
    assert [(line["task_id"], line["outcome"]) for line in cancel] == [(task_id, "complete")]
    assert "principal" not in cancel[0]  # an anonymous caller


async def test_sighup_reopens_the_audit_file_after_a_rotation(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    audit = tmp_path / "audit.jsonl"
    proxy = ProxyProcess(tmp_path, upstream.url, audit={"path": str(audit)})
    processes.append(proxy)
    await proxy.start()

    async def echo(text: str) -> None:
        async with http.post(
            proxy.url,
            json=modern_body("tools/call", {"name": "echo", "arguments": {"text": text}}),
            headers=modern_headers("tools/call", "echo"),
        ) as response:
            assert response.status == 200

    await echo("before")
    rotated = tmp_path / "audit.jsonl.1"
    audit.rename(rotated)  # logrotate's default (`create`), then its postrotate: kill -HUP
    assert proxy.process is not None
    proxy.process.send_signal(signal.SIGHUP)

    async def reopened() -> bool:
        await echo("after")
        return audit.exists() and bool(audit.read_text())

    await until(reopened, "the audit file was never reopened")
    assert next(line["tool"] for line in lines(rotated) if line["kind"] == "request") == "echo"
    assert all(line["kind"] == "request" for line in lines(audit))
    assert await proxy.terminate() == 0
