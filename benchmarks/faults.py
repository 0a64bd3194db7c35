"""A randomized fault run: three proxy replicas on one PostgreSQL database, each reaching it through a TCP path
of its own (`tests/support/tcp_cut.py`), under a mixed load of task-making calls, half of them with an
`Idempotency-Key` and retried with it until they are answered, while one fault at a time hits the cluster and is
healed before the next: a replica killed with -9 or stopped with SIGTERM (and started again), PostgreSQL stopped
for 3-8 s or frozen for 3-6 s, one replica cut off from it for 5-10 s. Then every task is followed to its end and
the history is checked (`benchmarks/fault_history.py`).

    python -m benchmarks.faults --seed N [--seconds 150] [--json PATH]

Settings: `store.lease_seconds: 3`, `store.timeout_seconds: 2`, `tasks.drain_seconds: 5`. Loopback only; every
process it starts is stopped at the end. Exit status 1 when something that must hold did not. Not part of the
unit suite (a short run of it is: `tests/test_faults_run.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from benchmarks.fault_history import (
    ANSWER_SECONDS,
    STORE_DEADLINE_MARGIN_SECONDS,
    Fault,
    History,
    Request,
    Task,
    check,
    report,
)
from tests import pg
from tests.support.processes import ProxyProcess, Upstream
from tests.support.sdk import connect, text
from tests.support.tcp_cut import TcpCut
from tests.support.wire import DECLARING, modern_body, modern_headers, read_messages

LEASE_SECONDS = 3.0
STORE_TIMEOUT_SECONDS = 2.0
REPLICAS = 3
WORKERS = 6
TOOLS = {"slow_compute": {"mode": "required"}, "counted": {"mode": "required"}}
FAULTS = ("kill", "term", "stop", "freeze", "cut")
LENGTHS = {"stop": (3.0, 8.0), "freeze": (3.0, 6.0), "cut": (5.0, 10.0), "kill": (0.5, 2.0), "term": (0.0, 0.5)}
QUIET_SECONDS = (2.0, 4.0)  # between one fault healed and the next
READY_SECONDS = 45.0
SETTLE_SECONDS = 90.0  # after the load: every task followed to its end within this
KEY_RETRY_SECONDS = 30.0  # after the load: a keyed call is retried this long at most


class Replica:
    """One pod: a proxy process (started again after a kill or a stop), its own upstream and its own road to the
    database."""

    def __init__(self, index: int, workdir: Path, road: TcpCut, dsn: str, key: Path) -> None:
        self.index = index
        self.workdir = workdir
        self.road = road
        self.dsn = dsn
        self.key = key
        self.upstream = Upstream()
        self.upstream.start()
        self.proxy: ProxyProcess | None = None
        self.replica_id = ""
        self.generations: list[ProxyProcess] = []

    async def start(self, http: aiohttp.ClientSession) -> None:
        directory = self.workdir / f"replica-{self.index}-{len(self.generations)}"
        directory.mkdir()
        self.proxy = ProxyProcess(
            directory,
            self.upstream.url,
            store={
                "url": self.dsn,
                "lease_seconds": LEASE_SECONDS,
                "timeout_seconds": STORE_TIMEOUT_SECONDS,
                "connect_timeout_seconds": 1,
            },
            inputs={"secret_file": str(self.key)},
            upstream={"call_timeout_seconds": 120},
            tasks={"tools": TOOLS, "drain_seconds": 5},
        )
        self.generations.append(self.proxy)
        self.proxy.process = await asyncio.to_thread(self.proxy._spawn)
        await self.ready(http)
        taken = [event for event in self.proxy.events() if event.get("event") == "lease_taken"]
        self.replica_id = str(taken[0]["replica"]) if taken else ""

    async def ready(self, http: aiohttp.ClientSession) -> None:
        assert self.proxy is not None
        deadline = time.monotonic() + READY_SECONDS
        while time.monotonic() < deadline:
            assert self.proxy.process is not None
            assert self.proxy.process.poll() is None, self.proxy.log.read_text()[-4000:]
            try:
                async with http.get(self.proxy.url.replace("/mcp", "/readyz")) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)  # polling readiness, with the deadline above
        raise RuntimeError(f"replica {self.index} not ready within {READY_SECONDS:g} s")

    @property
    def url(self) -> str:
        return self.proxy.url if self.proxy is not None else ""


class Run:
    def __init__(self, seed: int, seconds: float, workdir: Path, server: pg.PgServer, dsn: str) -> None:
        self.rng = random.Random(seed)
        self.seconds = seconds
        self.workdir = workdir
        self.server = server
        self.dsn = dsn
        self.history = History(seed, seconds, STORE_TIMEOUT_SECONDS)
        self.started = time.monotonic()
        self.epoch = time.time()
        self.replicas: list[Replica] = []
        self.loading = True
        self.ended: dict[str, str] = {}  # replica id → how its process ended

    def now(self) -> float:
        return time.monotonic() - self.started

    # --- the cluster -----------------------------------------------------------------------------------------

    async def start(self, http: aiohttp.ClientSession) -> None:
        url = pg.as_url(self.dsn)
        port = int(url.rsplit(":", 1)[1].split("/", 1)[0])
        key = self.workdir / "request-state.key"
        key.write_text(secrets.token_hex(32))
        for index in range(REPLICAS):
            road = TcpCut("127.0.0.1", port)
            through = url.replace(f":{port}/", f":{await road.start()}/")
            replica = await asyncio.to_thread(Replica, index, self.workdir, road, through, key)
            self.replicas.append(replica)
            await replica.start(http)

    async def stop(self) -> None:
        for replica in self.replicas:
            for proxy in replica.generations:
                await asyncio.to_thread(proxy.stop)
            await asyncio.to_thread(replica.upstream.stop)
            await replica.road.close()

    # --- the load --------------------------------------------------------------------------------------------

    async def post(
        self, http: aiohttp.ClientSession, kind: str, method: str, params: dict[str, Any], key: str | None = None
    ) -> tuple[Request, dict[str, Any]]:
        replica = self.rng.randrange(REPLICAS)
        name = params.get("taskId", params.get("name"))
        headers = modern_headers(method, name)
        if key is not None:
            headers["Idempotency-Key"] = f'"{key}"'
        request = Request(kind, replica, self.now(), 0.0, None, key=key)
        final: dict[str, Any] = {}
        try:
            async with asyncio.timeout(ANSWER_SECONDS):
                body = modern_body(method, params, capabilities=DECLARING)
                async with http.post(self.replicas[replica].url, json=body, headers=headers) as response:
                    final = (await read_messages(response))[-1]
                    request.status = response.status
                    request.retry_after = response.headers.get("Retry-After")
        except TimeoutError:
            request.error = "timeout"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            request.error = f"transport: {type(exc).__name__}"
        request.seconds = self.now() - request.started
        if "error" in final:
            request.error = str(final["error"].get("message", ""))
        self.history.add(request)
        return request, final

    async def worker(self, http: aiohttp.ClientSession, number: int) -> None:
        while self.loading:
            seconds = round(self.rng.uniform(0.2, 4.0), 1)
            if self.rng.random() < 0.5:
                key = f"key-{number}-{secrets.token_hex(6)}"
                await self.keyed(http, key, {"name": "counted", "arguments": {"key": key, "seconds": seconds}})
            else:
                label = f"label-{number}-{secrets.token_hex(6)}"
                params = {"name": "slow_compute", "arguments": {"seconds": seconds, "label": label}}
                request, final = await self.post(http, "call", "tools/call", params)
                if request.status == 200 and "result" in final:
                    expected = f"slow_compute finished: label={label} seconds={seconds:g}"
                    self.follow(str(final["result"]["taskId"]), "slow_compute", expected, None)
            await asyncio.sleep(self.rng.uniform(0.1, 0.6))  # the load's pace

    async def keyed(self, http: aiohttp.ClientSession, key: str, params: dict[str, Any]) -> None:
        """Sent until a task is answered (a 503, a replica down: again, with the key), then once or twice more
        sometimes (a duplicate delivery: the same task)."""
        repeats = self.rng.choice((0, 0, 1, 2))
        while self.loading or self.now() < self.seconds + KEY_RETRY_SECONDS:
            request, final = await self.post(http, "call", "tools/call", params, key)
            if request.status == 200 and "result" in final:
                request.task_id = str(final["result"]["taskId"])
                self.follow(request.task_id, "counted", "1", key)
                if repeats == 0:
                    return
                repeats -= 1
            pause = float(request.retry_after) if request.retry_after and request.retry_after.isdigit() else 0.5
            await asyncio.sleep(min(pause, 1.0) * self.rng.uniform(0.5, 1.0))  # a client's retry pace

    def follow(self, task_id: str, tool: str, expected: str, key: str | None) -> None:
        self.history.tasks.setdefault(task_id, Task(task_id, tool, expected, key))

    async def poller(self, http: aiohttp.ClientSession, until_settled: bool = False) -> None:
        """tasks/get of every task not seen terminal yet, about once a second each; after the load, until all
        are terminal (or SETTLE_SECONDS), then every task once more (a terminal state must stay)."""
        settle_by = None
        while True:
            open_tasks = [t for t in self.history.tasks.values() if not t.seen or t.seen[-1][0] in LIVE]
            if until_settled:
                settle_by = settle_by or self.now() + SETTLE_SECONDS
                if not open_tasks or self.now() > settle_by:
                    break
            elif not self.loading:
                return
            for task in open_tasks:
                await self.look(http, task)
            await asyncio.sleep(1.0)  # the poll interval
        for task in list(self.history.tasks.values()):
            await self.look(http, task)

    async def look(self, http: aiohttp.ClientSession, task: Task) -> None:
        request, final = await self.post(http, "get", "tasks/get", {"taskId": task.task_id})
        if request.status == 200 and "result" in final:
            result = final["result"]
            if "result" in result:
                seen = "".join(block.get("text", "") for block in result["result"].get("content", []))
            else:
                seen = str(result.get("error", {}).get("message", ""))
            task.seen.append((str(result["status"]), seen))

    # --- the faults ------------------------------------------------------------------------------------------

    async def faults(self, http: aiohttp.ClientSession) -> None:
        while self.now() < self.seconds - 12:
            await asyncio.sleep(self.rng.uniform(*QUIET_SECONDS))
            kind = self.rng.choice(FAULTS)
            fault = Fault(kind, self.now())
            length = self.rng.uniform(*LENGTHS[kind])
            replica = self.replicas[self.rng.randrange(REPLICAS)]
            if kind in {"kill", "term", "cut"}:
                fault.replica, fault.replica_id = replica.index, replica.replica_id
            self.history.faults.append(fault)
            print(f"{fault.started:6.1f} s  {kind} {'' if fault.replica is None else fault.replica}", flush=True)
            if kind in {"kill", "term"}:
                process = replica.proxy.process if replica.proxy is not None else None
                assert process is not None
                process.send_signal(signal.SIGKILL if kind == "kill" else signal.SIGTERM)
                code = await asyncio.to_thread(process.wait, 60)
                how = "killed -9" if kind == "kill" else f"terminated (exit {code})"
                self.ended[replica.replica_id] = f"{how} at {fault.started:.1f} s"
                await asyncio.sleep(length)  # down this long
                await replica.start(http)
            elif kind == "stop":
                await asyncio.to_thread(self.server.halt)
                await asyncio.sleep(max(0.0, length - (self.now() - fault.started)))  # the outage's length
                await asyncio.to_thread(self.server.start)
            elif kind == "freeze":
                self.server.freeze()
                try:
                    await asyncio.sleep(length)  # the freeze's length
                finally:
                    self.server.thaw()
            else:
                replica.road.cut()
                await asyncio.sleep(length)  # the cut's length
                replica.road.heal()
            fault.lasted = self.now() - fault.started
            for each in self.replicas:  # healed before the next one: every replica serves again
                await each.ready(http)
            fault.healed = self.now()

    # --- the end ---------------------------------------------------------------------------------------------

    async def collect(self) -> None:
        """What the store and the upstreams hold now, and what every replica logged."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            rows = conn.execute("SELECT key, owner, created_at_ms FROM idempotency_keys WHERE outcome IS NULL")
            self.history.claims_left = [{"key": r[0], "owner": r[1], "created_at_ms": r[2]} for r in rows]
        for replica in self.replicas:
            async with connect(replica.upstream.url) as conn:
                for key in self.history.keys:
                    runs = int(text(await conn.session.call_tool("call_count", {"key": key})))
                    self.history.runs_per_key[key] = self.history.runs_per_key.get(key, 0) + runs
        for replica in self.replicas:
            if replica.replica_id and replica.replica_id not in self.ended:
                self.ended[replica.replica_id] = "alive"
            for proxy in replica.generations:
                self.history.events.extend(proxy.events())
        self.history.replicas = dict(self.ended)


