"""End to end: proxy replicas (`python -m proxy serve`) on one PostgreSQL server of the test's own, while the
server restarts or freezes, with the settings of a deployment tuned for quick failover (lease 3 s, store
deadline 2 s).

A restart is no evidence that a replica died: three replicas, each reaching the server through a TCP path of
its own that opens again at its own instant after the restart, keep their tasks, write the results their
upstreams produced during the outage, and take nothing over from each other. A keyed call answered 503 while
the server is frozen leaves its key free: once thawed, the same key runs the tool at once on either replica,
and a repeat after that is answered from the key's record. Each test prints its fault's timeline.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests import pg
from tests.support.clients import Tasks
from tests.support.cluster import Replica, client
from tests.support.schemas import ModernSchema, SchemaValidator
from tests.support.sdk import calls_started
from tests.support.tcp_cut import TcpCut
from tests.support.waiting import until
from tests.support.wire import modern_body, modern_headers, read_messages, result_text

pytestmark = pytest.mark.faults

LEASE_SECONDS = 3.0
TIMEOUT_SECONDS = 2.0
MARGIN_SECONDS = 1.0  # a loaded 2-core machine: an answer this late is still "within the deadline"
STORE: dict[str, Any] = {"timeout_seconds": TIMEOUT_SECONDS, "connect_timeout_seconds": 1}
TOOLS: dict[str, Any] = {"slow_compute": {"mode": "required"}, "counted": {"mode": "forbidden"}}
RESTART_SECONDS = 10.0
CALL_SECONDS = 3.0  # each call ends during the outage
TASKS = 30
STAGGER_SECONDS = 0.75  # replica i's path to the server opens i times this after the server is back
JOIN_TIMEOUT_SECONDS = 10.0  # a repeat that waited for a claim nobody holds would be answered 409 after this


class Timeline:
    """What happened when, in seconds from the fault's start; printed at the end of the test (pytest -s)."""

    def __init__(self, fault: str) -> None:
        self.fault = fault
        self.started = time.monotonic()
        self.marks: dict[str, float] = {}

    def mark(self, what: str) -> None:
        self.marks.setdefault(what, round(time.monotonic() - self.started, 2))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def show(self) -> None:
        print(f"\ntimeline of {self.fault}: " + ", ".join(f"{what} {at:.2f} s" for what, at in self.marks.items()))


class Bench:
    """Replicas on a database of the test's own server, each through a TCP path of its own, and their clients."""

    def __init__(
        self, workdir: Path, http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks: SchemaValidator
    ) -> None:
        self.workdir = workdir
        self.http = http
        self.schema = modern_schema
        self.tasks_schema = tasks
        self.key = workdir / "request-state.key"
        self.key.write_text("k" * 64)
        self.replicas: list[Replica] = []
        self.roads: list[TcpCut] = []

    async def start(self, dsn: str, count: int, sections: dict[str, dict[str, Any]] | None = None) -> None:
        url = pg.as_url(dsn)
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        for _ in range(count):
            road = TcpCut("127.0.0.1", port)
            self.roads.append(road)
            through = url.replace(f":{port}/", f":{await road.start()}/")
            replica = await asyncio.to_thread(
                Replica, self.workdir, through, self.key, LEASE_SECONDS, TOOLS, store=STORE, sections=sections
            )
            self.replicas.append(replica)

    def client(self, index: int) -> Tasks:
        return client(self.http, [self.replicas[index]], self.schema, self.tasks_schema)[0]

    async def ready(self) -> bool:
        """Every replica answers /readyz 200 (asked on the test's loop, which also runs the TCP paths)."""
        for replica in self.replicas:
            async with self.http.get(replica.proxy.url.replace("/mcp", "/readyz")) as response:
                if response.status != 200:
                    return False
        return True

    def events(self, name: str) -> list[dict[str, Any]]:
        return [event for replica in self.replicas for event in replica.events() if event.get("event") == name]

    async def close(self) -> None:
        for replica in self.replicas:
            await asyncio.to_thread(replica.stop)
        for road in self.roads:
            await road.close()


@pytest.fixture
async def bench(
    tmp_path: Path, http: aiohttp.ClientSession, modern_schema: ModernSchema, tasks_schema: SchemaValidator
) -> AsyncIterator[Bench]:
    started = Bench(tmp_path, http, modern_schema, tasks_schema)
    try:
        yield started
    finally:
        await started.close()


@pytest.fixture
async def dsn(own_pg_server: pg.PgServer) -> str:
    return own_pg_server.dsn(await asyncio.to_thread(own_pg_server.create_database))


