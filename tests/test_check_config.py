"""`check-config`: what it prints (`--print`: the configuration `serve` would run, credentials redacted), key
files that exist only in the pod (notes, unless `--strict`), where a relative `store.path` points, and the
warning at start for a tool policy naming a tool the upstream does not have."""

from __future__ import annotations

import os
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import yaml

from proxy.cli import effective_config, flag_overrides, main, parse_args
from proxy.config.loader import REDACTED, load_config, redacted
from tests.support.processes import Upstream
from tests.support.waiting import until

KEY = "k" * 40
API_KEY = "sk-live-do-not-print-me"


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    key = write(tmp_path / "deployment.key", KEY)
    return write(
        tmp_path / "proxy.yaml",
        f"""
upstream:
  url: http://127.0.0.1:9000/mcp
  headers: {{X-Api-Key: {API_KEY}}}
security:
  key_file: {key}
store:
  path: data/tasks.db
jobs:
  start_render:
    job_id: json.id
    status:
      tool: render_status
      arguments: {{job_id: "{{job_id}}", api_key: {API_KEY}}}
      state: json.state
      states: {{done: completed}}
""",
    )


def test_print_is_what_serve_runs_with_the_same_file_environment_and_flags_and_hides_credentials(
    config_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MCP_TASKS_PROXY_LISTEN__HOST", "0.0.0.0")
    flags = ["--port", "8181", "--upstream", "http://127.0.0.1:9001/mcp"]
    assert main(["check-config", "--print", str(config_file), *flags]) == 0
    out = capsys.readouterr().out
    assert API_KEY not in out
    assert KEY not in out  # a key file's path is printed, never its contents
    printed = yaml.safe_load(out)
    serve_args = parse_args(["serve", "--config", str(config_file), *flags])
    assert printed == redacted(effective_config(serve_args.config, flag_overrides(serve_args)))
    assert printed["listen"] == {**printed["listen"], "host": "0.0.0.0", "port": 8181}
    assert printed["upstream"]["url"] == "http://127.0.0.1:9001/mcp"
    assert printed["upstream"]["headers"] == {"X-Api-Key": REDACTED}
    assert printed["jobs"]["start_render"]["status"]["arguments"] == {"job_id": "{job_id}", "api_key": REDACTED}
    assert printed["security"]["key_file"] == str(config_file.parent / "deployment.key")
    # What it prints is a configuration again: loading it gives the same one (the redacted values aside).
    reloaded = write(config_file.parent / "printed.yaml", out)
    assert redacted(load_config(reloaded, environ={})) == printed


def test_a_stdio_servers_environment_values_are_redacted_and_its_names_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = write(tmp_path / "stdio.yaml", "upstream: {command: [uvx, mcp-server-fetch], env: {GITHUB_TOKEN: ghp_x1}}\n")
    assert main(["check-config", "--print", str(file)]) == 0
    out = capsys.readouterr().out
    assert "ghp_x1" not in out
    assert yaml.safe_load(out)["upstream"]["env"] == {"GITHUB_TOKEN": REDACTED}


def test_a_key_file_missing_here_is_a_note_unless_strict_and_an_unusable_one_stays_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "not-mounted" / "key"
    file = write(
        tmp_path / "proxy.yaml", f"upstream: {{url: http://127.0.0.1:9000/mcp}}\nsecurity: {{key_file: {missing}}}\n"
    )
    assert main(["check-config", str(file)]) == 0
    captured = capsys.readouterr()
    assert f"note: security.key_file: read at start: file {missing} not found here" in captured.err
    assert "1 note above" in captured.out
    assert main(["check-config", "--strict", str(file)]) == 2
    assert "security.key_file: cannot read" in capsys.readouterr().err
    missing.parent.mkdir()
    write(missing, "short")
    assert main(["check-config", str(file)]) == 2  # it exists here and is too short: a real problem
    assert "security.key_file:" in capsys.readouterr().err


def test_serve_still_refuses_a_missing_key_file(tmp_path: Path) -> None:
    file = write(
        tmp_path / "proxy.yaml",
        f"upstream: {{url: http://127.0.0.1:9000/mcp}}\nsecurity: {{key_file: {tmp_path / 'none'}}}\n",
    )
    assert main(["serve", "--config", str(file)]) == 2


def test_a_relative_store_path_in_a_file_is_taken_from_the_files_directory_and_db_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    file = write(config_dir / "proxy.yaml", "upstream: {url: http://127.0.0.1:9000/mcp}\nstore: {path: db/tasks.db}\n")
    monkeypatch.chdir(elsewhere)
    assert load_config(file, environ={}).store.path == str(config_dir / "db" / "tasks.db")
    relative_file = Path(os.path.relpath(file, elsewhere))  # the file named relative to the working directory
    assert load_config(relative_file, environ={}).store.path == str(config_dir / "db" / "tasks.db")
    args = parse_args(["serve", "--config", str(file), "--db", "mine.db"])
    assert load_config(args.config, environ={}, overrides=flag_overrides(args)).store.path == str(elsewhere / "mine.db")
    from_env = {"MCP_TASKS_PROXY_STORE__PATH": "env.db"}
    assert load_config(file, environ=from_env).store.path == str(elsewhere / "env.db")
    absolute = write(
        config_dir / "abs.yaml", f"upstream: {{url: http://127.0.0.1:9000/mcp}}\nstore: {{path: {tmp_path}/a.db}}\n"
    )
    assert load_config(absolute, environ={}).store.path == f"{tmp_path}/a.db"
    assert load_config(None, environ={}, overrides={"upstream": {"url": "http://127.0.0.1:9/mcp"}}).store.path == str(
        elsewhere / "mcp-tasks-proxy.db"
    )


async def test_a_policy_for_a_tool_the_upstream_lacks_is_warned_about_at_start(
    make_proxy: Callable[..., Any], upstream: Upstream
) -> None:
    tools = {
        "slow_compute": {"mode": "required"},  # listed by the fixture server
        "slow_compte": {"mode": "required", "ttl_ms": 60000},  # a typo
        "test_*": {"mode": "forbidden"},  # matches the fixture's test tools
        "nightly_*": {"max_concurrent": 2},  # matches nothing
    }
    with structlog.testing.capture_logs() as events:
        await make_proxy(upstream.url, tasks={"tools": tools})

        def warned() -> list[MutableMapping[str, Any]]:
            return [event for event in events if event["event"] == "tool_policy_missing"]

        await until(lambda: len(warned()) == 2, lambda: f"warnings: {warned()}")
    by_key = {event["key"]: event for event in warned()}
    assert set(by_key) == {"tasks.tools.slow_compte", "tasks.tools.nightly_*"}
    assert by_key["tasks.tools.slow_compte"]["tool"] == "slow_compte"
    assert by_key["tasks.tools.slow_compte"]["fields"] == ["mode", "ttl_ms"]
    assert "lists no tool 'slow_compte'" in by_key["tasks.tools.slow_compte"]["detail"]
    assert "matches 'nightly_*'" in by_key["tasks.tools.nightly_*"]["detail"]
    assert by_key["tasks.tools.nightly_*"]["log_level"] == "warning"
