"""End to end: a replica drains on SIGTERM while another one on the same PostgreSQL database answers for its
tasks. Real processes, a real signal; the tasks the draining replica runs end there within the drain, a
cancel sent to the other replica reaches it, and only what outlives the drain is taken over once it exits. A
draining replica takes no dead replica's tasks over: a replica that serves on does.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator

import aiohttp
import pytest

from proxy.tasks.services.recovery import SWEEP_INTERVAL_SECONDS
from proxy.tasks.services.replicas import TAKEN_OVER
from tests import pg
from tests.support.cluster import Cluster, client
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.waiting import until

DRAIN_SECONDS = 5.0
LEASE_SECONDS = 3.0
LONG_DRAIN_SECONDS = 60.0  # outlasts every step of the test, which ends it with a second signal
SWEEPS_WATCHED = 3  # after a dead replica's lease ran out, its task is watched this many sweeps
TOOLS = {"sleep": {"mode": "required"}}


@pytest.fixture
def pair(tmp_path_factory: pytest.TempPathFactory, pg_server: pg.PgServer) -> Iterator[Cluster]:
    with pg_server.database() as dsn:
        replicas = Cluster(tmp_path_factory.mktemp("drain"), dsn, 2, LEASE_SECONDS, TOOLS, drain_seconds=DRAIN_SECONDS)
        yield replicas
        replicas.stop()


@pytest.fixture
def long_drain(tmp_path_factory: pytest.TempPathFactory, pg_server: pg.PgServer) -> Iterator[Cluster]:
    with pg_server.database() as dsn:
        workdir = tmp_path_factory.mktemp("long-drain")
        replicas = Cluster(workdir, dsn, 2, LEASE_SECONDS, TOOLS, drain_seconds=LONG_DRAIN_SECONDS)
        yield replicas
        replicas.stop()


async def test_the_other_replica_answers_for_a_draining_replicas_tasks(
    pair: Cluster, http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    draining, _ = client(http, [pair.replicas[0]], modern_schema, tasks_schema)
    other, _ = client(http, [pair.replicas[1]], modern_schema, tasks_schema)
    short = await draining.create("sleep", {"seconds": 2})
    cancelled = await draining.create("sleep", {"seconds": 60})
    longer = await draining.create("sleep", {"seconds": 60})
    owner = pair.records([short])[short]["owner"]

    sent = time.monotonic()
    pair.replicas[0].signal(signal.SIGTERM)
    assert pair.replicas[0].proxy.process is not None
    exited = asyncio.get_running_loop().create_task(asyncio.to_thread(pair.replicas[0].proxy.process.wait, 60))

    assert (await other.task(short))["status"] == "working"  # the other replica reads it from the store
    status, _ = await other.post("tasks/cancel", {"taskId": cancelled})
    assert status == 200
    gone = await other.until(cancelled, lambda task: task["status"] == "cancelled")
    assert gone["status"] == "cancelled"  # the draining replica, still running it, was told and stopped it
    done = await other.settled(short)
    assert done["status"] == "completed"  # ended on the draining replica, within its drain
    assert pair.records([short])[short]["owner"] == owner

    assert await exited == 0
    assert time.monotonic() - sent < DRAIN_SECONDS + 10
    taken = await other.until(longer, lambda task: task["status"] != "working", timeout_seconds=20)
    assert taken["status"] == "failed"  # outlived the drain: taken over once the lease was released
    assert taken["error"]["message"] == TAKEN_OVER
    assert pair.records([longer])[longer]["owner"] != owner
    events = pair.replicas[0].events()
    assert [event["calls_left"] for event in events if event["event"] == "drain_timed_out"] == [1]
    await other.post("tasks/cancel", {"taskId": longer})


async def test_a_draining_replica_takes_no_dead_replicas_tasks_over_and_a_serving_one_does(
    long_drain: Cluster, http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> None:
    drainer, dying = long_drain.replicas
    draining, _ = client(http, [drainer], modern_schema, tasks_schema)
    on_dying, _ = client(http, [dying], modern_schema, tasks_schema)
    held = await draining.create("sleep", {"seconds": 60})  # keeps the drain going
    orphan = await on_dying.create("sleep", {"seconds": 60})
    owners = long_drain.records([held, orphan])
    drainer_id, dead_id = owners[held]["owner"], owners[orphan]["owner"]
    assert drainer.proxy.process is not None
    assert dying.proxy.process is not None

    dying.signal(signal.SIGKILL)
    await asyncio.to_thread(dying.proxy.process.wait, 10)
    drainer.signal(signal.SIGTERM)
    await until(lambda: any(event["event"] == "drain_started" for event in drainer.events()), "the drain began")
    expired = "SELECT 1 FROM replicas WHERE replica_id = %s AND expires_at <= clock_timestamp()"
    await until(lambda: long_drain.rows(expired, [dead_id]), "the dead replica's lease ran out", LEASE_SECONDS + 10)

    def taken_over() -> bool:
        return bool(long_drain.records([orphan])[orphan]["owner"] != dead_id)

    # Sweeps that would take the dead replica's task over (one a second) pass, and nobody does.
    with pytest.raises(AssertionError, match="not within"):
        await until(taken_over, "a take-over", SWEEPS_WATCHED * SWEEP_INTERVAL_SECONDS)
    assert drainer.proxy.process.poll() is None  # still draining all along
    assert (await draining.task(orphan))["status"] == "working"

    drainer.signal(signal.SIGTERM)  # a second signal ends the drain now
    assert await asyncio.to_thread(drainer.proxy.process.wait, 30) == 0
    await asyncio.to_thread(dying.start)  # a replica that serves on takes over both
    for task_id in (orphan, held):
        taken = await on_dying.until(task_id, lambda task: task["status"] != "working", timeout_seconds=20)
        assert taken["status"] == "failed"
        assert taken["error"]["message"] == TAKEN_OVER
    owners = long_drain.records([held, orphan])
    assert owners[orphan]["owner"] == owners[held]["owner"] not in (drainer_id, dead_id)
