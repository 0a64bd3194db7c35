"""End to end: a proxy replica (`python -m proxy serve`) whose PostgreSQL goes away while tasks run, on a real
server of its own: stopped (fast shutdown) and started again on the same data directory; frozen with SIGSTOP;
and, with two replicas, one of them cut off from the database by a TCP forwarder while the other still reaches it.

While the store is away every request that needs it is answered within `store.timeout_seconds` with HTTP 503,
`Retry-After` and a JSON-RPC error naming the store (RFC 9110 §15.6.4); `/healthz` stays 200. A replica whose
lease lapsed in an outage that nobody else survived resumes its tasks (their results are written, those the
upstream produced during the outage too: they wait in the outbox and are written once the store is back); one cut off
while the other replica reached the store loses its tasks to it, and writes nothing to them. Each test prints
its fault's timeline (outage start, first 503, store back, last task settled).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.tasks.services.replicas import TAKEN_OVER
from tests import pg
from tests.support.clients import Tasks
from tests.support.cluster import Replica, client
from tests.support.processes import ProxyProcess
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.tcp_cut import TcpCut
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, read_messages, result_text

pytestmark = pytest.mark.faults

LEASE_SECONDS = 2.0
TIMEOUT_SECONDS = 1.0
MARGIN_SECONDS = 1.0  # a loaded 2-core machine: an answer this late is still "within the deadline"
OUTAGE_SECONDS = 4.0  # twice the lease: it lapses during the outage
TASKS = 6
TOOLS: dict[str, Any] = {"slow_compute": {"mode": "required"}}
STORE: dict[str, Any] = {"timeout_seconds": TIMEOUT_SECONDS, "connect_timeout_seconds": 1}


@pytest.fixture
def server(own_pg_server: pg.PgServer) -> pg.PgServer:
    return own_pg_server


@pytest.fixture
async def dsn(server: pg.PgServer) -> str:
    """A database of its own on the test's server."""
    return server.dsn(await asyncio.to_thread(server.create_database))


class Outage:
    """What each test drives: replicas on a database of the test's server, and clients of them."""

    def __init__(
        self, workdir: Path, http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks: SchemaValidator
    ) -> None:
        self.workdir = workdir
        self.http = http
        self.schema = modern_schema
        self.tasks_schema = tasks
        self.key = workdir / "request-state.key"
        self.key.write_text("k" * 64)
        self.started: list[Replica] = []

    async def start(self, dsn: str) -> Replica:
        replica = await asyncio.to_thread(Replica, self.workdir, dsn, self.key, LEASE_SECONDS, TOOLS, store=STORE)
        self.started.append(replica)
        return replica

    def client(self, replica: Replica) -> Tasks:
        return client(self.http, [replica], self.schema, self.tasks_schema)[0]

    async def running(self, dsn: str, seconds: float, prefix: str) -> tuple[Replica, Tasks, dict[str, str]]:
        """A replica on `dsn` with `TASKS` tasks of `seconds` running on it."""
        replica = await self.start(dsn)
        rr = self.client(replica)
        return replica, rr, await start_tasks(rr, seconds, prefix)

    async def unavailable(self, replica: Replica, tasks: dict[str, str], timeline: Timeline) -> None:
        await answered_unavailable(self.http, replica.proxy.url, next(iter(tasks)), self.schema, timeline)