LIVE = {"working", "input_required"}


async def run(
    seed: int, seconds: float, deadline_margin: float = STORE_DEADLINE_MARGIN_SECONDS
) -> tuple[dict[str, Any], list[str]]:
    """One run of `seconds` with `seed`: its figures and what did not hold (`fault_history.check`)."""
    server = await asyncio.to_thread(pg.start_throwaway)
    try:
        dsn = server.dsn(await asyncio.to_thread(server.create_database))
        with tempfile.TemporaryDirectory(prefix="mcp-tasks-proxy-faults-") as workdir:
            timeout = aiohttp.ClientTimeout(total=None)
            async with aiohttp.ClientSession(timeout=timeout) as http:
                fault_run = Run(seed, seconds, Path(workdir), server, dsn)
                try:
                    await fault_run.start(http)
                    fault_run.started = time.monotonic()
                    fault_run.epoch = time.time()
                    async with asyncio.TaskGroup() as group:
                        for number in range(WORKERS):
                            group.create_task(fault_run.worker(http, number))
                        group.create_task(fault_run.poller(http))
                        await fault_run.faults(http)
                        await asyncio.sleep(max(0.0, seconds - fault_run.now()))  # the load runs its whole length
                        fault_run.loading = False
                    await fault_run.poller(http, until_settled=True)
                    await fault_run.collect()
                finally:
                    await fault_run.stop()
                return check(fault_run.history, fault_run.epoch, deadline_margin)
    finally:
        await asyncio.to_thread(server.stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=150.0, help="how long the load and the faults go on")
    parser.add_argument("--json", type=Path, help="also write the figures and violations here")
    args = parser.parse_args()
    figures, violations = asyncio.run(run(args.seed, args.seconds))
    print(report(figures, violations))
    if args.json is not None:
        args.json.write_text(json.dumps({"figures": figures, "violations": violations}, indent=2))
    sys.exit(1 if violations else 0)


if __name__ == "__main__":
    main()
