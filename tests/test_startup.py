"""End to end: what a start says, with `python -m proxy serve` as a child process and its JSON log read back.
The start line names the version, the config, the upstream (no credentials), the store and the endpoint; a
start that cannot go on is one error line and an exit code of its own (a port taken by a socket this test
holds, a second proxy on the same SQLite file, PostgreSQL stopped); an upstream that refuses, or answers
`initialize` with 404, is a warning and an unready `/readyz`, not a failed start; a bind beyond loopback warns
about Host checking, and a refused Host is named in the 403; Ctrl-C during a drain says that a second one stops
now, and a second one does; exploring `/drainz` never starts a drain.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp import web

from proxy.config.loader import load_config
from proxy.edge.startup import (
    EXIT_CANNOT_LISTEN,
    EXIT_STORE_LOCKED,
    EXIT_STORE_UNAVAILABLE,
    EXIT_UPSTREAM_COMMAND,
    start_fields,
)
from proxy.upstream.session import PROXY_VERSION
from tests import pg
from tests.support.processes import ROOT, ProxyProcess, Upstream, free_port, key_file
from tests.support.waiting import until
from tests.support.wire import DECLARING, modern_body, modern_headers, parse_sse

START_TIMEOUT_SECONDS = 60  # a failed start on a busy 2-core machine (imports, then the failure)


def events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def failed_start(tmp_path: Path, config: dict[str, Any]) -> tuple[int, str]:
    """Run `serve` with `config` to its end: the exit code and what it wrote to stderr (its log)."""
    path = tmp_path / f"failing-{time.monotonic_ns()}.yaml"
    defaults = {"logging": {"level": "info", "format": "json"}, "observability": {"port": 0}}  # 0: never a port in use
    path.write_text(yaml.safe_dump({**defaults, **config}))
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--config", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_SECONDS,
        check=False,
    )
    return done.returncode, done.stderr


def the_failure(stderr: str) -> dict[str, Any]:
    """The one start_failed line, and no traceback around it."""
    assert "Traceback" not in stderr, stderr
    failures = [event for event in events(stderr) if event["event"] == "start_failed"]
    assert len(failures) == 1, stderr
    assert failures[0]["level"] == "error"
    return failures[0]


async def get(http: aiohttp.ClientSession, url: str, **headers: str) -> tuple[int, dict[str, Any]]:
    async with http.get(url, headers=headers) as response:
        return response.status, await response.json(content_type=None)


# --- the start line -------------------------------------------------------------------------------------------


async def test_the_start_line_names_version_config_upstream_store_and_endpoint_without_credentials(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    with_secrets = upstream.url.replace("http://", "http://someone:hunter2@") + "?token=hunter2"
    proxy = ProxyProcess(tmp_path, with_secrets)
    processes.append(proxy)
    await proxy.start()
    started = [event for event in proxy.events() if event["event"] == "started"]
    assert len(started) == 1
    line = started[0]
    assert line["level"] == "info"
    assert line["version"] == PROXY_VERSION
    assert line["config"] == str(proxy.config.resolve())
    assert line["upstream"].startswith(upstream.url + "?")  # that there is a query is said, not what it holds
    assert line["store"] == f"sqlite: {(tmp_path / 'ops.db').resolve()}"
    assert line["endpoint"] == proxy.url
    assert line["operations"] == proxy.ops_url("")
    assert line["relayed"] == [
        "/.well-known/*",
        "the authorization endpoints its metadata names, when the upstream requires credentials",
    ]
    log = proxy.log.read_text()
    assert "hunter2" not in log
    assert "someone" not in log
    assert "Running on" not in log  # aiohttp's banner is off: every line of the log is JSON
    assert all(line.startswith("{") for line in log.splitlines())
    assert not [event for event in proxy.events() if event["event"] == "listening_beyond_loopback"]


def test_the_start_line_shows_a_stdio_server_and_postgresql_without_their_secrets(tmp_path: Path) -> None:
    config = load_config(
        None,
        environ={},
        overrides={
            "upstream": {"url": "", "command": ["/usr/local/bin/legacy-server", "--api-key", "hunter2"]},
            "store": {"url": "postgresql://proxy@db.internal:5433/tasks"},
            "security": {"key_file": key_file(tmp_path)},
        },
    )
    fields = start_fields(config, None)
    assert fields["config"] == "defaults"
    assert fields["upstream"] == "stdio: legacy-server (2 arguments)"
    assert fields["store"] == "postgresql: db.internal:5433/tasks"
    assert "hunter2" not in json.dumps(fields)
    assert "proxy@" not in json.dumps(fields)


def test_the_start_line_shows_every_host_of_a_multi_host_postgresql_url(tmp_path: Path) -> None:
    """libpq's failover form (`host=a,b` as a URL with two hosts) starts the proxy and shows each host."""
    config = load_config(
        None,
        environ={},
        overrides={
            "upstream": {"url": "http://127.0.0.1:9/mcp"},
            "store": {"url": "postgresql://proxy@10.0.0.1:5432,10.0.0.2:5433/tasks?target_session_attrs=read-write"},
            "security": {"key_file": key_file(tmp_path)},
        },
    )
    assert start_fields(config, None)["store"] == "postgresql: 10.0.0.1:5432,10.0.0.2:5433/tasks"