async def test_a_postgresql_restart_under_three_replicas_costs_no_result_and_takes_nothing_over(
    dsn: str, own_pg_server: pg.PgServer, bench: Bench
) -> None:
    """30 tasks whose upstream calls end while PostgreSQL is stopped for 10 s: every lease lapses by the
    database's clock, the replicas come back one after the other, and each renews in time (a lease period
    counted from the database's return), keeps its tasks and writes their results. None is failed as
    interrupted, no replica is taken over, no settlement is refused."""
    await bench.start(dsn, 3)
    clients = [bench.client(index) for index in range(3)]
    labels = [f"restart-{number}" for number in range(TASKS)]
    tasks = {
        await clients[number % 3].create("slow_compute", {"seconds": CALL_SECONDS, "label": label}): label
        for number, label in enumerate(labels)
    }
    timeline = Timeline("PostgreSQL stopped 10 s under three replicas")
    for road in bench.roads:
        road.cut()
    await asyncio.to_thread(own_pg_server.halt)
    timeline.mark("outage start")

    def kept() -> set[str]:
        return {event["task_id"] for event in bench.events("settlement_pending") if event.get("write") == "settle"}

    await until(lambda: kept() >= set(tasks), lambda: f"{len(kept())} of {TASKS} results kept", CALL_SECONDS + 10)
    timeline.mark("every call ended")
    await asyncio.sleep(max(0.0, RESTART_SECONDS - timeline.elapsed()))  # the outage's length
    await asyncio.to_thread(own_pg_server.start)
    timeline.mark("store back")
    for index, road in enumerate(bench.roads):  # each replica reconnects at its own instant
        await asyncio.sleep(max(0.0, RESTART_SECONDS + index * STAGGER_SECONDS - timeline.elapsed()))
        road.heal()
        timeline.mark(f"replica {index} reconnects")
    for task_id, label in tasks.items():
        done = await clients[0].settled(task_id, timeout_seconds=30)
        assert done["status"] == "completed", done
        assert result_text(done) == f"slow_compute finished: label={label} seconds={CALL_SECONDS:g}"
    timeline.mark("last task completed")
    timeline.show()
    assert bench.events("replica_taken_over") == []
    assert [event for event in bench.events("task_interrupted") if event.get("task_id") in tasks] == []
    assert bench.events("settlement_refused") == []
    late = {event["task_id"] for event in bench.events("settlement_written_late")}
    assert late >= set(tasks)  # each by the replica that ran it, after its renewal


async def keyed_call(http: aiohttp.ClientSession, url: str, key: str) -> tuple[float, int, dict[str, str], Any]:
    """A keyed `counted` call (it counts its runs per key): how long it took, status, headers, final message."""
    params = {"name": "counted", "arguments": {"key": key, "seconds": 0}}
    started = time.monotonic()
    headers = {**modern_headers("tools/call", "counted"), "Idempotency-Key": f'"{key}"'}
    async with http.post(url, json=modern_body("tools/call", params), headers=headers) as response:
        messages = await read_messages(response)
        return time.monotonic() - started, response.status, dict(response.headers), messages[-1]


def ran(final: dict[str, Any]) -> str | None:
    """How many times `counted` ran for the key, as the call's result says (None for an error)."""
    if "result" not in final:
        return None
    return "".join(block.get("text", "") for block in final["result"]["content"])


async def test_a_keyed_call_refused_while_postgresql_is_frozen_leaves_its_key_free_on_either_replica(
    dsn: str, own_pg_server: pg.PgServer, bench: Bench
) -> None:
    """Two keyed calls to one replica while the server is frozen: each is answered 503 with Retry-After within
    the deadline, before its tool ran. Once thawed, each key runs at once (never a wait for the join timeout,
    never "interrupted"): one on the replica that was refused, one on the other; the tool ran once per key."""
    sections = {"idempotency": {"join_timeout_seconds": JOIN_TIMEOUT_SECONDS}}
    await bench.start(dsn, 2, sections)
    urls = [replica.proxy.url for replica in bench.replicas]
    mine, other = (f"frozen-{name}-{secrets.token_hex(4)}" for name in ("mine", "other"))
    timeline = Timeline("PostgreSQL frozen during keyed calls")
    own_pg_server.freeze()
    try:
        timeline.mark("freeze")
        refused = await asyncio.gather(*(keyed_call(bench.http, urls[0], key) for key in (mine, other)))
        timeline.mark("503s answered")
    finally:
        own_pg_server.thaw()
    timeline.mark("thaw")
    for took, status, headers, final in refused:
        assert status == 503, final
        assert headers["Retry-After"].isdigit()
        assert "task store is unavailable" in final["error"]["message"]
        assert took < TIMEOUT_SECONDS + MARGIN_SECONDS, f"answered after {took:.2f} s"
    await until(bench.ready, "both replicas ready after the thaw", 10)
    timeline.mark("both ready")
    for key, url in ((mine, urls[0]), (other, urls[1])):
        took, status, _, final = await keyed_call(bench.http, url, key)
        assert (status, ran(final)) == (200, "1"), f"{status} after {took:.2f} s: {final}"
        assert took < TIMEOUT_SECONDS + MARGIN_SECONDS, f"{key} answered after {took:.2f} s"
    timeline.mark("both keys ran")
    for key, url in ((mine, urls[1]), (other, urls[0])):  # the repeats: the recorded outcome, on the other replica
        _, status, _, final = await keyed_call(bench.http, url, key)
        assert (status, ran(final)) == (200, "1"), final
    timeline.show()
    runs = [await calls_started(replica.upstream.url, "counted") for replica in bench.replicas]
    assert runs == [1, 1]  # the tool never ran during the freeze, then once per key, on the replica asked first
    assert bench.events("idempotency_key_interrupted") == []
