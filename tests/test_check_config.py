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
from proxy.edge.app import create_app
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
    assert "lists no tool 'slow_compte' (did you mean 'slow_compute'?)" in by_key["tasks.tools.slow_compte"]["detail"]
    assert "matches 'nightly_*'" in by_key["tasks.tools.nightly_*"]["detail"]
    assert by_key["tasks.tools.nightly_*"]["log_level"] == "warning"


def test_every_relative_path_in_a_file_is_taken_from_the_files_directory_and_the_environments_from_the_working_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Key and token files, the store, the audit log, the JWT key set and a stdio server's working directory:
    the file means the same files wherever the proxy is started. A command's program is not a path of the file:
    it is found on PATH (or from upstream.cwd), as a shell finds it."""
    config_dir = tmp_path / "etc"
    (config_dir / "secrets").mkdir(parents=True)
    (config_dir / "server").mkdir()
    for name in ("key", "state", "admin"):
        write(config_dir / "secrets" / name, KEY)
    write(config_dir / "secrets" / "jwks.json", '{"keys": []}')
    elsewhere = tmp_path / "run"
    elsewhere.mkdir()
    file = write(
        config_dir / "proxy.yaml",
        """
upstream: {command: [uvx, mcp-server-fetch], cwd: server}
security:
  key_file: secrets/key
  jwt: {jwks_file: secrets/jwks.json, issuer: https://issuer.example}
inputs: {secret_file: secrets/state}
admin: {port: 9911, token_file: secrets/admin}
store: {path: data/tasks.db}
audit: {path: logs/audit.jsonl}
""",
    )
    monkeypatch.chdir(elsewhere)
    config = load_config(file, environ={})
    secrets = config_dir / "secrets"
    assert config.security.key_file == str(secrets / "key")
    assert config.security.jwt is not None
    assert config.security.jwt.jwks_file == str(secrets / "jwks.json")
    assert config.inputs.secret_file == str(secrets / "state")
    assert config.admin.token_file == str(secrets / "admin")
    assert config.store.path == str(config_dir / "data" / "tasks.db")
    assert config.audit.path == str(config_dir / "logs" / "audit.jsonl")
    assert getattr(config.upstream, "cwd", None) == str(config_dir / "server")
    assert getattr(config.upstream, "command", None) == ["uvx", "mcp-server-fetch"]  # found on PATH at start
    write(elsewhere / "env-key", KEY)
    from_env = load_config(file, environ={"MCP_TASKS_PROXY_SECURITY__KEY_FILE": "env-key"})
    assert from_env.security.key_file == "env-key"  # the working directory's (read from there)
    stdout = write(config_dir / "stdout.yaml", "upstream: {url: http://127.0.0.1:9/mcp}\naudit: {path: '-'}\n")
    assert load_config(stdout, environ={}).audit.path == "-"  # stdout, not a file


@pytest.mark.parametrize(
    ("text", "line", "expected"),
    [
        ("listen:\n  hots: 0.0.0.0\n", 2, "listen.hots: unknown key (did you mean 'host'?)"),
        ("upstream:\n  ur: http://127.0.0.1:9/mcp\n", 2, "upstream: unknown key 'ur' (did you mean 'url'?)"),
        ("tasks:\n  tools:\n    build: {mode: requried}\n", 3, "(did you mean 'required'?)"),
        ("tasks:\n  default:\n    on_restart: rerum\n", 3, "(did you mean 'rerun'?)"),
        ("loging: {level: debug}\n", 1, "loging: unknown key (did you mean 'logging'?)"),
        ("security:\n  anonymous: refuses\n", 2, "(did you mean 'refuse'?)"),
    ],
    ids=["key", "upstream-key", "mode", "on_restart", "section", "anonymous"],
)
def test_an_unknown_key_or_value_is_named_with_its_file_line_and_near_match(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: int, expected: str
) -> None:
    body = text if text.startswith("upstream") else "upstream: {url: http://127.0.0.1:9/mcp}\n" + text
    shift = 0 if text.startswith("upstream") else 1
    file = write(tmp_path / "proxy.yaml", body)
    assert main(["check-config", str(file)]) == 2
    err = capsys.readouterr().err
    assert f"{file}:{line + shift}: " in err, err
    assert expected in err, err


def test_a_value_from_the_environment_is_named_by_its_variable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MCP_TASKS_PROXY_LOGGING__LEVLE", "debug")
    assert main(["check-config", "--upstream", "http://127.0.0.1:9/mcp"]) == 2
    assert (
        "MCP_TASKS_PROXY_LOGGING__LEVLE: logging.levle: unknown key (did you mean 'level'?)" in capsys.readouterr().err
    )


def test_check_config_prints_the_warnings_serve_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = write(
        tmp_path / "proxy.yaml",
        "listen: {host: 0.0.0.0}\nupstream: {url: http://127.0.0.1:9/mcp}\nsecurity: {upstream_auth: required}\n",
    )
    assert main(["check-config", str(file)]) == 0
    captured = capsys.readouterr()
    warnings = [line for line in captured.err.splitlines() if line.startswith("mcp-tasks-proxy: warning: ")]
    events = [line.split(": ")[2] for line in warnings]
    assert events == ["listening_beyond_loopback", "anonymous_callers_allowed", "tasks_bound_to_raw_tokens"]
    assert "a client that refreshes its token loses its tasks; set security.jwt" in captured.err
    assert "ok (3 warnings above)" in captured.out
    with structlog.testing.capture_logs() as logged:
        create_app(load_config(file, environ={}))
    assert [event["event"] for event in logged] == events  # serve logs the same ones
    quiet = write(tmp_path / "quiet.yaml", "upstream: {url: http://127.0.0.1:9/mcp}\n")
    assert main(["check-config", str(quiet)]) == 0
    assert "warning" not in capsys.readouterr().err


@pytest.mark.usefixtures("quiet_logs")  # --probe configures the process's logging: restored afterwards
def test_check_config_probe_holds_tool_names_against_the_upstreams_list(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], upstream: Upstream
) -> None:
    file = write(
        tmp_path / "proxy.yaml",
        f"""
upstream: {{url: {upstream.url}}}
tasks:
  tools:
    slow_compte: {{mode: required}}
    slow_compute: {{mode: required}}
jobs:
  start_render:
    job_id: json.id
    status: {{tool: render_stauts, state: json.state, states: {{done: completed}}}}
""",
    )
    assert main(["check-config", str(file)]) == 0  # without --probe the upstream is not asked
    assert "slow_compte" not in capsys.readouterr().err
    assert main(["check-config", "--probe", str(file)]) == 0
    err = capsys.readouterr().err
    assert "tasks.tools.slow_compte: the upstream lists no tool 'slow_compte' (did you mean 'slow_compute'?)" in err
    assert "tasks.tools.slow_compute" not in err
    assert "jobs.start_render: the upstream lists no status tool 'render_stauts'" in err
    nobody = write(tmp_path / "nobody.yaml", "upstream: {url: http://127.0.0.1:9/mcp, connect_timeout_seconds: 1}\n")
    assert main(["check-config", "--probe", str(nobody)]) == 1
    assert "cannot probe the upstream: upstream:" in capsys.readouterr().err
