"""The config holder: which fields a reload may change, what a refused reload leaves, who is told of a swap.
Real files in a temporary directory; the flow tests (test_flow_live_config.py) drive it with real signals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from aiohttp.test_utils import TestClient, TestServer
from pydantic import BaseModel

from proxy.app import create_app
from proxy.app_keys import FRONT, RUNNER
from proxy.config import Config, load_config
from proxy.live_config import APPLIED, FIXED, FIXED_KEY, INVALID, UNCHANGED, LiveConfig, changed_fields, is_fixed
from tests.support.processes import Upstream

BASE: dict[str, object] = {"upstream": {"url": "http://127.0.0.1:9/mcp"}, "store": {"path": "tasks.db"}}


def _write(path: Path, data: dict[str, object]) -> None:
    path.write_text(yaml.safe_dump(data))


@pytest.fixture
def live(tmp_path: Path) -> LiveConfig:
    path = tmp_path / "proxy.yaml"
    _write(path, BASE)
    return LiveConfig(load_config(path, environ={}), str(path), environ={})


def test_every_fixed_path_names_a_section_or_a_field() -> None:
    for path in FIXED:
        model: type[BaseModel] = Config
        for part in path.split("."):
            assert part in model.model_fields, f"{path}: no field {part}"
            annotation = model.model_fields[part].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                model = annotation


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
        assert runner.calls.config.tools["sleep"].mode == "required"
        assert runner.records.config.max_running == 7
        assert (runner.slots.max_running, runner.slots.per_caller) == (7, 5)
        assert (runner.parking.config.max_parked, runner.parking.per_caller) == (9, 4)
        assert runner.calls.inputs.gather_ms == 123
        assert front.config.tasks.tools["sleep"].mode == "required"
        assert front.listens.limits.max_listen_streams == 3
