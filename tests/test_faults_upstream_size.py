"""Fault tests (`faults` marker): an upstream whose answers are too large, and clients that never read.

The proxy runs as a process of its own, so its memory can be read from /proc. Whatever the upstream sends and
however slowly clients read, memory stays bounded by configuration, and the proxy keeps answering its health
probe on time.
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from asyncio.subprocess import PIPE
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support.clients import rpc, task_until
from tests.support.processes import ProxyProcess, Upstream
from tests.support.wire import DECLARING, modern_body, modern_headers

pytestmark = pytest.mark.faults

CAP = 8 << 20  # limits.max_result_bytes in these tests
OVER_CAP = 60_000_000  # an answer the upstream sends that the proxy must never hold whole
UNDER_CAP = 7_000_000  # a settled result larger than what the kernel buffers for a client that does not read
WRITE_TIMEOUT_SECONDS = 2.0
RSS_BOUND_BYTES = 128 << 20  # growth allowed over the idle proxy, for everything below
# The health probe meanwhile, beside a control server that shares the machine but none of the proxy's work: the
# proxy's p95 within 50 ms of the control's, its slowest within STALL_BOUND_SECONDS of the control's slowest.
# Before the size limit, one 50 MB answer stalled the probe for over half a second; before settled results were
# sent as their stored text, three polls of the 7 MB result stalled it 68-101 ms. Run alone, the slowest probe
# is now 27-41 ms (the 7 MB result arriving and being stored). On a loaded machine every process waits for a CPU
# (a bare p95 bound failed at 70-101 ms there), so the bound is what the proxy adds over the control, measured
# in the same run.
HEALTH_P95_SECONDS = 0.05
STALL_BOUND_SECONDS = 0.3


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


_CONTROL = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK wait between them
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *args):
        pass
server = http.server.HTTPServer(("127.0.0.1", 0), Health)
print(server.server_address[1], flush=True)
server.serve_forever()
"""

_WATCH = """
import http.client, json, sys, threading, time
ports, latencies, stop = sys.argv[1:], {}, threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
connections = {port: http.client.HTTPConnection("127.0.0.1", int(port), timeout=10) for port in ports}
while not stop.is_set():
    for port, connection in connections.items():
        started = time.perf_counter()
        connection.request("GET", "/healthz")
        response = connection.getresponse()
        response.read()
        if response.status != 200:
            sys.exit(f"/healthz on {port} answered {response.status}")
        latencies.setdefault(port, []).append(time.perf_counter() - started)
    time.sleep(0.02)
print(json.dumps(latencies))
"""


