"""config.py + cli.py: YAML + environment + flags, every error at once with its path, exit code 2, docs."""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import pytest
from pydantic import BaseModel

from docsgen.reference import config_reference
from proxy.cli import main
from proxy.config.keyfiles import read_password
from proxy.config.loader import ConfigError, load_config
from proxy.config.schema import Config, HttpUpstreamConfig, StdioUpstreamConfig
from proxy.upstream.stdio.process import INHERITED_ENV_VARS

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config" / "proxy.example.yaml"
SIDECAR_URL = "http://127.0.0.1:9000/mcp"


def test_the_example_shows_every_field_and_loads() -> None:
    config = load_config(EXAMPLE, environ={})
    # The defaults, plus a url; the relative store.path of a file is taken from the file's directory.
    store = {"path": str(EXAMPLE.parent / "mcp-tasks-proxy.db")}
    assert config == Config.model_validate({"upstream": {"url": SIDECAR_URL}, "store": store})
    text = EXAMPLE.read_text()
    for section, _ in _sections():
        assert f"\n{section}:" in text, section
    optional = _optional_sections(Config)
    for path, _ in _fields(Config):
        field = path.rsplit(".", 1)[-1]
        # A section that is off by default (`null`) shows its fields commented out: the example loads as defaults.
        shown = r"^\s*#\s+" if any(path.startswith(f"{section}.") for section in optional) else r"^\s+"
        assert re.search(rf"{shown}{field}:", text, re.MULTILINE), f"{path} missing from the example"


# Sections keyed by a name the user picks (`jobs`, by start tool): their entries' fields, under this placeholder.
KEYED = {"jobs": "<start_tool>"}


