"""What a reload may change is what the proxy reads where it uses it. A field the proxy reads while it starts
(its value built into a listener, a file, a client, a size) or reads later from the config it started with (a
section it kept) cannot change by a reload: such a field must be marked `restart` in the schema, so that a reload
changing it answers that it needs a restart instead of "applied". Real proxies on loopback, real requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer

from proxy.config.live import APPLIED, FIXED_KEY, LiveConfig, reload_marks
from proxy.config.loader import load_config
from proxy.config.schema import Config
from proxy.edge._app_keys import ADMIN
from proxy.edge.app import create_app
from tests.support.config_reads import reads_of
from tests.support.processes import Upstream, free_port, stdio_upstream
from tests.support.waiting import until
from tests.support.wire import TASKING, modern_body, modern_headers

MARKS = reload_marks()
LIVE = frozenset(path for path, mark in MARKS.items() if mark == "live")

# Fields marked live that the proxy also reads while it starts, and where each is read again for every use, so
# that a reload reaches it. Any other field read at start must be marked restart.
READ_AT_START_AND_PER_USE: dict[str, str] = {
    "security.anonymous": "the start's warning for an address beyond loopback; each request's check reads the "
    "config in force (edge/app.py)",
    "tasks.tools": "the check at start that the tools it names exist; each call's policy is read from the config "
    "in force",
    "jobs": "the check at start that a family's tools exist; each call of a start tool reads the config in force",
    "upstream.max_concurrent_calls": "whether a queue is made at start; its caps are read at each admission",
}

TOKEN = "t0ken-for-the-admin-listener-0123456789"


def _sections(tmp_path: Path, upstream: dict[str, Any]) -> dict[str, Any]:
    """A config with every optional part on that needs no other server: the admin listener, the audit log, a
    tool policy with its own cap, a job family, a quota."""
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN)
    return {
        "upstream": {**upstream, "max_concurrent_calls": 4},
        "store": {"path": str(tmp_path / "tasks.db")},
        "admin": {"port": free_port(), "token_file": str(token_file), "show_results": True},
        "audit": {"path": str(tmp_path / "audit.log")},
        "tasks": {"tools": {"sleep": {"mode": "required", "max_concurrent": 2}}},
        "limits": {"calls_per_minute_per_principal": 1000},
        "jobs": {
            "start": {
                "job_id": "json.id",
                "status": {"tool": "status", "state": "json.state", "states": {"done": "completed"}},
            }
        },
        "logging": {"level": "warning"},
    }


def _started_config(tmp_path: Path, sections: dict[str, Any]) -> tuple[Config, LiveConfig, Path]:
    path = tmp_path / "proxy.yaml"
    path.write_text(yaml.safe_dump(sections))
    config = load_config(path, environ={})
    return config, LiveConfig(config, str(path), environ={}), path


@pytest.fixture(params=["http", "stdio"])
def upstream_section(request: pytest.FixtureRequest, upstream: Upstream) -> dict[str, Any]:
    return {"url": upstream.url} if request.param == "http" else stdio_upstream()


async def test_every_field_read_while_the_proxy_starts_is_marked_restart(
    tmp_path: Path, upstream_section: dict[str, Any]
) -> None:
    config, live, _ = _started_config(tmp_path, _sections(tmp_path, upstream_section))
    with reads_of(config, MARKS) as at_start:
        client = TestClient(TestServer(create_app(config, live), host="127.0.0.1"))
        await client.start_server()
    try:
        assert {"admin.port", "audit.path", "store.path", "listen.path"} <= at_start  # the recording sees reads
        assert sorted((at_start & LIVE) - set(READ_AT_START_AND_PER_USE)) == []
    finally:
        await client.close()


def test_each_field_said_to_be_read_per_use_is_marked_live() -> None:
    assert set(READ_AT_START_AND_PER_USE) <= LIVE


async def test_no_field_is_read_later_from_the_config_the_proxy_started_with_unless_it_needs_a_restart(
    tmp_path: Path, upstream: Upstream
) -> None:
    """After a reload swapped in a new config, a read of the old one comes from something that kept a section
    of it at start: such a field cannot change by a reload. Serves a task (created, polled, settled), a
    synchronous call, a listing and the admin API (results shown) while the old config is watched."""
    sections = _sections(tmp_path, {"url": upstream.url})
    config, live, path = _started_config(tmp_path, sections)
    async with TestClient(TestServer(create_app(config, live), host="127.0.0.1")) as client:
        path.write_text(yaml.safe_dump({**sections, "tasks": {**sections["tasks"], "max_running": 77}}))
        assert live.reload("test") == APPLIED
        assert live.current is not config
        with reads_of(config, MARKS) as later:
            await _serve_a_little(client, client.app[ADMIN].port)
        assert sorted(later & LIVE) == []


async def _serve_a_little(client: TestClient[Any, Any], admin_port: int | None) -> None:
    headers = modern_headers("tools/call", "sleep")
    body = modern_body("tools/call", {"name": "sleep", "arguments": {"seconds": 0.05}}, capabilities=TASKING)
    async with client.post("/mcp", json=body, headers=headers) as response:
        created = await response.json()
    task_id = created["result"]["taskId"]

    async def settled() -> bool:
        get = modern_body("tasks/get", {"taskId": task_id}, capabilities=TASKING)
        async with client.post("/mcp", json=get, headers=modern_headers("tasks/get")) as response:
            status: str = (await response.json())["result"]["status"]
        return status == "completed"

    await until(settled, "the task completed")
    echo = modern_body("tools/call", {"name": "echo", "arguments": {"text": "x"}})
    async with client.post("/mcp", json=echo, headers=modern_headers("tools/call", "echo")) as response:
        assert response.status == 200
    listing = modern_body("tools/list", {})
    async with client.post("/mcp", json=listing, headers=modern_headers("tools/list")) as response:
        assert response.status == 200
    assert admin_port is not None
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession() as http:
        for url in (f"/admin/tasks/{task_id}", "/admin/tasks", "/admin/"):
            async with http.get(f"http://127.0.0.1:{admin_port}{url}", headers=bearer) as response:
                assert response.status == 200, url


@pytest.mark.parametrize(
    ("section", "change"),
    [
        ("admin", {"show_results": False}),
        ("audit", {"path": None}),
        ("listen", {"port": 1}),
        ("security", {"max_body_bytes": 4096}),
    ],
)
def test_a_reload_changing_a_field_bound_at_start_says_it_needs_a_restart(
    tmp_path: Path, section: str, change: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    sections = _sections(tmp_path, {"url": "http://127.0.0.1:9/mcp"})
    _, live, path = _started_config(tmp_path, sections)
    before = live.current
    path.write_text(yaml.safe_dump({**sections, section: {**sections.get(section, {}), **change}}))
    assert live.reload("test") == FIXED_KEY
    assert live.current is before