# --- start failures: one line, an exit code each ----------------------------------------------------------------


@pytest.mark.parametrize("field", ["listen.port", "observability.port", "admin.port"])
def test_a_port_in_use_is_one_error_line_and_exit_code_3_and_creates_nothing(tmp_path: Path, field: str) -> None:
    """Every listener is bound before the store is opened or the upstream contacted: the failure names the key
    to set, and neither the database nor the deployment key beside it is created."""
    token = tmp_path / "admin.token"
    token.write_text("t" * 40)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "observability": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": None, "token_file": str(token)},
            "upstream": {"url": "http://127.0.0.1:9/mcp"},
            "store": {"path": str(tmp_path / "data" / "tasks.db")},
        }
        section, key = field.split(".")
        config[section][key] = port
        code, stderr = failed_start(tmp_path, config)
    assert code == EXIT_CANNOT_LISTEN == 3
    failure = the_failure(stderr)
    assert failure["reason"] == "port_in_use"
    assert f"port {port}" in failure["error"]
    assert f"(set {field})" in failure["error"]
    assert not (tmp_path / "data").exists()  # no database, no key, not even their directory


async def test_a_second_proxy_on_the_same_sqlite_file_is_one_error_line_and_exit_code_4(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess]
) -> None:
    first = ProxyProcess(tmp_path, upstream.url)
    processes.append(first)
    await first.start()
    code, stderr = await asyncio.to_thread(
        failed_start,
        tmp_path,
        {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "upstream": {"url": upstream.url},
            "store": {"path": str(tmp_path / "ops.db")},  # the first one's
        },
    )
    assert code == EXIT_STORE_LOCKED == 4
    failure = the_failure(stderr)
    assert failure["reason"] == "store_locked"
    assert "in use by another mcp-tasks-proxy process" in failure["error"]


async def test_postgresql_stopped_at_start_is_one_error_line_and_exit_code_5(
    tmp_path: Path, own_pg_server: pg.PgServer
) -> None:
    url = pg.as_url(own_pg_server.dsn(await asyncio.to_thread(own_pg_server.create_database)))
    await asyncio.to_thread(own_pg_server.halt)
    code, stderr = await asyncio.to_thread(
        failed_start,
        tmp_path,
        {
            "listen": {"host": "127.0.0.1", "port": free_port()},
            "upstream": {"url": "http://127.0.0.1:9/mcp"},
            "store": {"url": url, "timeout_seconds": 2},
            "security": {"key_file": key_file(tmp_path)},
        },
    )
    assert code == EXIT_STORE_UNAVAILABLE == 5
    failure = the_failure(stderr)
    assert failure["reason"] == "store_unavailable"


def files_in(directory: Path) -> set[str]:
    return {str(path.relative_to(directory)) for path in directory.rglob("*")}


def started_in(tmp_path: Path, **sections: Any) -> tuple[int, dict[str, Any], set[str]]:
    """A start with `sections` over a config whose database and audit log would be in `tmp_path/data`: the exit
    code, the one start_failed line, and the files the start left in `tmp_path` (the config file aside)."""
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": free_port()},
        "upstream": {"url": "http://127.0.0.1:9/mcp"},
        "store": {"path": str(tmp_path / "data" / "tasks.db")},
        "audit": {"path": str(tmp_path / "data" / "audit.jsonl")},
    }
    for name, values in sections.items():
        config[name] = {**config.get(name, {}), **values}
    before = files_in(tmp_path)
    code, stderr = failed_start(tmp_path, config)
    left = {name for name in files_in(tmp_path) - before if not name.startswith("failing-")}
    return code, the_failure(stderr), left


def test_a_stdio_program_that_is_not_found_is_exit_code_6_naming_it_and_creates_nothing(tmp_path: Path) -> None:
    code, failure, left = started_in(tmp_path, upstream={"url": "", "command": ["uvx-not-installed", "mcp-server-x"]})
    assert code == EXIT_UPSTREAM_COMMAND == 6
    assert failure["reason"] == "upstream_command_not_found"
    assert "uvx-not-installed is not found on PATH" in failure["error"]
    assert "mcp-server-x" not in failure["error"]  # arguments may be secrets: never shown
    assert left == set()