def _optional_sections(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted paths of the sections whose default is `null` (e.g. `security.jwt`), or no entry (`jobs`)."""
    found = []
    for name, field in model.model_fields.items():
        models = _models(field.annotation)
        if not prefix and name in KEYED:
            found.append(name)
            models = _models(get_args(field.annotation)[1])
        elif models and field.default is None:
            found.append(f"{prefix}{name}")
        for section in models:
            found.extend(_optional_sections(section, f"{prefix}{name}."))
    return found


def _models(annotation: object) -> list[type[BaseModel]]:
    """The section models behind a field's type: the model itself, or each kind of a union (`upstream`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) is Annotated:
        return _models(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return [model for member in get_args(annotation) for model in _models(member)]
    return []


def _sections() -> list[tuple[str, list[type[BaseModel]]]]:
    sections = []
    for name, field in Config.model_fields.items():
        models = _models(get_args(field.annotation)[1] if name in KEYED else field.annotation)
        assert models, name
        sections.append((name, models))
    return sections


def _fields(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str | None]]:
    """Every leaf field as (dotted path, description); nested sections (e.g. `tasks.default`) and each kind of a
    union section (`upstream`) are walked, a field the kinds share counted once."""
    found: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        models = _models(field.annotation)
        if not prefix and name in KEYED:  # each entry is one model: walked once, under the placeholder
            models, path = _models(get_args(field.annotation)[1]), f"{name}.{KEYED[name]}"
        if models:
            assert field.description, f"{path} has no description"
            for section in models:
                found.update(_fields(section, f"{path}."))
        else:
            found[path] = field.description
    return list(found.items())


def test_every_field_has_a_description_and_is_in_the_generated_reference() -> None:
    """The docs' configuration reference is written from these models (docsgen/reference.py); walked here on
    its own, every key must be in it with its description."""
    reference = config_reference()
    paths = _fields(Config)
    assert "tasks.default.sync_window_ms" in dict(paths)  # nested sections are walked
    for path, description in paths:
        assert description, f"{path} has no description"
        assert f"| `{path}` |" in reference, f"{path} is not in the configuration reference"
        assert " ".join(description.split()).replace("|", "\\|") in reference, f"{path}: description not shown"


def test_tool_policies_resolve_and_report_errors(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "tasks:\n  tools:\n    slow: {mode: sometimes, sync_window_ms: -1}\n    fine: {ttl_ms: null}\n"
        "  undeclared_required: maybe\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    problems = "\n".join(caught.value.problems)
    for expected in ("tasks.tools.slow.mode", "tasks.tools.slow.sync_window_ms", "tasks.undeclared_required"):
        assert expected in problems
    assert "fine" not in problems


def test_jobs_are_checked_with_each_error_at_its_field_path(tmp_path: Path) -> None:
    path = tmp_path / "jobs.yaml"
    path.write_text(
        "upstream: {url: http://a:1/mcp}\n"
        "jobs:\n"
        "  start_render:\n"
        "    job_id: 'structuredContent.[['\n"
        "    status: {tool: render_status, arguments: {id: '{jobid}'}, state: json.state, states: {done: finished}}\n"
        "    cancel: {tool: cancel_render, arguments: {ids: ['{job_id}', {deep: '{other}'}]}}\n"
        "    poll_interval_ms: 10\n"
        "  fine:\n"
        "    job_id: json.id\n"
        "    status: {tool: fine_status, state: json.state, states: {done: completed}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    lines = {problem.split(": ", 1)[0] for problem in caught.value.problems}  # each says its line of the file
    assert lines == {f"{path}:{line}" for line in (4, 5, 6, 7)}, caught.value.problems
    problems = [problem.split(": ", 1)[1] for problem in caught.value.problems]
    assert any(p.startswith("jobs.start_render.job_id: not a JMESPath expression") for p in problems), problems
    assert "jobs.start_render.status.arguments: a template may name only job_id, not 'jobid'" in problems
    assert "jobs.start_render.cancel.arguments: a template may name only job_id, not 'other'" in problems
    assert any(p.startswith("jobs.start_render.status.states.done:") for p in problems), problems
    assert any(p.startswith("jobs.start_render.poll_interval_ms:") for p in problems), problems
    assert not [p for p in problems if p.startswith("jobs.fine")]
    assert len(problems) == 5


def test_a_job_family_defaults_to_passing_the_id_as_job_id() -> None:
    config = load_config(
        None,
        environ={},
        overrides={
            "upstream": {"url": SIDECAR_URL},
            "jobs": {
                "go": {"job_id": "json.id", "status": {"tool": "st", "state": "json.s", "states": {"ok": "completed"}}}
            },
        },
    )
    job = config.jobs["go"]
    assert (job.status.arguments, job.poll_interval_ms, job.hide_helpers, job.shared) == (
        {"job_id": "{job_id}"},
        2000,
        False,
        False,
    )
    assert (job.result, job.cancel, job.helpers()) == (None, None, frozenset({"st"}))


def test_env_overrides_and_flags(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("listen: {port: 9999}\nupstream: {url: http://a:1/mcp}\n")
    environ = {
        "MCP_TASKS_PROXY_UPSTREAM__URL": "http://b:2/mcp",
        "MCP_TASKS_PROXY_SECURITY__ALLOWED_HOSTS": "[a, b]",
        "MCP_TASKS_PROXY_LISTEN__HOST": "0.0.0.0",
        "OTHER": "ignored",
    }
    config = load_config(path, environ=environ, overrides={"listen": {"host": "::1"}})
    assert config.listen.port == 9999
    assert isinstance(config.upstream, HttpUpstreamConfig)
    assert config.upstream.url == "http://b:2/mcp"
    assert config.security.allowed_hosts == ["a", "b"]
    assert config.listen.host == "::1"  # flags beat the environment


def test_all_errors_are_reported_at_once_with_their_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("listen: {port: 70000, extra: 1}\nupstream: {url: ftp://x}\nlogging: {level: loud}\nnope: {}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    problems = "\n".join(caught.value.problems)
    for expected in ("listen.port", "listen.extra", "upstream.url", "logging.level", "nope"):
        assert expected in problems
    assert len(caught.value.problems) == 5


@pytest.mark.parametrize(
    ("text", "message"),
    [("listen: [1, 2", "not valid YAML"), ("- a\n- b\n", "expected a mapping")],
)
def test_unreadable_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path, environ={})


@pytest.mark.parametrize("value", ["key\r\nX-Injected: yes", "key\x00", "key\x01", "key\x7f", " key", "key\t"])
def test_an_upstream_header_value_that_cannot_be_written_stops_the_start(value: str) -> None:
    """RFC 9110 §5.5: no control character but tab inside a value, no whitespace around it; refused with the
    field's path when the configuration loads, never sent on a request."""
    overrides = {"upstream": {"url": "http://127.0.0.1:1/mcp", "headers": {"X-Api-Key": value}}}
    with pytest.raises(ConfigError) as caught:
        load_config(None, environ={}, overrides=overrides)
    assert "upstream.headers" in "\n".join(caught.value.problems)
    assert load_config(
        None, environ={}, overrides={"upstream": {"url": "http://127.0.0.1:1/mcp", "headers": {"X-Api-Key": "a\tb"}}}
    )


def test_bad_env_names_are_errors() -> None:
    with pytest.raises(ConfigError, match="SECTION"):
        load_config(None, environ={"MCP_TASKS_PROXY_PORT": "1"})


def test_config_is_frozen() -> None:
    config = Config.model_validate({"upstream": {"url": SIDECAR_URL}})
    with pytest.raises(ValueError, match="frozen"):
        config.listen.port = 1  # type: ignore[misc]


def test_check_config_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(EXAMPLE)]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: {port: -1}\nstore: {path: 3, x: 1}\n")
    assert main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "listen.port" in err
    assert "store.x" in err
    assert main(["check-config", str(tmp_path / "missing.yaml")]) == 2


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--version"], ["--help"], ["serve", "--help"], ["check-config", "--help"]):
        with pytest.raises(SystemExit) as caught:
            main(argv)
        assert caught.value.code == 0
    assert "mcp-tasks-proxy" in capsys.readouterr().out


def test_the_request_state_secret_file_is_checked_on_load(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A missing or short key file (e.g. an unmounted Secret) fails `check-config` and start-up, not a retry."""
    secret = tmp_path / "state.key"
    secret.write_bytes(b"x" * 40 + b"\n")
    environ = {"MCP_TASKS_PROXY_INPUTS__SECRET_FILE": str(secret), "MCP_TASKS_PROXY_UPSTREAM__URL": SIDECAR_URL}
    config = load_config(None, environ=environ)
    assert config.inputs.secret_file == str(secret)
    secret.write_bytes(b"short\n")
    file = tmp_path / "proxy.yaml"
    file.write_text(f"inputs: {{secret_file: {secret}}}\nupstream: {{url: {SIDECAR_URL}}}\n")
    assert main(["check-config", str(file)]) == 2
    assert "inputs.secret_file" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(None, environ={}, overrides={"inputs": {"secret_file": str(tmp_path / "absent")}})


# --- the upstream: a URL or a command, exactly one ---------------------------------------------------------


@pytest.mark.parametrize(
    ("upstream", "which"),
    [
        ({}, "neither is set"),
        ({"url": "", "command": []}, "neither is set"),
        ({"url": None, "command": None}, "neither is set"),
        ({"url": SIDECAR_URL, "command": ["uvx", "mcp-server-fetch"]}, "both are set"),
    ],
)
def test_exactly_one_of_url_and_command_is_set(upstream: dict[str, object], which: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, environ={}, overrides={"upstream": upstream})
    [problem] = caught.value.problems
    assert problem.startswith("upstream: ")
    assert "upstream.url" in problem
    assert "upstream.command" in problem
    assert which in problem


def test_no_config_at_all_names_the_missing_upstream() -> None:
    with pytest.raises(ConfigError, match=r"upstream\.url .* upstream\.command .*neither is set"):
        load_config(None, environ={})


def test_a_stdio_upstream_loads_with_its_settings_and_null_clears_the_url(tmp_path: Path) -> None:
    path = tmp_path / "stdio.yaml"
    path.write_text(
        "upstream:\n  url: http://127.0.0.1:9000/mcp\n  command: [npx, -y, '@modelcontextprotocol/server-everything']\n"
        "  env: {API_KEY: abc}\n  cwd: /srv\n  max_processes: 2\n  max_line_bytes: 65536\n"
    )
    with pytest.raises(ConfigError, match="both are set"):
        load_config(path, environ={})
    upstream = load_config(path, environ={"MCP_TASKS_PROXY_UPSTREAM__URL": "null"}).upstream
    assert isinstance(upstream, StdioUpstreamConfig)  # the url's own settings are gone with it
    assert upstream.command == ["npx", "-y", "@modelcontextprotocol/server-everything"]
    assert (upstream.env, upstream.cwd, upstream.max_processes, upstream.max_line_bytes) == (
        {"API_KEY": "abc"},
        "/srv",
        2,
        65536,
    )
    assert (upstream.process_idle_seconds, upstream.stop_grace_seconds) == (300.0, 5.0)
    environ = {"MCP_TASKS_PROXY_UPSTREAM__URL": "", "MCP_TASKS_PROXY_UPSTREAM__COMMAND": "[uvx, mcp-server-fetch]"}
    switched = load_config(path, environ=environ).upstream
    assert isinstance(switched, StdioUpstreamConfig)
    assert switched.command == ["uvx", "mcp-server-fetch"]


def test_stdio_settings_are_checked(tmp_path: Path) -> None:
    overrides = {
        "upstream": {"command": ["ok", ""], "max_processes": 0, "max_line_bytes": 10, "env": {"N": 1}},
    }
    with pytest.raises(ConfigError) as caught:
        load_config(None, environ={}, overrides=overrides)
    problems = "\n".join(caught.value.problems)
    for expected in ("upstream.command.1", "upstream.max_processes", "upstream.max_line_bytes", "upstream.env.N"):
        assert expected in problems


def test_the_env_description_names_every_inherited_variable() -> None:
    description = StdioUpstreamConfig.model_fields["env"].description
    assert description is not None
    for name in INHERITED_ENV_VARS:
        assert name in description, name


def test_check_config_reports_both_and_neither_and_accepts_a_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "proxy.yaml"
    file.write_text("upstream: {command: [uvx, mcp-server-fetch]}\n")
    assert main(["check-config", str(file)]) == 0
    assert "ok" in capsys.readouterr().out
    file.write_text("upstream: {command: [uvx, mcp-server-fetch], url: http://127.0.0.1:9000/mcp}\n")
    assert main(["check-config", str(file)]) == 2
    assert "both are set" in capsys.readouterr().err
    file.write_text("listen: {port: 8081}\n")
    assert main(["check-config", str(file)]) == 2
    err = capsys.readouterr().err
    assert "upstream.url" in err
    assert "upstream.command" in err
    assert "neither is set" in err


def test_a_postgresql_store_from_the_file_and_the_environment(tmp_path: Path) -> None:
    password = tmp_path / "pg.password"
    password.write_text("s3cret with spaces\n")
    path = tmp_path / "c.yaml"
    key = tmp_path / "deployment.key"
    key.write_text("k" * 64)
    path.write_text(
        f"upstream: {{url: {SIDECAR_URL}}}\n"
        f"security: {{key_file: {key}}}\n"
        f"store: {{url: 'postgresql://proxy@db:5432/tasks', password_file: {password}, pool_size: 4}}\n"
    )
    config = load_config(path, environ={"MCP_TASKS_PROXY_STORE__LEASE_SECONDS": "2.5"})
    assert (config.store.url, config.store.password_file, config.store.pool_size) == (
        "postgresql://proxy@db:5432/tasks",
        str(password),
        4,
    )
    assert config.store.lease_seconds == 2.5
    assert config.store.connect_timeout_seconds == 5.0
    assert read_password(str(password)) == "s3cret with spaces"  # only the line ending goes
    assert config.model_validate({"upstream": {"url": SIDECAR_URL}}).store.url is None  # SQLite unless a URL is given
    assert config.model_validate({"upstream": {"url": SIDECAR_URL}}).store.lease_seconds == 10.0


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://proxy:hunter2@db:5432/tasks",
        "postgres://proxy:@db/tasks",
        "postgresql://proxy@db/tasks?sslmode=require&password=hunter2",
    ],
)
def test_a_password_in_the_store_url_is_refused(url: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(None, environ={}, overrides={"store": {"url": url}, "upstream": {"url": SIDECAR_URL}})
    (problem,) = caught.value.problems
    assert problem.startswith("command line: store.url:")  # the overrides are what serve's flags give
    assert "must not contain a password" in problem
    assert "store.password_file" in problem
    assert "PGPASSWORD" in problem
    assert "hunter2" not in problem


def test_store_url_and_password_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"store\.url: .*postgresql:// URL"):
        load_config(None, environ={}, overrides={"store": {"url": "mysql://db/tasks"}})
    with pytest.raises(ConfigError, match=r"store\.password_file: .*cannot read"):
        load_config(
            None,
            environ={},
            overrides={"store": {"url": "postgresql://db/tasks", "password_file": str(tmp_path / "absent")}},
        )
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        load_config(None, environ={}, overrides={"store": {"url": "postgresql://db/t", "password_file": str(empty)}})
    empty.write_text("pw\n")
    with pytest.raises(ConfigError, match=r"only used with store\.url"):
        load_config(None, environ={}, overrides={"store": {"password_file": str(empty)}})
    with pytest.raises(ConfigError, match=r"store\.pool_size"):
        load_config(None, environ={}, overrides={"store": {"pool_size": 0}})
    with pytest.raises(ConfigError, match=r"store\.lease_seconds"):
        load_config(None, environ={}, overrides={"store": {"lease_seconds": 0}})


# --- Host patterns ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pattern", ["*", "mcp-server.*", "mcp-*.svc", "mcp-server.**.svc", "*.*"])
def test_host_patterns_that_would_admit_public_names_are_refused(pattern: str) -> None:
    """A `*` is a whole label and never the last one: `mcp-server.*` would accept mcp-server.com, a name anyone
    can register and point at the proxy (DNS rebinding)."""
    with pytest.raises(ConfigError) as caught:
        load_config(
            None,
            environ={},
            overrides={"upstream": {"url": SIDECAR_URL}, "security": {"allowed_hosts": ["localhost", pattern]}},
        )
    assert "security.allowed_hosts" in "\n".join(caught.value.problems)


def test_host_patterns_with_a_star_label_load() -> None:
    hosts = ["mcp-server", "mcp-server.*.svc", "mcp-server.*.svc.cluster.local", "*.example.com", "[::1]"]
    overrides: dict[str, dict[str, Any]] = {"upstream": {"url": SIDECAR_URL}, "security": {"allowed_hosts": hosts}}
    config = load_config(None, environ={}, overrides=overrides)
    assert config.security.allowed_hosts == hosts


def test_check_config_refuses_a_tools_quota_that_is_no_positive_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    file = tmp_path / "quota.yaml"
    file.write_text(
        "upstream: {url: http://a:1/mcp}\n"
        "tasks:\n  tools:\n    render: {calls_per_minute_per_principal: 0}\n"
        "    export: {calls_per_minute_per_principal: many}\n    fine: {calls_per_minute_per_principal: 10}\n"
    )
    assert main(["check-config", str(file)]) == 2
    err = capsys.readouterr().err
    assert "tasks.tools.render.calls_per_minute_per_principal" in err
    assert "tasks.tools.export.calls_per_minute_per_principal" in err
    assert "tasks.tools.fine" not in err
    file.write_text(
        "upstream: {url: http://a:1/mcp}\ntasks:\n  tools:\n    fine: {calls_per_minute_per_principal: 10}\n"
    )
    assert main(["check-config", str(file)]) == 0
