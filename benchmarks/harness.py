"""What the benchmark rows share: the processes (a legacy upstream, proxies), the clients that drive them,
measuring a batch, a result row, and the rows more than one group reports (task creation, push).

Imported by `run.py` (the table) and `replicas.py` (the rows with several replicas); imports neither.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.loadgen import HttpClient
from proxy.wire.sse import SSEParser
from tests import pg
from tests.support.wire import modern_body, modern_headers

ROOT = Path(__file__).resolve().parent.parent


TASKS = "io.modelcontextprotocol/tasks"


LEGACY_VERSION = "2025-11-25"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_for_port(port: int, process: subprocess.Popen[Any], timeout_seconds: float = 30) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening on {port}")
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            await asyncio.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


@dataclass
class Process:
    process: subprocess.Popen[Any]
    url: str

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        """User + system CPU time of the process, all its threads: a cost per call that noise on a shared
        machine disturbs far less than times do."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def spawn(arguments: list[str], python: str = sys.executable, cwd: Path = ROOT) -> subprocess.Popen[Any]:
    """`python` with `arguments`, run from `cwd` (another commit's tree: its packages come first)."""
    env = None if cwd == ROOT else {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.Popen(
        [python, *arguments], cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


async def start_upstream(sdk: bool = False) -> Process:
    """The lean upstream, or (`sdk`) the mcp 1.x SDK fixture server the tests use: what legacy servers run."""
    port = free_port()
    module = "tests.upstream" if sdk else "benchmarks.upstream"
    process = spawn(["-m", module, "--port", str(port)])
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}/mcp")


@dataclass
class SharedStore:
    """What rows with several replicas stand on: a throwaway PostgreSQL database (fsync on), the request-state
    key the replicas share, two upstreams, and every process started for the rows (stopped at the end)."""

    dsn: str
    key: Path
    upstreams: list[Process]
    processes: list[Process]


@asynccontextmanager
async def shared_store(
    workdir: Path, start: Callable[[], Awaitable[Process]] = start_upstream
) -> AsyncIterator[SharedStore]:
    server = await asyncio.to_thread(pg.start_throwaway, durable=True)
    processes: list[Process] = []
    try:
        dsn = pg.as_url(server.dsn(await asyncio.to_thread(server.create_database)))
        key = workdir / "request-state.key"
        key.write_text(os.urandom(32).hex())
        upstreams = [await start() for _ in range(2)]
        processes += upstreams
        yield SharedStore(dsn, key, upstreams, processes)
    finally:
        for process in processes:
            process.stop()
        await asyncio.to_thread(server.stop)


def has_operations_port(tree: Path) -> bool:
    """Does the proxy in `tree` have an operations listener (`observability.port`)? A baseline from before it
    serves its metrics on the MCP port and refuses the field."""
    ops = tree / "proxy" / "edge" / "_ops.py"
    return ops.exists() and "def ops_app" in ops.read_text()


def proxy_config(
    upstream: str | list[str],
    workdir: Path,
    name: str,
    port: int,
    store: dict[str, Any],
    tree: Path = ROOT,
    **sections: Any,
) -> Path:
    """The proxy under test: default settings, except limits high enough for the scale rows. `upstream`: a URL,
    or the argv of a stdio server the proxy runs; `sections`: more top-level config sections. The operations
    listener (of a `tree` that has one) takes a free port: proxies run side by side."""
    config = workdir / f"{name}.yaml"
    observability = {"metrics": False, **sections.pop("observability", {})}
    if has_operations_port(tree):
        observability["port"] = 0
    config.write_text(
        json.dumps(
            {
                "listen": {"host": "127.0.0.1", "port": port, "shutdown_grace_seconds": 1},
                "upstream": {"url": upstream} if isinstance(upstream, str) else {"command": upstream, "cwd": str(ROOT)},
                "store": store,
                "logging": {"level": "warning"},
                "observability": observability,
                "tasks": {
                    "default": {"mode": "optional", "sync_window_ms": 1000, "ttl_ms": 3_600_000},
                    "tools": {"sleep": {"mode": "required"}},
                    "max_running": 20_000,
                    "max_records": 2_000_000,
                },
                "limits": {"max_running_per_principal": 20_000},  # every benchmark client is one caller
                **sections,
            }
        )
    )
    return config


async def start_proxy(
    upstream: str | list[str],
    workdir: Path,
    name: str,
    database: Path | None = None,
    store: dict[str, Any] | None = None,
    cwd: Path = ROOT,
    **sections: Any,
) -> Process:
    """A proxy process on a free port, run from the code in `cwd`; its store is the SQLite file `database`
    (default: one of its own in `workdir`), or the `store` section given."""
    port = free_port()
    store = store or {"path": str(database or workdir / f"{name}.db")}
    config = proxy_config(upstream, workdir, name, port, store, cwd, **sections)
    process = spawn(["-m", "proxy", "serve", "--config", str(config)], cwd=cwd)
    await wait_for_port(port, process)
    return Process(process, f"http://127.0.0.1:{port}/mcp")


def baseline_tree(ref: str, workdir: Path) -> Path | None:
    """The `proxy` package of `ref`, unpacked into `workdir` (None when `ref` cannot be read: no git checkout)."""
    target = workdir / f"baseline-{ref.replace('/', '-')}"
    try:
        archive = subprocess.run(["git", "archive", ref, "proxy"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    target.mkdir(parents=True, exist_ok=True)
    archive_path = target / "proxy.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(target, filter="data")
    return target


class LegacyClient:
    """A 2025-11-25 client: initialize, then calls on its session."""

    def __init__(self, url: str) -> None:
        self.http = HttpClient(url)
        self.headers = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}
        self.ids = 0

    async def start(self) -> None:
        params = {"protocolVersion": LEGACY_VERSION, "capabilities": {}, "clientInfo": {"name": "b", "version": "1"}}
        response = await self.http.post(self._request("initialize", params), self.headers)
        session = response.headers["mcp-session-id"]
        self.headers = {**self.headers, "Mcp-Session-Id": session, "MCP-Protocol-Version": LEGACY_VERSION}
        await self.http.post(
            json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}).encode(), self.headers
        )

    def _request(self, method: str, params: dict[str, Any]) -> bytes:
        self.ids += 1
        return json.dumps({"jsonrpc": "2.0", "id": self.ids, "method": method, "params": params}).encode()

    async def echo(self) -> None:
        response = await self.http.post(self._request("tools/call", ECHO), self.headers)
        assert response.status == 200, response
        assert b'"text":"x"' in response.body.replace(b" ", b""), response

    def close(self) -> None:
        self.http.close()