@pytest.fixture
async def outage(
    tmp_path: Path, http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> AsyncIterator[Outage]:
    bench = Outage(tmp_path, http, modern_schema, tasks_schema)
    yield bench
    for replica in bench.started:
        await asyncio.to_thread(replica.stop)


class Timeline:
    """What happened when, in seconds from the fault's start; printed at the end of the test (pytest -s)."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.started = time.monotonic()
        self.marks: dict[str, float] = {}

    def mark(self, what: str) -> None:
        self.marks.setdefault(what, round(time.monotonic() - self.started, 2))

    def show(self) -> None:
        print(f"\ntimeline of {self.fault}: " + ", ".join(f"{what} {at:.2f} s" for what, at in self.marks.items()))


async def timed_call(
    http: aiohttp.ClientSession, url: str, method: str, params: dict[str, Any]
) -> tuple[float, int, dict[str, str], dict[str, Any]]:
    """One modern request: how long it took, its status, headers and final message."""
    name = params.get("taskId", params.get("name"))
    started = time.monotonic()
    async with http.post(
        url, json=modern_body(method, params, capabilities=DECLARING), headers=modern_headers(method, name)
    ) as response:
        messages = await read_messages(response)
        return time.monotonic() - started, response.status, dict(response.headers), messages[-1]


async def answered_unavailable(
    http: aiohttp.ClientSession, url: str, task_id: str, schema: ModernSchema, timeline: Timeline
) -> None:
    """tasks/get and a new tools/call while the store is away: 503 + Retry-After + the error naming the store,
    within the deadline; the process lives on (/healthz 200)."""
    for method, params in (
        ("tasks/get", {"taskId": task_id}),
        ("tools/call", {"name": "slow_compute", "arguments": {"seconds": 0, "label": "during"}}),
    ):
        took, status, headers, final = await timed_call(http, url, method, params)
        assert status == 503, final
        timeline.mark("first 503")
        schema.validate(final, "JSONRPCErrorResponse")
        assert headers["Retry-After"].isdigit()
        assert final["error"]["code"] == -32603
        assert "task store is unavailable" in final["error"]["message"]
        assert final["error"]["data"]["store"] == "postgres"
        assert took < TIMEOUT_SECONDS + MARGIN_SECONDS, f"{method} took {took:.2f} s"
    async with http.get(url.replace("/mcp", "/healthz")) as response:
        assert response.status == 200


async def store_unavailable(http: aiohttp.ClientSession, proxy: ProxyProcess) -> bool:
    async with http.get(proxy.ops_url("/readyz")) as response:
        body = await response.json()
        return response.status == 503 and any("task store (postgres) is unavailable" in r for r in body["reasons"])


async def start_tasks(rr: Tasks, seconds: float, prefix: str) -> dict[str, str]:
    """Task id → its label, for `TASKS` slow_compute tasks of `seconds`."""
    labels = [f"{prefix}-{number}" for number in range(TASKS)]
    return {await rr.create("slow_compute", {"seconds": seconds, "label": label}): label for label in labels}


async def all_completed(rr: Tasks, tasks: dict[str, str], seconds: float, timeline: Timeline) -> None:
    """Every task completed with its own result (none failed, none lost)."""
    for task_id, label in tasks.items():
        done = await rr.settled(task_id, timeout_seconds=30)
        assert done["status"] == "completed", done
        assert result_text(done) == f"slow_compute finished: label={label} seconds={seconds:g}"
    timeline.mark("last task settled")


def events(replica: Replica, name: str) -> list[dict[str, Any]]:
    return [event for event in replica.events() if event.get("event") == name]


async def test_a_postgresql_restart_costs_latency_never_a_task(
    dsn: str,
    server: pg.PgServer,
    outage: Outage,
) -> None:
    """Stopped for twice the lease while tasks run: 503 + Retry-After meanwhile, every task completes with its own
    result once the database is back (the lapsed lease resumed, nothing stopped), and the replica serves again
    without a restart."""
    seconds = OUTAGE_SECONDS + 4
    replica, rr, tasks = await outage.running(dsn, seconds, "restart")
    timeline = Timeline("PostgreSQL stopped")
    await asyncio.to_thread(server.halt)
    timeline.mark("outage start")
    await outage.unavailable(replica, tasks, timeline)
    await until(lambda: store_unavailable(outage.http, replica.proxy), "readiness names the store", 10)
    await asyncio.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - timeline.started)))  # the fault's length
    await asyncio.to_thread(server.start)
    timeline.mark("store back")
    fresh = await rr.create("slow_compute", {"seconds": 0, "label": "after"})  # serves again, no restart
    timeline.mark("first task created after")
    await all_completed(rr, tasks, seconds, timeline)
    assert result_text(await rr.settled(fresh)) == "slow_compute finished: label=after seconds=0"
    timeline.show()
    assert events(replica, "lease_lost"), "the lease lapsed in the outage"
    [recovery] = events(replica, "lease_lapsed_recovery")
    assert recovery["resumed"] >= TASKS  # and the task created at the store's return, when before the renewal
    assert recovery["stopped"] == 0
    assert replica.proxy.process is not None
    assert replica.proxy.process.poll() is None


async def test_a_frozen_postgresql_is_answered_within_the_deadline_and_fails_nothing(
    dsn: str,
    server: pg.PgServer,
    outage: Outage,
) -> None:
    """SIGSTOP (what a partition looks like: connections open, nothing answers) for twice the lease: answers
    within the deadline, and after the thaw every task the upstream completes is completed."""
    seconds = OUTAGE_SECONDS + 4
    replica, rr, tasks = await outage.running(dsn, seconds, "frozen")
    timeline = Timeline("PostgreSQL frozen")
    server.freeze()
    try:
        timeline.mark("outage start")
        await outage.unavailable(replica, tasks, timeline)
        await asyncio.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - timeline.started)))  # the freeze lasts
    finally:
        server.thaw()
    timeline.mark("store back")
    await all_completed(rr, tasks, seconds, timeline)
    fresh = await rr.create("slow_compute", {"seconds": 0, "label": "after"})
    assert result_text(await rr.settled(fresh)) == "slow_compute finished: label=after seconds=0"
    timeline.show()


async def test_a_replica_cut_off_from_postgresql_loses_its_tasks_to_the_survivor_and_serves_once_healed(
    dsn: str,
    server: pg.PgServer,
    outage: Outage,
) -> None:
    """Fencing stays the arbiter: the survivor takes the cut-off replica's tasks over (failed as interrupted,
    their policy says so) and no write of the cut-off replica reaches them, though its upstream completes the
    calls; once the cut heals, its next tools/call works at once (no connection dead in the cut is used)."""
    host, port = "127.0.0.1", int(pg.as_url(dsn).rsplit(":", 1)[1].split("/", 1)[0])
    road = TcpCut(host, port)
    local_port = await road.start()
    try:
        cut_dsn = pg.as_url(dsn).replace(f":{port}/", f":{local_port}/")
        survivor = await outage.start(dsn)
        other = outage.client(survivor)
        seconds = OUTAGE_SECONDS + 3
        cut_off, rr, tasks = await outage.running(cut_dsn, seconds, "cut")
        timeline = Timeline("one replica cut off")
        road.cut()
        timeline.mark("outage start")
        await outage.unavailable(cut_off, tasks, timeline)

        async def taken_over() -> bool:
            found = [await other.task(task_id) for task_id in tasks]
            return all(task["status"] == "failed" and task["error"]["message"] == TAKEN_OVER for task in found)

        await until(taken_over, "the survivor took the cut-off replica's tasks over", LEASE_SECONDS + 8)
        timeline.mark("taken over")
        await asyncio.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - timeline.started)))  # the cut lasts
        road.heal()
        timeline.mark("store back")
        status, message = await rr.call("slow_compute", {"seconds": 0, "label": "healed"})
        assert status == 200, message  # at once, no dead pooled or creator connection
        timeline.mark("first call after")
        assert result_text(await rr.settled(message["result"]["taskId"])) == (
            "slow_compute finished: label=healed seconds=0"
        )
        await asyncio.sleep(max(0.0, seconds + 1 - (time.monotonic() - timeline.started)))  # its upstream is done

        async def stopped() -> bool:
            return bool(events(cut_off, "lease_lapsed_recovery"))

        await until(stopped, "the cut-off replica noticed its lease lapsed", 10)
        [recovery] = events(cut_off, "lease_lapsed_recovery")
        assert recovery["resumed"] == 0
        for task_id in tasks:  # the survivor's outcome stands: nothing of the cut-off replica's reached them
            task = await other.task(task_id)
            assert task["status"] == "failed"
            assert task["error"]["message"] == TAKEN_OVER
        assert not [event for event in events(cut_off, "task_settled") if event.get("task_id") in tasks]
        timeline.show()
    finally:
        await road.close()


async def test_a_failover_to_a_promoted_standby_through_a_multi_host_url_costs_no_task(
    server: pg.PgServer,
    outage: Outage,
) -> None:
    """A primary and its streaming standby behind `host=a,b` with `target_session_attrs=read-write` (the libpq
    URL form): the primary stops, the standby is promoted, and the replica follows to it by itself; every task
    completes with its own result and the replica serves on."""
    database = await asyncio.to_thread(server.create_database)
    standby = await asyncio.to_thread(pg.start_standby, server)
    try:
        hosts = ",".join(pg.as_url(each.admin_dsn).split("@", 1)[1].split("/", 1)[0] for each in (server, standby))
        seconds = OUTAGE_SECONDS + 4
        url = f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"
        replica, rr, tasks = await outage.running(url, seconds, "failover")
        timeline = Timeline("failover to a promoted standby")
        await asyncio.to_thread(server.halt)
        timeline.mark("outage start")
        await outage.unavailable(replica, tasks, timeline)
        await asyncio.sleep(max(0.0, OUTAGE_SECONDS - (time.monotonic() - timeline.started)))  # the fault's length
        await asyncio.to_thread(pg.promote, standby)
        timeline.mark("store back")

        async def created() -> str | None:
            status, message = await rr.call("slow_compute", {"seconds": 0, "label": "after"})
            return str(message["result"]["taskId"]) if status == 200 else None

        fresh = await until(created, "the replica creates tasks on the new primary", 15)
        timeline.mark("first task created after")
        await all_completed(rr, tasks, seconds, timeline)
        assert result_text(await rr.settled(fresh)) == "slow_compute finished: label=after seconds=0"
        timeline.show()
    finally:
        await asyncio.to_thread(standby.stop)


FINISHING_SECONDS = 2.5  # a call shorter than the outage: its upstream finishes it ~2 s into it
LONG_OUTAGE_SECONDS = 5.0  # past the calls' end and more than twice the lease


async def finished_in_the_outage(replica: Replica, tasks: dict[str, str], timeline: Timeline) -> None:
    """Every call ended while the store was away: its settlement waits in the outbox (none reached the store)."""

    def kept() -> set[str]:
        return {event["task_id"] for event in events(replica, "settlement_pending") if event.get("write") == "settle"}

    await until(lambda: kept() >= set(tasks), lambda: f"settlements kept: {sorted(kept())}", 15)
    timeline.mark("calls finished")
    assert not [event for event in events(replica, "task_settled") if event.get("task_id") in tasks]


def written_late(replica: Replica, tasks: dict[str, str]) -> None:
    """Each task's own settlement (its result) was written from the outbox, none failed as an orphan."""
    late = {event["task_id"]: event for event in events(replica, "settlement_written_late")}
    for task_id in tasks:
        assert late[task_id]["status"] == "completed", late.get(task_id)
    assert not [event for event in events(replica, "settlement_dropped") if event.get("task_id") in tasks]
    assert not [event for event in events(replica, "task_interrupted") if event.get("task_id") in tasks]