def test_a_stdio_server_that_exits_before_initialize_is_exit_code_6_and_creates_nothing(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "tests.upstream.faulty_stdio", "exit-at-start"]
    code, failure, left = started_in(tmp_path, upstream={"url": "", "command": command, "cwd": str(ROOT)})
    assert code == EXIT_UPSTREAM_COMMAND == 6
    assert failure["reason"] == "upstream_failed_to_start"
    assert f"the stdio server {Path(sys.executable).name} did not start" in failure["error"]
    assert "exited with code 3" in failure["error"]
    assert left == set()  # the server was started and stopped before the store was opened


@pytest.mark.parametrize(
    ("sections", "code", "reason", "key"),
    [
        ({"store": {"path": "{file}/tasks.db"}}, 5, "store_unavailable", "store.path"),
        ({"audit": {"path": "{file}/audit.jsonl"}}, 2, "audit_unwritable", "audit.path"),
        (
            {"upstream": {"url": "", "command": ["python3"], "cwd": "{tmp}/absent"}},
            2,
            "upstream_cwd_missing",
            "upstream.cwd",
        ),
    ],
    ids=["store", "audit", "cwd"],
)
def test_a_file_the_start_cannot_use_is_found_before_anything_is_created(
    tmp_path: Path, sections: dict[str, dict[str, Any]], code: int, reason: str, key: str
) -> None:
    """A file where a directory must be (root may write anywhere, so that is how a path is made unusable)."""
    (tmp_path / "a-file").write_text("")
    given = json.loads(json.dumps(sections).replace("{file}", str(tmp_path / "a-file")).replace("{tmp}", str(tmp_path)))
    exit_code, failure, left = started_in(tmp_path, **given)
    assert (exit_code, failure["reason"]) == (code, reason)
    assert key in failure["error"]
    assert left == set()


# --- the upstream: never waited for at start, but said --------------------------------------------------------


