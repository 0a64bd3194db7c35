"""Reasons for gone tasks: `tasks/get`, `tasks/update` and `tasks/cancel` of the caller's own task whose record
expired (its ttlMs ran out) or was purged by an operator answer -32602 saying so, and when; an id that never
existed, and another principal's task, get "not found" (no existence oracle, as MCP's Tasks security section
asks), on SQLite and PostgreSQL. Against the legacy fixture upstream on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.edge._app_keys import CONFIG
from tests import pg
from tests.support.clients import ClientFactory, Tasks
from tests.support.processes import key_file
from tests.support.waiting import until

ALICE = {"Authorization": "Bearer alice"}
MALLORY = {"Authorization": "Bearer mallory"}
NOT_FOUND = {"code": -32602, "message": "Failed to retrieve task: Task not found"}
METHODS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("tasks/get", {}),
    ("tasks/update", {"inputResponses": {}}),
    ("tasks/cancel", {}),
)


@pytest.fixture(params=["sqlite", "postgres"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """Config sections for one store."""
    if request.param == "sqlite":
        return {}
    dsn = request.getfixturevalue("pg_dsn")
    return {"store": {"url": pg.as_url(dsn)}, "security": {"key_file": key_file(tmp_path)}}


def policies(**tools: Any) -> dict[str, Any]:
    return {"tools": tools}


async def answers(client: Tasks, task_id: str, headers: dict[str, str]) -> list[dict[str, Any]]:
    """The error of each task method for `task_id` as `headers`' principal."""
    errors = []
    for method, params in METHODS:
        status, message = await client.post(method, {"taskId": task_id, **params}, headers=headers)
        assert status == 400, (method, message)
        errors.append(message["error"])
    return errors


async def until_gone(client: Tasks, task_id: str) -> dict[str, Any]:
    async def gone() -> dict[str, Any] | None:
        _, message = await client.get(task_id, headers=ALICE)
        error: dict[str, Any] | None = message.get("error")
        return error

    found: dict[str, Any] = await until(gone, "the task outlived its ttl")
    return found


async def test_an_expired_task_says_it_expired_to_its_owner_only(
    tasks_client: ClientFactory, backend: dict[str, Any]
) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required", "ttl_ms": 1500}), **backend)
    task_id = await client.create("echo", {"text": "x"}, headers=ALICE)
    await client.until(task_id, lambda task: task["status"] == "completed", headers=ALICE)
    first = await until_gone(client, task_id)
    assert first["code"] == -32602
    assert first["message"].startswith("Failed to retrieve task: Task has expired (at ")
    assert first["data"]["reason"] == "expired"
    assert first["data"]["taskId"] == task_id
    assert first["data"]["expiredAt"] in first["message"]
    for error in await answers(client, task_id, ALICE):  # the tombstone stays: every method, every time
        assert (error["code"], error["data"]["reason"], error["data"]["expiredAt"]) == (
            -32602,
            "expired",
            first["data"]["expiredAt"],
        )
    assert await answers(client, task_id, MALLORY) == [NOT_FOUND] * 3  # another principal learns nothing
    assert await answers(client, task_id, {}) == [NOT_FOUND] * 3
    assert await answers(client, "task_neverexisted", ALICE) == [NOT_FOUND] * 3


async def test_a_live_task_that_expires_fails_then_says_it_expired(
    tasks_client: ClientFactory, backend: dict[str, Any]
) -> None:
    client = await tasks_client(tasks=policies(sleep={"mode": "required", "ttl_ms": 1500}), **backend)
    task_id = await client.create("sleep", {"seconds": 30}, headers=ALICE)
    failed = await client.until(task_id, lambda task: task["status"] != "working", headers=ALICE)
    assert failed["status"] == "failed"
    gone = await until_gone(client, task_id)
    assert gone["data"]["reason"] == "expired"


async def test_a_purged_task_says_an_operator_deleted_it(
    tasks_client: ClientFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    client = await tasks_client(tasks=policies(echo={"mode": "required"}))
    task_id = await client.create("echo", {"text": "x"}, headers=ALICE)
    await client.until(task_id, lambda task: task["status"] == "completed", headers=ALICE)
    path = client.client.app[CONFIG].store.path
    assert await asyncio.to_thread(main, ["tasks", "purge", "--older-than", "0s", "--yes", "--db", path]) == 0
    capsys.readouterr()
    errors = await answers(client, task_id, ALICE)
    assert [error["data"]["reason"] for error in errors] == ["purged"] * 3
    assert errors[0]["message"].startswith("Failed to retrieve task: Task was deleted by an operator (at ")
    assert await answers(client, task_id, MALLORY) == [NOT_FOUND] * 3


async def test_without_tombstones_a_gone_task_is_not_found(tasks_client: ClientFactory) -> None:
    client = await tasks_client(tasks={**policies(echo={"mode": "required", "ttl_ms": 1500}), "tombstone_seconds": 0})
    task_id = await client.create("echo", {"text": "x"}, headers=ALICE)
    await client.until(task_id, lambda task: task["status"] == "completed", headers=ALICE)
    assert await until_gone(client, task_id) == NOT_FOUND
    assert await answers(client, task_id, ALICE) == [NOT_FOUND] * 3
