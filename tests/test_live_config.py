"""The config holder: which fields a reload may change, what a refused reload leaves, who is told of a swap.
Real files in a temporary directory; the flow tests (test_flow_live_config.py) drive it with real signals."""

from __future__ import annotations

import gc
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel, Field

from proxy.config.live import (
    APPLIED,
    FIXED_KEY,
    INVALID,
    RESTART_FIELDS,
    UNCHANGED,
    LiveConfig,
    changed_fields,
    is_fixed,
    reload_marks,
)
from proxy.config.loader import load_config
from proxy.config.schema import Config
from proxy.edge._app_keys import FRONT, RUNNER
from proxy.edge.app import create_app
from proxy.policy import SYNC_CALL
from proxy.tasks.effects.call_queue import Admission
from tests.support.processes import Upstream
from tests.support.wire import modern_body, modern_headers

BASE: dict[str, object] = {"upstream": {"url": "http://127.0.0.1:9/mcp"}, "store": {"path": "tasks.db"}}


def _write(path: Path, data: dict[str, object]) -> None:
    path.write_text(yaml.safe_dump(data))


@pytest.fixture
def live(tmp_path: Path) -> LiveConfig:
    path = tmp_path / "proxy.yaml"
    _write(path, BASE)
    return LiveConfig(load_config(path, environ={}), str(path), environ={})


def test_every_field_a_reload_compares_is_marked_live_or_restart() -> None:
    marks = reload_marks()
    assert {"listen.port", "upstream.url", "upstream.command", "tasks.tools", "jobs", "admin.port"} <= set(marks)
    assert {path: mark for path, mark in marks.items() if mark not in ("live", "restart")} == {}
    assert {path for path, mark in marks.items() if mark == "restart"} == RESTART_FIELDS


def test_a_field_without_a_mark_counts_as_needing_a_restart() -> None:
    class Section(BaseModel):
        marked: int = Field(0, description="d", json_schema_extra={"reload": "live"})
        unmarked: int = Field(0, description="d")

    class Root(BaseModel):
        section: Section = Field(default_factory=Section, description="d")
        flags: dict[str, int] = Field(default_factory=dict, description="d", json_schema_extra={"reload": "restart"})

    assert reload_marks(Root) == {"section.marked": "live", "section.unmarked": None, "flags": "restart"}


def test_changes_are_named_per_field_and_tool_maps_whole() -> None:
    old = Config.model_validate(BASE).model_dump(mode="json")
    new = Config.model_validate(
        {**BASE, "tasks": {"tools": {"a": {"mode": "required"}}}, "listen": {"port": 9999}}
    ).model_dump(mode="json")
    assert changed_fields(old, new) == ["listen.port", "tasks.tools"]
    assert is_fixed("listen.port")
    assert is_fixed("upstream.headers")
    assert not is_fixed("tasks.tools")
    assert not is_fixed("security.allowed_hosts")
    assert not is_fixed("upstream.max_concurrent_calls")  # the queue's caps are read live, under `upstream`
    assert not is_fixed("upstream.max_queue_wait_ms")


def test_a_good_reload_swaps_the_config_and_tells_subscribers(live: LiveConfig) -> None:
    seen: list[Config] = []
    live.subscribe(seen.append)
    assert live.path is not None
    _write(Path(live.path), {**BASE, "tasks": {"tools": {"a": {"mode": "required"}}}})
    assert live.reload("test") == APPLIED
    assert live.current.tasks.tools["a"].mode == "required"
    assert seen == [live.current]
    assert live.reload("test") == UNCHANGED
    assert seen == [live.current]


@pytest.mark.parametrize(
    ("text", "result"),
    [
        ("tasks: [\n", INVALID),
        ("", INVALID),
        ("tasks: {max_running: 0}\n", INVALID),
        (yaml.safe_dump({**BASE, "store": {"path": "other.db"}, "tasks": {"max_running": 5}}), FIXED_KEY),
    ],
)
def test_a_refused_reload_changes_nothing(live: LiveConfig, text: str, result: str) -> None:
    before = live.current
    seen: list[Config] = []
    live.subscribe(seen.append)
    assert live.path is not None
    Path(live.path).write_text(text)
    assert live.reload("test") == result
    assert live.current is before
    assert seen == []


def test_a_missing_file_is_refused(live: LiveConfig) -> None:
    assert live.path is not None
    before = live.current
    Path(live.path).unlink()
    assert live.reload("test") == INVALID
    assert live.current is before


async def test_a_reload_reaches_every_part_that_decides_new_calls(tmp_path: Path, upstream: Upstream) -> None:
    """The policies, the running and parking limits, the MRTR timings and the listen limits a new call meets."""
    path = tmp_path / "proxy.yaml"
    base: dict[str, object] = {"upstream": {"url": upstream.url}, "store": {"path": str(tmp_path / "tasks.db")}}
    _write(path, base)
    live = LiveConfig(load_config(path, environ={}), str(path), environ={})
    app = create_app(live.current, live)
    async with TestClient(TestServer(app, host="127.0.0.1")):  # started: the runner and the front exist
        _write(
            path,
            {
                **base,
                "tasks": {"max_running": 7, "tools": {"sleep": {"mode": "required"}}},
                "inputs": {"max_parked": 9, "gather_ms": 123},
                "limits": {"max_running_per_principal": 5, "max_parked_per_principal": 4, "max_listen_streams": 3},
            },
        )
        assert live.reload("test") == APPLIED
        runner, front = app[RUNNER], app[FRONT]
        for part in (runner.starter, runner.slots, runner.parking, runner.jobs):
            assert part.config() is live.current, f"{type(part).__name__} reads a config other than the one in force"
        assert runner.starter.config().tasks.tools["sleep"].mode == "required"
        assert runner.records.tasks_config.max_running == 7
        slots, parking = runner.slots.config(), runner.parking.config()
        assert (slots.tasks.max_running, slots.limits.max_running_per_principal) == (7, 5)
        assert (parking.inputs.max_parked, parking.limits.max_parked_per_principal) == (9, 4)
        state = runner.starter.state(SYNC_CALL, {}, None, None)
        assert state.gather_ms == 123
        assert front.config.tasks.tools["sleep"].mode == "required"
        assert front.listens.limits.max_listen_streams == 3