ECHO = {"name": "echo", "arguments": {"text": "x"}}


class ModernClient:
    def __init__(self, url: str, *, declares_tasks: bool = False) -> None:
        self.http = HttpClient(url)
        self.capabilities: dict[str, Any] = {"extensions": {TASKS: {}}} if declares_tasks else {}
        self.ids = 0

    async def post(self, method: str, params: dict[str, Any], name: str | None = None) -> dict[str, Any]:
        self.ids += 1
        body = modern_body(method, params, request_id=self.ids, capabilities=self.capabilities)
        headers = modern_headers(method, name)
        message: dict[str, Any] = (await self.http.post(json.dumps(body).encode(), headers)).json()
        if "error" in message:
            raise RuntimeError(f"{method}: {message['error']}")
        return message

    async def echo(self) -> None:
        message = await self.post("tools/call", ECHO, "echo")
        assert message["result"]["content"][0]["text"] == "x", message

    async def create(self, seconds: float) -> dict[str, Any]:
        message = await self.post("tools/call", {"name": "sleep", "arguments": {"seconds": seconds}}, "sleep")
        result: dict[str, Any] = message["result"]
        assert result["resultType"] == "task", message
        return result

    async def get(self, task_id: str) -> dict[str, Any]:
        result: dict[str, Any] = (await self.post("tasks/get", {"taskId": task_id}, task_id))["result"]
        return result

    def close(self) -> None:
        self.http.close()


@dataclass
class Sample:
    latencies_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    count: int = 0

    @property
    def rate(self) -> float:
        return self.count / self.seconds if self.seconds else 0.0

    def percentile(self, fraction: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))]

    def merge(self, other: Sample) -> None:
        self.latencies_ms += other.latencies_ms
        self.seconds += other.seconds
        self.count += other.count


async def measure(operation: Callable[[], Awaitable[Any]], count: int, concurrency: int) -> Sample:
    sample = Sample()
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            started = time.perf_counter()
            await operation()
            sample.latencies_ms.append((time.perf_counter() - started) * 1000)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    sample.seconds = time.perf_counter() - started
    sample.count = count
    return sample


