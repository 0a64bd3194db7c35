"""Two proxy replicas on one PostgreSQL database in front of ONE upstream (the job backend every replica's
upstream sees): a replica killed with SIGKILL mid-job loses its job task to the survivor once its lease runs out.
With `shared: true` the survivor polls the same job to its end (it is never started again); without it, the task
fails as taken over, as any task a dead replica's own upstream ran.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import cast

import aiohttp
import pytest

from proxy.tasks.services.replicas import TAKEN_OVER
from tests import pg
from tests.support.clients import Client, Tasks
from tests.support.jobs import render_job, render_stats
from tests.support.processes import ProxyProcess, Upstream
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.wire import result_text

pytestmark = pytest.mark.faults

LEASE_SECONDS = 2.0


@asynccontextmanager
async def modern(process: ProxyProcess, schemas: tuple[ModernSchema, SchemaValidator]) -> AsyncIterator[Tasks]:
    async with aiohttp.ClientSession(base_url=f"http://127.0.0.1:{process.port}") as http:
        yield Tasks(cast(Client, http), *schemas)


@pytest.mark.parametrize("shared", [True, False])
async def test_a_survivor_takes_a_dead_replicas_job_over_and_polls_it_on_only_when_it_is_shared(
    shared: bool,
    tmp_path: Path,
    pg_dsn: str,
    upstream: Upstream,
    processes: list[ProxyProcess],
    modern_schema: ModernSchema,
    tasks_schema: SchemaValidator,
) -> None:
    key = tmp_path / "deployment.key"
    key.write_bytes(os.urandom(48).hex().encode())
    replicas = [
        ProxyProcess(
            tmp_path,
            upstream.url,
            store={"url": pg.as_url(pg_dsn), "lease_seconds": LEASE_SECONDS},
            inputs={"secret_file": str(key)},
            tasks={"drain_seconds": 0},
            jobs=render_job(shared=shared),
        )
        for _ in range(2)
    ]
    processes.extend(replicas)
    for replica in replicas:
        await replica.start()
    doomed, survivor = replicas
    schemas = (modern_schema, tasks_schema)
    async with modern(doomed, schemas) as client:
        before = await render_stats(client)
        task_id = await client.create("start_render", {"seconds": LEASE_SECONDS + 3})
        await client.until(task_id, lambda task: str(task.get("statusMessage", "")).endswith("%"))
    await asyncio.to_thread(doomed.stop)  # SIGKILL: its lease runs out, its job runs on upstream

    async with modern(survivor, schemas) as client:
        done = await client.settled(task_id, timeout_seconds=LEASE_SECONDS + 15)
        after = await render_stats(client)
    assert after["starts"] == before["starts"] + 1  # never started again, shared or not
    if shared:
        assert done["status"] == "completed", done
        assert result_text(done).startswith("rendered render-")
    else:
        assert done["status"] == "failed", done
        assert done["error"]["message"] == TAKEN_OVER
