"""cli.py: `serve … -- CMD ARGS` names a stdio server, and the flags that choose the upstream."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import flag_overrides, main, parse_args
from proxy.config.loader import load_config
from proxy.config.schema import HttpUpstreamConfig, StdioUpstreamConfig

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "config" / "proxy.example.yaml"


def test_everything_after_the_double_dash_is_the_server_command_verbatim() -> None:
    args = parse_args(["serve", "--config", "p.yaml", "--port", "0", "--", "npx", "-y", "pkg", "--", "--port", "9"])
    assert args.command == "serve"
    assert args.config == "p.yaml"
    assert args.port == 0
    assert args.server_command == ["npx", "-y", "pkg", "--", "--port", "9"]


def test_the_server_command_replaces_the_files_url_and_a_url_flag_replaces_its_command(tmp_path: Path) -> None:
    config = load_config(EXAMPLE, environ={}, overrides=flag_overrides(parse_args(["serve", "--", "uvx", "srv"])))
    assert isinstance(config.upstream, StdioUpstreamConfig)
    assert config.upstream.command == ["uvx", "srv"]
    stdio = tmp_path / "stdio.yaml"
    stdio.write_text("upstream: {command: [uvx, srv], env: {A: b}}\n")
    args = parse_args(["serve", "--config", str(stdio), "--upstream", "http://127.0.0.1:1/mcp"])
    config = load_config(args.config, environ={}, overrides=flag_overrides(args))
    assert isinstance(config.upstream, HttpUpstreamConfig)
    assert config.upstream.url == "http://127.0.0.1:1/mcp"
    assert parse_args(["serve"]).server_command == []


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--"], "must be followed by the server's command"),
        (["serve", "--upstream", "http://127.0.0.1:1/mcp", "--", "uvx", "srv"], "not both"),
        (["check-config", "p.yaml", "--upstream", "http://127.0.0.1:1/mcp", "--", "uvx"], "not both"),
        (["tasks", "stats", "--db", "t.db", "--", "uvx"], "only `serve` and `check-config` take a server command"),
    ],
)
def test_misplaced_server_commands_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_args(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_serve_without_any_upstream_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "proxy.yaml"
    file.write_text("listen: {port: 0}\n")
    assert main(["serve", "--config", str(file)]) == 2
    err = capsys.readouterr().err
    assert "upstream.url" in err
    assert "neither is set" in err


def test_serve_help_shows_the_server_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["serve", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    assert "[-- CMD ARGS...]" in out
    assert "upstream.command" in out
