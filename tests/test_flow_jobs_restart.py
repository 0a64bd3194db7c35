"""A proxy restart while a legacy job (`jobs:` config) runs: the next start polls the same job on (its id is in
the task's record) and never starts it again; and the check at start names a job tool the upstream lacks.

The proxy runs as a child process (`ProxyProcess`), killed with SIGKILL or stopped with SIGTERM, in front of
the fixture upstream (tests/upstream/job_fixtures.py), which counts the jobs started.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest

from tests.support.clients import Client, Tasks
from tests.support.jobs import render_job, render_stats
from tests.support.processes import ProxyProcess, Upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until
from tests.support.wire import result_text

pytestmark = pytest.mark.faults


@asynccontextmanager
async def modern(process: ProxyProcess, schemas: tuple[ModernSchema, SchemaValidator]) -> AsyncIterator[Tasks]:
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{process.port}") as http:
        yield Tasks(cast(Client, http), *schemas)


def stored_job_id(database: Path, task_id: str) -> str | None:
    with sqlite3.connect(database) as connection:
        row = connection.execute("SELECT job_id FROM tasks WHERE task_id = ?", [task_id]).fetchone()
    assert row is not None
    job_id: str | None = row[0]
    return job_id


def logged(process: ProxyProcess, event: str, **fields: Any) -> bool:
    return any(
        line.get("event") == event and all(line.get(key) == value for key, value in fields.items())
        for line in process.events()
    )


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
async def test_after_a_restart_the_same_job_is_polled_to_its_end_and_never_started_again(
    stop: str,
    tmp_path: Path,
    upstream: Upstream,
    processes: list[ProxyProcess],
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    database = tmp_path / "jobs.db"

    async def start() -> ProxyProcess:
        process = ProxyProcess(
            tmp_path, upstream.url, store={"path": str(database)}, tasks={"drain_seconds": 0}, jobs=render_job()
        )
        processes.append(process)
        await process.start()
        return process

    schemas = (modern_schema, tasks_schema)
    first = await start()
    async with modern(first, schemas) as client:
        before = await render_stats(client)
        task_id = await client.create("start_render", {"seconds": 3})
        await client.until(task_id, lambda task: str(task.get("statusMessage", "")).endswith("%"))
    job_id = stored_job_id(database, task_id)
    assert job_id is not None
    assert job_id.startswith("render-")
    if stop == "kill -9":
        await asyncio.to_thread(first.stop)  # nothing is cancelled upstream: the job runs on
    else:
        assert await first.terminate() == 0

    second = await start()
    async with modern(second, schemas) as client:
        done = await client.settled(task_id, timeout_seconds=20)
        after = await render_stats(client)
    assert done["status"] == "completed", done
    assert result_text(done) == f"rendered {job_id}"
    assert after["starts"] == before["starts"] + 1  # the job was started once, by the first proxy
    assert after["cancels"] == before["cancels"]
    assert logged(second, "job_resumed", task_id=task_id)


async def test_a_job_naming_a_tool_the_upstream_lacks_is_warned_about_at_start(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    job = render_job()
    job["start_render"]["result"] = {"tool": "render_output"}
    process = ProxyProcess(tmp_path, upstream.url, jobs=job)
    processes.append(process)
    await process.start()

    async def warned() -> bool:
        return logged(process, "job_tool_missing", job="start_render", role="result", tool="render_output")

    await until(warned, "no warning names the missing tool", 10)
    [line] = [line for line in process.events() if line.get("event") == "job_tool_missing"]
    assert "calls of 'start_render' will fail" in line["detail"]