async def interleaved(
    first: Callable[[], Awaitable[Any]],
    second: Callable[[], Awaitable[Any]],
    *,
    count: int,
    concurrency: int,
    rounds: int = 6,
) -> tuple[Sample, Sample]:
    """Alternate batches of the two operations, so that noise on the machine hits both alike."""
    totals = (Sample(), Sample())
    for round_number in range(rounds):
        order = (0, 1) if round_number % 2 == 0 else (1, 0)
        for index in order:
            operation = (first, second)[index]
            totals[index].merge(await measure(operation, count // rounds, concurrency))
    return totals


async def side_by_side(
    base: Process, via: Process, quick: bool, settle_seconds: float = 0
) -> tuple[Sample, Sample, float, float]:
    """Both proxies warmed, then modern sync echo batches interleaved at concurrency 16: each side's sample and
    its proxy CPU per call (ms), read `settle_seconds` after the last batch."""
    clients = ModernClient(base.url), ModernClient(via.url)
    try:
        for client in clients:
            await measure(client.echo, 50, 16)
        cpu = (base.cpu_seconds(), via.cpu_seconds())
        base_sample, via_sample = await interleaved(
            clients[0].echo, clients[1].echo, count=600 if quick else 3000, concurrency=16
        )
        await asyncio.sleep(settle_seconds)
        base_cpu = (base.cpu_seconds() - cpu[0]) * 1000 / base_sample.count
        via_cpu = (via.cpu_seconds() - cpu[1]) * 1000 / via_sample.count
        return base_sample, via_sample, base_cpu, via_cpu
    finally:
        for client in clients:
            client.close()


@dataclass
class Row:
    name: str
    figure: str
    target: str
    met: bool | None
    data: dict[str, Any]


async def creation_rows(
    proxy: Process, quick: bool, *, store: str = "SQLite", p50_target_ms: float = 3.0, rate_target: float = 500
) -> list[Row]:
    client = ModernClient(proxy.url, declares_tasks=True)

    async def create() -> None:
        await client.create(600)  # the upstream sleeps; the proxy's cost is the creation itself

    await measure(create, 20, 1)
    sequential = await measure(create, 100 if quick else 300, 1)
    cpu_before = proxy.cpu_seconds()
    concurrent = await measure(create, 300 if quick else 800, 32)
    cpu_ms = (proxy.cpu_seconds() - cpu_before) * 1000 / concurrent.count
    p50, p99 = sequential.percentile(0.5), sequential.percentile(0.99)
    return [
        Row(
            f"task creation (tools/call -> CreateTaskResult, commit included), {store}",
            f"p50 {p50:.2f} ms, p99 {p99:.2f} ms (sequential)",
            f"p50 <= {p50_target_ms:g} ms",
            p50 <= p50_target_ms,
            {"p50_ms": p50, "p99_ms": p99},
        ),
        Row(
            f"task creations per second, concurrency 32, {store}",
            f"{concurrent.rate:.0f}/s (p50 {concurrent.percentile(0.5):.1f} ms); proxy CPU {cpu_ms:.2f} ms/creation",
            f">= {rate_target:g}/s",
            concurrent.rate >= rate_target,
            {"per_second": concurrent.rate, "p50_ms": concurrent.percentile(0.5), "proxy_cpu_ms_per_creation": cpu_ms},
        ),
    ]


async def push_row(
    proxy: Process, quick: bool, listener: Process | None = None, where: str = "one process", target_ms: float = 10.0
) -> Row:
    """How soon a settled task reaches a client that follows it on `subscriptions/listen` (on `listener`, another
    replica, when given), beside a client polling `tasks/get` every 50 ms; both measured from the task's settle
    time (its lastUpdatedAt)."""
    client = ModernClient(proxy.url, declares_tasks=True)
    follow_url = (listener or proxy).url
    pushed: list[float] = []
    polled: list[float] = []
    async with aiohttp.ClientSession() as http:
        for _ in range(15 if quick else 40):
            task_id = (await client.create(0.3))["taskId"]
            push, poll = await asyncio.gather(_follow(http, follow_url, task_id), _poll(client, task_id, 0.05))
            pushed.append(push)
            polled.append(poll)
    p50_push, p50_poll = statistics.median(pushed), statistics.median(polled)
    return Row(
        f"push: settled task to notifications/tasks on a listen stream ({where})",
        f"p50 {p50_push:.1f} ms, p99 {max(pushed):.1f} ms; polling every 50 ms sees it after p50 {p50_poll:.1f} ms",
        f"p50 <= {target_ms:g} ms",
        p50_push <= target_ms,
        {"push_p50_ms": p50_push, "push_max_ms": max(pushed), "poll_50ms_p50_ms": p50_poll},
    )


def _settled_ms_ago(task: dict[str, Any]) -> float:
    settled = datetime.fromisoformat(str(task["lastUpdatedAt"]).replace("Z", "+00:00")).timestamp()
    return (time.time() - settled) * 1000


async def _follow(http: aiohttp.ClientSession, url: str, task_id: str) -> float:
    params = {"notifications": {"taskIds": [task_id]}}
    body = modern_body("subscriptions/listen", params, request_id="push", capabilities={"extensions": {TASKS: {}}})
    headers = modern_headers("subscriptions/listen")
    parser = SSEParser()
    async with http.post(url, json=body, headers=headers) as response:
        async for chunk in response.content.iter_any():
            for event in parser.feed(chunk):
                message = json.loads(event.data) if event.data.strip() else {}
                task = message.get("params", {})
                if message.get("method") == "notifications/tasks" and task.get("status") == "completed":
                    return _settled_ms_ago(task)
    raise RuntimeError("the listen stream ended before the task settled")


async def _poll(client: ModernClient, task_id: str, interval_seconds: float) -> float:
    while True:
        task = await client.get(task_id)
        if task["status"] == "completed":
            return _settled_ms_ago(task)
        await asyncio.sleep(interval_seconds)
