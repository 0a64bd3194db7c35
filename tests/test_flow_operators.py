"""Operators find, inspect, cancel and purge tasks with the `tasks` commands, on SQLite and on PostgreSQL, beside
a running proxy process (`python -m proxy serve`) in front of the legacy fixture upstream: a cancel stops the
upstream call (`notifications/cancelled`), as a client's `tasks/cancel` does. Each command reads the store
the config names, and refuses in one line when it cannot reach it."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from proxy.cli import main
from proxy.tasks.store import SqliteTaskStore
from tests import pg
from tests.support.processes import ProxyProcess, Upstream, free_port
from tests.support.records import make_record
from tests.support.sdk import connect, text, until_started_upstream
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, parse_sse

TOOLS: dict[str, Any] = {"sleep": {"mode": "required"}, "echo": {"mode": "required"}}


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await asyncio.to_thread(main, list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def call(http: aiohttp.ClientSession, url: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    async with http.post(
        url,
        json=modern_body("tools/call", {"name": tool, "arguments": arguments}, capabilities=DECLARING),
        headers=modern_headers("tools/call", tool),
    ) as response:
        body = await response.text()
        messages = parse_sse(body) if response.content_type == "text/event-stream" else [json.loads(body)]
        final: dict[str, Any] = messages[-1]
        return final


async def task_get(http: aiohttp.ClientSession, url: str, task_id: str) -> dict[str, Any]:
    async with http.post(
        url,
        json=modern_body("tasks/get", {"taskId": task_id}, capabilities=DECLARING),
        headers=modern_headers("tasks/get", task_id),
    ) as response:
        message: dict[str, Any] = await response.json()
        return message


async def cancelled_upstream(url: str) -> int:
    async with connect(url) as conn:
        return len(json.loads(text(await conn.session.call_tool("cancelled_requests", {}))))


@pytest.fixture(params=["sqlite", "postgres"])
def store_section(request: pytest.FixtureRequest, tmp_path: Path) -> dict[str, Any]:
    """The proxy's (and the CLI's) `store` and `inputs` sections for one backend."""
    if request.param == "sqlite":
        return {"store": {"path": str(tmp_path / "ops.db"), "synchronous": "normal"}}
    key = tmp_path / "deploy.key"
    key.write_bytes(os.urandom(48).hex().encode())
    dsn = request.getfixturevalue("pg_dsn")
    return {"store": {"url": pg.as_url(dsn), "lease_seconds": 3.0}, "inputs": {"secret_file": str(key)}}


async def test_an_operator_lists_shows_cancels_and_purges_tasks_beside_a_running_proxy(
    tmp_path: Path,
    own_upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
    store_section: dict[str, Any],
) -> None:
    proxy = ProxyProcess(tmp_path, own_upstream.url, tasks={"tools": TOOLS}, **store_section)
    processes.append(proxy)
    await proxy.start()
    config = str(proxy.config)
    done = [(await call(http, proxy.url, "echo", {"text": f"done {n}"}))["result"]["taskId"] for n in range(3)]

    async def settled() -> bool:
        return all([(await task_get(http, proxy.url, task))["result"]["status"] == "completed" for task in done])

    await until(settled, "the echo tasks never completed")
    running = (await call(http, proxy.url, "sleep", {"seconds": 60}))["result"]["taskId"]
    await until_started_upstream(own_upstream.url, "sleep", 0)

    # list: newest first, as JSON and as a table, filtered and paged; never an argument value
    code, out, _ = await run(capsys, "tasks", "list", "--config", config, "--json")
    assert code == 0
    listed = json.loads(out)
    assert [task["taskId"] for task in listed["tasks"]] == [running, *reversed(done)]
    assert listed["tasks"][0]["status"] == "working"
    assert listed["tasks"][0]["tool"] == "sleep"
    assert listed["next"] is None
    assert "done 1" not in out
    code, out, _ = await run(capsys, "tasks", "list", "--config", config, "--json", "--status", "working")
    assert [task["taskId"] for task in json.loads(out)["tasks"]] == [running]
    code, out, _ = await run(capsys, "tasks", "list", "--config", config, "--json", "--tool", "echo", "--limit", "2")
    page = json.loads(out)
    assert [task["taskId"] for task in page["tasks"]] == [done[2], done[1]]
    code, out, _ = await run(capsys, "tasks", "list", "--config", config, "--json", "--after", page["next"])
    assert [task["taskId"] for task in json.loads(out)["tasks"]] == [done[0]]
    code, out, _ = await run(capsys, "tasks", "list", "--config", config, "--json", "--older-than", "1h")
    assert json.loads(out)["tasks"] == []
    code, out, _ = await run(capsys, "tasks", "list", "--config", config, "--younger-than", "1h")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["TASK", "STATUS", "TOOL", "AGE", "MESSAGE"]
    assert lines[1].split()[:3] == [running, "working", "sleep"]
    assert len(lines) == 5

    # show and stats read the configured store
    code, out, _ = await run(capsys, "tasks", "show", done[0], "--config", config)
    assert code == 0
    assert json.loads(out)["result"]["content"][0]["text"] == "done 0"
    code, out, _ = await run(capsys, "tasks", "stats", "--config", config)
    stats = json.loads(out)
    assert (stats["records"], stats["completed"], stats["working"]) == (4, 3, 1)

    # cancel: the record settles at once, the proxy running the call stops it upstream
    before = await cancelled_upstream(own_upstream.url)
    code, out, _ = await run(capsys, "tasks", "cancel", running, "--config", config)
    assert code == 0
    assert json.loads(out)["status"] == "cancelled"
    seen = await task_get(http, proxy.url, running)
    assert seen["result"]["status"] == "cancelled"
    assert seen["result"]["statusMessage"] == "cancelled by an operator"

    async def stopped_upstream() -> bool:
        return await cancelled_upstream(own_upstream.url) > before

    await until(stopped_upstream, "the upstream call was never cancelled")

    def logged() -> list[dict[str, Any]]:  # by the running proxy, which did not settle it
        return [event for event in proxy.events() if event["event"] == "task_settled_elsewhere"]

    await until(logged, "the running proxy never logged the operator's cancel", 5)
    [line] = logged()
    assert (line["task_id"], line["tool"], line["status"]) == (running, "sleep", "cancelled")
    assert line["reason"] == "cancelled by an operator"
    code, _, err = await run(capsys, "tasks", "cancel", running, "--config", config)
    assert code == 0
    assert "already cancelled" in err
    code, _, err = await run(capsys, "tasks", "cancel", "task_never_was", "--config", config)
    assert code == 1
    assert "no task 'task_never_was'" in err

    # purge: a dry run counts, --yes deletes settled records only
    code, out, err = await run(capsys, "tasks", "purge", "--older-than", "0s", "--config", config)
    assert (code, json.loads(out)["matched"], json.loads(out)["deleted"]) == (0, 4, 0)
    assert "dry run" in err
    code, out, _ = await run(capsys, "tasks", "purge", "--older-than", "1h", "--yes", "--config", config)
    assert json.loads(out)["deleted"] == 0
    code, out, _ = await run(capsys, "tasks", "purge", "--older-than", "0s", "--yes", "--config", config)
    assert json.loads(out)["deleted"] == 4
    code, out, _ = await run(capsys, "tasks", "stats", "--config", config)
    assert json.loads(out)["records"] == 0
    # the proxy goes on creating tasks after records vanished under it
    assert (await call(http, proxy.url, "echo", {"text": "after"}))["result"]["resultType"] == "task"
    assert await proxy.terminate() == 0


async def test_the_commands_read_postgresql_when_the_config_names_it_never_a_stray_sqlite_file(
    tmp_path: Path,
    pg_dsn: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    upstream: Upstream,
    processes: list[ProxyProcess],
    http: aiohttp.ClientSession,
) -> None:
    key = tmp_path / "deploy.key"
    key.write_bytes(os.urandom(48).hex().encode())
    sections: dict[str, Any] = {"store": {"url": pg.as_url(pg_dsn)}, "inputs": {"secret_file": str(key)}}
    proxy = ProxyProcess(tmp_path, upstream.url, tasks={"tools": TOOLS}, **sections)
    processes.append(proxy)
    await proxy.start()
    task_id = (await call(http, proxy.url, "echo", {"text": "in postgres"}))["result"]["taskId"]
    assert await proxy.terminate() == 0
    # A stray SQLite database where `serve` would put one by default, holding records of another deployment.
    monkeypatch.chdir(tmp_path)
    stray = await SqliteTaskStore.open("mcp-tasks-proxy.db", max_records=10)
    for index in range(2):
        await stray.records.create(make_record(f"task_stray_{index}"))
    await stray.close()
    code, out, _ = await run(capsys, "tasks", "show", task_id, "--config", str(proxy.config))
    assert code == 0
    assert json.loads(out)["taskId"] == task_id
    code, out, _ = await run(capsys, "tasks", "stats", "--config", str(proxy.config))
    assert (json.loads(out)["records"], json.loads(out)["database"]) == (1, pg.as_url(pg_dsn))
    code, out, _ = await run(capsys, "tasks", "list", "--config", str(proxy.config), "--json")
    assert [task["taskId"] for task in json.loads(out)["tasks"]] == [task_id]


async def test_a_relative_store_path_in_the_file_is_read_from_the_files_directory_as_serve_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], upstream: Upstream
) -> None:
    configs = tmp_path / "configs"
    (configs / "state").mkdir(parents=True)
    store = await SqliteTaskStore.open(configs / "state" / "tasks.db", max_records=10)
    await store.records.create(make_record("task_here"))
    await store.close()
    workdir = tmp_path / "work"
    (workdir / "state").mkdir(parents=True)  # a database of the same relative name here is not the one read
    config = configs / "proxy.yaml"
    config.write_text(yaml.safe_dump({"upstream": {"url": upstream.url}, "store": {"path": "state/tasks.db"}}))
    monkeypatch.chdir(workdir)
    code, out, _ = await run(capsys, "tasks", "stats", "--config", str(config))
    assert code == 0
    assert (json.loads(out)["database"], json.loads(out)["records"]) == (str(configs / "state" / "tasks.db"), 1)


@pytest.mark.parametrize(
    "command", [["list"], ["show", "task_x"], ["stats"], ["cancel", "task_x"], ["purge", "--older-than", "1d"]]
)
async def test_every_command_refuses_in_one_line_when_the_store_cannot_be_reached(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], upstream: Upstream, command: list[str]
) -> None:
    key = tmp_path / "deploy.key"
    key.write_bytes(os.urandom(48).hex().encode())
    config = tmp_path / "proxy.yaml"
    url = f"postgresql://proxy@127.0.0.1:{free_port()}/tasks"
    config.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": upstream.url},
                "store": {"url": url, "connect_timeout_seconds": 1},
                "inputs": {"secret_file": str(key)},
            }
        )
    )
    code, out, err = await run(capsys, "tasks", *command, "--config", str(config))
    assert (code, out) == (1, "")
    assert len(err.splitlines()) == 1
    assert "cannot connect to the task store" in err
    code, out, err = await run(capsys, "tasks", *command, "--db", str(tmp_path / "absent.db"))
    assert (code, out) == (1, "")
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "absent.db").exists()  # nothing is created by looking


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["tasks", "list", "--db", "x.db", "--older-than", "soon"], "not a duration"),
        (["tasks", "purge", "--db", "x.db"], "--older-than"),
        (["tasks", "list", "--db", "x.db", "--status", "done"], "invalid choice"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


async def test_tasks_list_on_an_empty_store_prints_the_header_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    database = tmp_path / "tasks.db"
    await (await SqliteTaskStore.open(database, max_records=10)).close()
    code, out, err = await run(capsys, "tasks", "list", "--db", str(database))
    assert (code, err) == (0, "")
    assert out.split() == ["TASK", "STATUS", "TOOL", "AGE", "MESSAGE"]
    code, out, _ = await run(capsys, "tasks", "list", "--db", str(database), "--json")
    assert json.loads(out) == {"tasks": [], "next": None}


async def test_the_tasks_commands_read_only_the_store_of_a_config_from_another_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod's config names key and token files mounted only there: `tasks` needs none of them, and
    `admin-url` only the admin token."""
    configs = tmp_path / "etc"
    configs.mkdir()
    await (await SqliteTaskStore.open(configs / "tasks.db", max_records=10)).close()
    pod_only = "/var/run/secrets/mcp-tasks-proxy"
    config = configs / "proxy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "upstream": {"url": "http://127.0.0.1:9/mcp"},
                "store": {"path": "tasks.db"},
                "security": {"key_file": f"{pod_only}/key"},
                "inputs": {"secret_file": f"{pod_only}/state"},
                "admin": {"port": 9911, "token_file": f"{pod_only}/admin-token"},
            }
        )
    )
    monkeypatch.chdir(tmp_path)
    code, out, err = await run(capsys, "tasks", "stats", "--config", str(config))
    assert code == 0, err
    assert json.loads(out)["database"] == str(configs / "tasks.db")
    code, _, err = await run(capsys, "tasks", "list", "--config", str(config))
    assert code == 0, err
    code, _, err = await run(capsys, "tasks", "admin-url", "--config", str(config))
    assert code == 2
    assert "admin.token_file" in err
    assert "security.key_file" not in err