def _p95(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[int(len(ordered) * 0.95)]


class HealthWatch:
    """Polls /healthz every 20 ms meanwhile, on the proxy and on a control server (a process of its own that does
    nothing else), and keeps how long each answer took. The probe runs in a process of its own, so what the test
    itself does meanwhile (decoding a multi-megabyte answer) never delays it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.latencies: list[float] = []
        self.control: list[float] = []
        self._control_port = 0
        self._process: asyncio.subprocess.Process | None = None
        self._control: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> HealthWatch:
        self._control = await asyncio.create_subprocess_exec(sys.executable, "-c", _CONTROL, stdout=PIPE)
        assert self._control.stdout is not None
        self._control_port = int(await asyncio.wait_for(self._control.stdout.readline(), 30))
        self._process = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _WATCH, str(self.port), str(self._control_port), stdin=PIPE, stdout=PIPE
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._process is not None
        assert self._control is not None
        try:
            out, _ = await asyncio.wait_for(self._process.communicate(b""), 30)
        finally:
            self._control.kill()
            await self._control.wait()
        assert self._process.returncode == 0, "the /healthz probe failed"
        latencies = json.loads(out)
        self.latencies, self.control = latencies[str(self.port)], latencies[str(self._control_port)]

    def check(self) -> None:
        assert len(self.latencies) > 10
        p95, control_p95 = _p95(self.latencies), _p95(self.control)
        assert p95 < control_p95 + HEALTH_P95_SECONDS, (
            f"/healthz p95 {p95 * 1000:.0f} ms, the control's {control_p95 * 1000:.0f} ms"
        )
        slowest, control_slowest = max(self.latencies), max(self.control)
        assert slowest < control_slowest + STALL_BOUND_SECONDS, (
            f"/healthz stalled {slowest * 1000:.0f} ms, the control's slowest {control_slowest * 1000:.0f} ms"
        )


def non_reading_poll(port: int, task_id: str) -> socket.socket:
    """A client with a tiny receive window that sends tasks/get and never reads the answer."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps(modern_body("tasks/get", {"taskId": task_id}, capabilities=DECLARING)).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in modern_headers("tasks/get", task_id).items())
    sock.sendall(f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


def read_until_closed(sock: socket.socket) -> int | None:
    """Everything the proxy still delivers until it closes the connection (or resets it); None when it keeps
    the connection open."""
    sock.settimeout(5)
    received = 0
    try:
        while chunk := sock.recv(1 << 16):
            received += len(chunk)
    except ConnectionResetError:
        pass
    except TimeoutError:
        return None
    finally:
        sock.close()
    return received


async def test_answers_over_the_cap_are_never_held_and_slow_readers_are_dropped(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    """An upstream of its own: producing answers this large keeps it busy after the test's last request."""
    proxy = ProxyProcess(
        tmp_path,
        own_upstream.url,
        limits={"max_result_bytes": CAP, "write_timeout_seconds": WRITE_TIMEOUT_SECONDS},
        tasks={"tools": {"big_text": {"mode": "optional", "sync_window_ms": 0}}},
    )
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    async with aiohttp.ClientSession() as session, HealthWatch(proxy.port) as health:
        await rpc(session, proxy.url, "tools/call", {"name": "echo", "arguments": {"text": "warm"}}, {})
        idle = rss_bytes(proxy.process.pid)
        too_big: dict[str, Any] = {"name": "big_text", "arguments": {"size": OVER_CAP}}

        status, message = await rpc(session, proxy.url, "tools/call", too_big, {})  # synchronous
        assert status == 502, message
        assert message["error"]["code"] == -32603
        assert message["error"]["data"] == {"limit": "max_result_bytes", "max": CAP}

        status, message = await rpc(session, proxy.url, "tools/call", too_big, DECLARING)  # as a task
        assert status == 200, message
        failed = await task_until(
            session, proxy.url, message["result"]["taskId"], lambda task: task["status"] != "working"
        )
        assert failed["status"] == "failed"
        assert failed["error"]["data"] == {"limit": "max_result_bytes", "max": CAP}

        fits = {"name": "big_text", "arguments": {"size": UNDER_CAP}}
        status, message = await rpc(session, proxy.url, "tools/call", fits, DECLARING)
        task_id = message["result"]["taskId"]
        done = await task_until(session, proxy.url, task_id, lambda task: task["status"] == "completed")
        answer_bytes = len(json.dumps(done))
        pollers = [non_reading_poll(proxy.port, task_id) for _ in range(3)]
        await asyncio.sleep(WRITE_TIMEOUT_SECONDS + 1)  # never read meanwhile
        peak = rss_bytes(proxy.process.pid)
        received = await asyncio.gather(*(asyncio.to_thread(read_until_closed, sock) for sock in pollers))
        # The proxy gave up on each of them: it closed the connection before its answer was through.
        assert all(count is not None and count < answer_bytes for count in received), (received, answer_bytes)
        status, _ = await rpc(session, proxy.url, "tools/call", {"name": "echo", "arguments": {"text": "alive"}}, {})
        assert status == 200
    assert peak - idle < RSS_BOUND_BYTES, f"RSS grew {(peak - idle) >> 20} MiB"
    health.check()


async def test_a_large_streamed_answer_within_the_cap_does_not_stall_the_proxy(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    """Reading a large SSE event is linear in its size (each byte scanned once): with the default cap, the health
    probe is answered on time throughout."""
    proxy = ProxyProcess(tmp_path, upstream.url)
    processes.append(proxy)
    await proxy.start()
    size = 4_000_000  # just under the default limits.max_result_bytes, JSON included
    async with aiohttp.ClientSession() as session, HealthWatch(proxy.port) as health:
        params = {"name": "big_text", "arguments": {"size": size}}
        for _ in range(10):
            status, message = await rpc(session, proxy.url, "tools/call", params, {})
            assert status == 200
            assert len(message["result"]["content"][0]["text"]) == size
    health.check()


async def test_a_listener_that_stops_reading_is_dropped_and_memory_stays_flat(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    """A client follows 40 busy tasks (progress with long messages: a few MB of notifications a second) and
    never reads: what the proxy holds for it stays bounded, and once a write has waited
    `limits.write_timeout_seconds` the connection is closed."""
    proxy = ProxyProcess(
        tmp_path,
        own_upstream.url,
        limits={"write_timeout_seconds": WRITE_TIMEOUT_SECONDS},
        tasks={"tools": {"sleep": {"mode": "required"}}},
    )
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    async with aiohttp.ClientSession() as session:
        await rpc(session, proxy.url, "tools/call", {"name": "echo", "arguments": {"text": "warm"}}, {})
        idle = rss_bytes(proxy.process.pid)
        task_ids = []
        for _ in range(40):
            params = {"name": "sleep", "arguments": {"seconds": 8, "pad": 20_000}}
            status, message = await rpc(session, proxy.url, "tools/call", params, DECLARING)
            assert status == 200, message
            task_ids.append(message["result"]["taskId"])
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", proxy.port))
        listen = {"notifications": {"taskIds": task_ids}}
        body = json.dumps(modern_body("subscriptions/listen", listen, capabilities=DECLARING)).encode()
        head = "".join(f"{name}: {value}\r\n" for name, value in modern_headers("subscriptions/listen").items())
        sock.sendall(
            f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        peak = idle
        deadline = asyncio.get_running_loop().time() + 7
        while asyncio.get_running_loop().time() < deadline:  # the tasks run on; the listener reads nothing
            peak = max(peak, rss_bytes(proxy.process.pid))
            await asyncio.sleep(0.2)
        received = await asyncio.to_thread(read_until_closed, sock)
        assert received is not None, "the proxy kept the stream of a client that does not read"
        status, _ = await rpc(session, proxy.url, "tools/call", {"name": "echo", "arguments": {"text": "alive"}}, {})
        assert status == 200
    assert peak - idle < 48 << 20, f"RSS grew {(peak - idle) >> 20} MiB"