# Each key read live under a section otherwise bound at start, the value a reload sets, and how the part that
# uses it reads it.
RELOADABLE = sorted(path for path, mark in reload_marks().items() if path.startswith("upstream.") and mark == "live")
RELOADABLE_READS: dict[str, tuple[int, Callable[[web.Application], object]]] = {
    "upstream.max_concurrent_calls": (3, lambda app: _admission(app).max_concurrent),
    "upstream.max_queue_wait_ms": (1234, lambda app: _admission(app).max_wait_ms),
}


def _admission(app: web.Application) -> Admission:
    admission = app[RUNNER].admission
    assert admission is not None, "no queue although a cap is in force"
    return admission


def test_every_key_read_live_under_the_upstream_section_has_a_check() -> None:
    assert set(RELOADABLE_READS) == set(RELOADABLE)


@pytest.mark.parametrize("key", RELOADABLE)
async def test_a_reload_of_a_key_read_live_reaches_the_part_that_reads_it(
    tmp_path: Path, upstream: Upstream, key: str
) -> None:
    """The changed value is what the queue reads after the reload, not the one it was built with."""
    value, read = RELOADABLE_READS[key]
    path = tmp_path / "proxy.yaml"
    base: dict[str, Any] = {
        "upstream": {"url": upstream.url, "max_concurrent_calls": 2, "max_queue_wait_ms": 500},
        "store": {"path": str(tmp_path / "tasks.db")},
    }
    _write(path, base)
    live = LiveConfig(load_config(path, environ={}), str(path), environ={})
    app = create_app(live.current, live)
    async with TestClient(TestServer(app, host="127.0.0.1")):
        before = read(app)
        section, field = key.split(".")
        _write(path, {**base, section: {**base[section], field: value}})
        assert live.reload("test") == APPLIED
        assert (before, read(app)) != (value, value)
        assert read(app) == value


async def test_after_a_reload_no_part_keeps_a_section_of_the_old_config(tmp_path: Path, upstream: Upstream) -> None:
    """What decides new calls reads the config in force through the holder: once a reload changed the live
    sections, nothing but the old config itself refers to its sections (a part that copied one at start would)."""
    path = tmp_path / "proxy.yaml"
    base: dict[str, object] = {
        "upstream": {"url": upstream.url, "max_concurrent_calls": 2},
        "store": {"path": str(tmp_path / "tasks.db")},
    }
    _write(path, base)
    live = LiveConfig(load_config(path, environ={}), str(path), environ={})
    app = create_app(live.current, live)
    async with TestClient(TestServer(app, host="127.0.0.1")):
        _write(
            path,
            {
                **base,
                "tasks": {"max_running": 7, "tools": {"sleep": {"mode": "required", "max_concurrent": 1}}},
                "inputs": {"max_parked": 9},
                "limits": {"max_listen_streams": 3},
                "idempotency": {"enabled": False},
                "jobs": {
                    "start": {
                        "job_id": "json.id",
                        "status": {"tool": "status", "state": "json.state", "states": {"done": "completed"}},
                    }
                },
            },
        )
        old = live.current
        sections = {name: getattr(old, name) for name in ("tasks", "inputs", "limits", "idempotency", "jobs")}
        assert live.reload("test") == APPLIED
        gc.collect()
        for name in list(sections):
            holders = [
                type(holder).__name__ if not isinstance(holder, dict) else sorted(map(str, holder))[:8]
                for holder in gc.get_referrers(sections[name])
                if holder is not old.__dict__ and holder is not sections and not inspect.isframe(holder)
            ]
            assert holders == [], f"{name} of the old config is still held by {holders}"


async def test_a_tools_call_decides_with_the_config_it_read_once(tmp_path: Path, upstream: Upstream) -> None:
    """The front reads the config in force once per tools/call (quota, policy, job, idempotency and the call's
    own settings all come from that read), so a reload in the middle of a request never splits it."""
    path = tmp_path / "proxy.yaml"
    base: dict[str, object] = {
        "upstream": {"url": upstream.url},
        "store": {"path": str(tmp_path / "tasks.db")},
        "limits": {"calls_per_minute_per_principal": 100},
        "tasks": {"tools": {"echo": {"mode": "optional", "calls_per_minute_per_principal": 50}}},
    }
    _write(path, base)
    live = LiveConfig(load_config(path, environ={}), str(path), environ={})
    app = create_app(live.current, live)
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        front = app[FRONT]
        reads: list[Config] = []

        def counted() -> Config:
            reads.append(live.current)
            return live.current

        front._current = counted  # the getter the front holds
        body = modern_body("tools/call", {"name": "echo", "arguments": {"text": "x"}})
        async with client.post("/mcp", json=body, headers=modern_headers("tools/call", "echo")) as response:
            assert response.status == 200
            assert (await response.json())["result"]["content"][0]["text"] == "x"
        assert len(reads) == 1