async def test_a_refused_upstream_starts_the_proxy_with_a_warning_and_an_unready_readyz(
    tmp_path: Path, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    nobody = f"http://127.0.0.1:{free_port()}/mcp"  # nothing listens there: connections are refused
    proxy = ProxyProcess(tmp_path, nobody)
    processes.append(proxy)
    await proxy.start()

    def warned() -> bool:
        return any(event["event"] == "upstream_session_warm_up_failed" for event in proxy.events())

    await until(warned, "the refused warm-up was logged")
    warning = next(event for event in proxy.events() if event["event"] == "upstream_session_warm_up_failed")
    assert warning["level"] == "warning"
    status, body = await get(http, proxy.ops_url("/readyz"))
    assert status == 503
    assert any(reason.startswith("upstream:") for reason in body["reasons"])


@pytest.fixture
async def answers_404() -> AsyncIterator[str]:
    """A real HTTP server that answers every request 404 (an upstream URL with a wrong path)."""

    async def not_found(request: web.Request) -> web.Response:
        return web.Response(status=404, text="404: Not Found")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", not_found)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/wrong/path"
    finally:
        await runner.cleanup()


async def test_readyz_is_503_at_once_after_a_404_to_initialize_with_the_status_and_path(
    tmp_path: Path, answers_404: str, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = ProxyProcess(tmp_path, answers_404)
    processes.append(proxy)
    await proxy.start()
    # The warm-up's initialize got its 404 (an answer, within readiness' 10 s window): still not ready.
    await until(
        lambda: any(event["event"] == "upstream_session_warm_up_failed" for event in proxy.events()),
        "the warm-up's initialize was answered",
    )
    status, body = await get(http, proxy.ops_url("/readyz"))
    assert status == 503
    [reason] = body["reasons"]
    assert "HTTP 404" in reason
    assert "/wrong/path" in reason
    assert "no MCP endpoint at /wrong/path; MCP servers usually serve it at /mcp: check upstream.url" in reason
    warning = next(event for event in proxy.events() if event["event"] == "upstream_session_warm_up_failed")
    assert "usually serve it at /mcp" in warning["error"]


# --- Host checking beyond loopback ----------------------------------------------------------------------------


async def test_a_bind_beyond_loopback_warns_about_host_checking_and_a_refused_host_is_named_in_the_403(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = ProxyProcess(tmp_path, upstream.url, listen={"host": "0.0.0.0"})
    processes.append(proxy)
    await proxy.start()
    [warning] = [event for event in proxy.events() if event["event"] == "listening_beyond_loopback"]
    assert warning["level"] == "warning"
    assert warning["host"] == "0.0.0.0"
    assert "security.allowed_hosts" in warning["hint"]
    started = next(event for event in proxy.events() if event["event"] == "started")
    assert started["endpoint"] == f"http://0.0.0.0:{proxy.port}/mcp"

    async with http.post(
        proxy.url,
        json=modern_body("server/discover", {}),
        headers={**modern_headers("server/discover"), "Host": f"proxy.example.internal:{proxy.port}"},
    ) as response:
        assert response.status == 403
        body = await response.json()
    assert body["jsonrpc"] == "2.0"
    assert body["error"]["code"] == -32600
    message = body["error"]["message"]
    assert f"'proxy.example.internal:{proxy.port}'" in message
    assert "security.allowed_hosts" in message


# --- Ctrl-C during a drain, and /drainz explored --------------------------------------------------------------


async def test_ctrl_c_during_a_drain_says_a_second_one_stops_now_and_a_second_one_does(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    tools = {"sleep": {"sync_window_ms": 0}}  # a declaring client's sleep is a task at once
    proxy = ProxyProcess(tmp_path, own_upstream.url, tasks={"tools": tools, "drain_seconds": 60})
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    async with http.post(
        proxy.url,
        json=modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 60}}, capabilities=DECLARING),
        headers=modern_headers("tools/call", "sleep"),
    ) as response:
        assert response.status == 200
        text = await response.text()
    messages = parse_sse(text) if response.content_type == "text/event-stream" else [json.loads(text)]
    assert messages[-1]["result"]["taskId"]
    os.kill(proxy.process.pid, signal.SIGINT)

    def drain_started() -> list[dict[str, Any]]:
        return [event for event in proxy.events() if event["event"] == "drain_started"]

    await until(drain_started, "the drain began")
    [first] = drain_started()
    assert first["signal"] == "SIGINT"
    assert first["calls_left"] >= 1
    assert "second SIGINT (Ctrl-C) or SIGTERM stops now" in first["hint"]
    assert proxy.process.poll() is None  # the task runs: the drain waits for it
    stopping = time.monotonic()
    os.kill(proxy.process.pid, signal.SIGINT)
    assert await asyncio.to_thread(proxy.process.wait, 30) == 0
    assert time.monotonic() - stopping < 15  # the listener's grace (3 s) and the close, not the 60 s drain
    assert any(event["event"] == "drain_cut_short" for event in proxy.events())


async def test_exploring_drainz_never_starts_a_drain_and_answers_within_seconds(
    tmp_path: Path, upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    proxy = ProxyProcess(tmp_path, upstream.url, tasks={"drain_seconds": 60})
    processes.append(proxy)
    await proxy.start()
    base = proxy.url.removesuffix("/mcp")
    asked = time.monotonic()
    status, body = await get(http, f"{base}/drainz", Accept="text/html")  # as a browser would
    assert time.monotonic() - asked < 15  # not the 65 s a drain of 60 s may take
    assert (status, body["status"]) == (503, "serving")
    for method in ("POST", "PUT", "DELETE"):
        async with http.request(method, f"{base}/drainz") as response:
            assert response.status == 405
    status, ready = await get(http, f"{base}/readyz")
    assert (status, ready["status"]) == (200, "ready")
    assert not [event for event in proxy.events() if event["event"] == "drain_started"]
    assert proxy.process is not None
    assert proxy.process.poll() is None


async def test_a_prestop_drainz_that_comes_just_before_sigterm_waits_for_the_drain_to_end(
    tmp_path: Path, own_upstream: Upstream, processes: list[ProxyProcess], http: aiohttp.ClientSession
) -> None:
    """The Kubernetes preStop hook (`httpGet /drainz`, no query) may reach the proxy before its SIGTERM does."""
    tools = {"sleep": {"sync_window_ms": 0}}
    proxy = ProxyProcess(tmp_path, own_upstream.url, tasks={"tools": tools, "drain_seconds": 30})
    processes.append(proxy)
    await proxy.start()
    assert proxy.process is not None
    async with http.post(
        proxy.url,
        json=modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 3}}, capabilities=DECLARING),
        headers=modern_headers("tools/call", "sleep"),
    ) as response:
        assert response.status == 200
    base = proxy.url.removesuffix("/mcp")
    pid = proxy.process.pid

    async def sigterm_a_second_later() -> float:
        await asyncio.sleep(1)
        os.kill(pid, signal.SIGTERM)
        return time.monotonic()

    (status, body), signalled = await asyncio.wait_for(
        asyncio.gather(get(http, f"{base}/drainz"), sigterm_a_second_later()), 30
    )
    assert (status, body["status"]) == (200, "drained")
    assert time.monotonic() - signalled > 1  # it waited for the 3 s task, not only for the signal
    assert await asyncio.to_thread(proxy.process.wait, 30) == 0