async def test_results_produced_while_postgresql_is_stopped_are_written_once_it_is_back(
    dsn: str,
    server: pg.PgServer,
    outage: Outage,
) -> None:
    """The upstream finishes every call while PostgreSQL is stopped and the lease lapses: the results wait in the
    outbox, and once the database is back every task is completed with its own result (never failed as
    interrupted by the lapsed lease)."""
    replica, rr, tasks = await outage.running(dsn, FINISHING_SECONDS, "finished")
    timeline = Timeline("PostgreSQL stopped, calls finishing in the outage")
    await asyncio.to_thread(server.halt)
    timeline.mark("outage start")
    await outage.unavailable(replica, tasks, timeline)
    await finished_in_the_outage(replica, tasks, timeline)
    await asyncio.sleep(max(0.0, LONG_OUTAGE_SECONDS - (time.monotonic() - timeline.started)))  # the fault's length
    await asyncio.to_thread(server.start)
    timeline.mark("store back")
    await all_completed(rr, tasks, FINISHING_SECONDS, timeline)
    timeline.show()
    written_late(replica, tasks)
    assert events(replica, "lease_lost"), "the lease lapsed in the outage"
    fresh = await rr.create("slow_compute", {"seconds": 0, "label": "after"})
    assert result_text(await rr.settled(fresh)) == "slow_compute finished: label=after seconds=0"


async def test_results_produced_while_postgresql_is_frozen_are_written_after_the_thaw(
    dsn: str,
    server: pg.PgServer,
    outage: Outage,
) -> None:
    """The same with a frozen server (connections open, nothing answers): each settlement times out into the
    outbox, and after the thaw every task is completed with its own result."""
    replica, rr, tasks = await outage.running(dsn, FINISHING_SECONDS, "finished-frozen")
    timeline = Timeline("PostgreSQL frozen, calls finishing in the outage")
    server.freeze()
    try:
        timeline.mark("outage start")
        await outage.unavailable(replica, tasks, timeline)
        await finished_in_the_outage(replica, tasks, timeline)
        await asyncio.sleep(max(0.0, LONG_OUTAGE_SECONDS - (time.monotonic() - timeline.started)))  # the freeze lasts
    finally:
        server.thaw()
    timeline.mark("store back")
    await all_completed(rr, tasks, FINISHING_SECONDS, timeline)
    timeline.show()
    written_late(replica, tasks)
    assert events(replica, "lease_lost"), "the lease lapsed in the outage"
