"""The client in the box (`mcp-tasks-proxy tools`, `call`, `follow`) run as a person and a script would run it,
against a proxy on loopback in front of the fixture upstream: arguments typed by the tool's schema, a task
followed with its progress on the terminal, a question asked there, Ctrl-C that cancels the task or leaves it
running, credentials that own the task, and each exit code."""

from __future__ import annotations

import asyncio
import json
import shlex
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import structlog.testing
import yaml
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.reference_server import NODE
from tests.support.processes import ROOT, Upstream, free_port
from tests.support.terminal import ANSI, Terminal, client_argv, run_piped
from tests.support.wire import policies

Client = TestClient[web.Request, web.Application]
TOOLS = policies(sleep={"mode": "required"}, ask_name={"mode": "required"}, echo={"mode": "forbidden"})


@pytest.fixture
async def proxy_url(make_proxy: Callable[..., Any], upstream: Upstream) -> str:
    client: Client = await make_proxy(upstream.url, tasks=TOOLS)
    return str(client.make_url("/mcp"))


@pytest.fixture
async def terminals() -> AsyncIterator[list[Terminal]]:
    opened: list[Terminal] = []
    yield opened
    for terminal in opened:
        terminal.close()


async def piped(*words: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    done = await asyncio.to_thread(run_piped, client_argv(*words), ROOT, env)
    return done.returncode, done.stdout, done.stderr


def on_terminal(terminals: list[Terminal], *words: str, env: dict[str, str] | None = None) -> Terminal:
    terminal = Terminal(client_argv(*words), ROOT, env)
    terminals.append(terminal)
    return terminal


# --- a script's runs: pipes, exit codes ---------------------------------------------------------------------------


async def test_tools_lists_what_the_proxy_serves(proxy_url: str) -> None:
    code, out, err = await piped("tools", "--url", proxy_url)
    assert (code, err) == (0, "")
    names = [line.split()[0] for line in out.splitlines()]
    assert {"sleep", "echo", "ask_name"} <= set(names)
    assert any(line.startswith("echo") and "Returns `text` unchanged" in line for line in out.splitlines())
    code, out, _ = await piped("tools", "--url", proxy_url, "--json")
    assert code == 0
    assert {tool["name"] for tool in json.loads(out)["tools"]} >= {"sleep", "echo"}


async def test_a_call_types_its_arguments_by_the_schema_and_a_task_is_followed_to_its_result(proxy_url: str) -> None:
    code, out, err = await piped("call", "--url", proxy_url, "echo", "text=42")
    assert (code, out, err) == (0, "42\n", "")  # a string, though it reads as a number
    code, out, err = await piped("call", "--url", proxy_url, "sleep", "seconds=0.3")  # a task (required)
    assert (code, out) == (0, "slept 0.3\n"), err
    assert "task task_" in err
    assert not ANSI.search(err)  # stderr is no terminal: no live display
    code, out, _ = await piped("call", "--url", proxy_url, "--json", "sleep", "seconds=0.1", "pad:=3")
    assert code == 0
    assert json.loads(out)["content"][0]["text"] == "slept 0.1"  # the result, one JSON document


@pytest.mark.parametrize(
    ("words", "code", "said"),
    [
        (["tool_error", "message=broken"], 1, "broken"),
        (["raise_error", "message=refused"], 1, "refused"),
        (["slep", "seconds=1"], 2, "no tool 'slep' (did you mean 'sleep'?)"),
        (["sleep", "seconds=soon"], 2, "argument 'seconds' is a number, not 'soon'"),
        (["sleep", "secnds=1"], 2, "(did you mean 'seconds'?)"),
        (["sleep"], 2, "missing required argument: seconds (number)"),
        (["echo", "text"], 2, "'text' is not key=value or key:=JSON"),
    ],
    ids=["tool-error", "jsonrpc-error", "unknown-tool", "wrong-type", "unknown-argument", "missing", "not-key-value"],
)
async def test_each_failure_has_its_exit_code(proxy_url: str, words: list[str], code: int, said: str) -> None:
    exit_code, out, err = await piped("call", "--url", proxy_url, *words)
    assert exit_code == code, (out, err)
    assert said in out + err


async def test_a_proxy_that_cannot_be_reached_is_exit_code_3() -> None:
    code, out, err = await piped("call", "--url", f"http://127.0.0.1:{free_port()}/mcp", "echo", "text=x")
    assert (code, out) == (3, "")
    assert "cannot reach the proxy at" in err


async def test_the_endpoint_comes_from_a_config_files_listen_address(
    make_proxy: Callable[..., Any], upstream: Upstream, tmp_path: Path
) -> None:
    client: Client = await make_proxy(upstream.url)
    config = tmp_path / "proxy.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "listen": {"host": "0.0.0.0", "port": client.port, "path": "/mcp"},  # every interface: loopback
                "upstream": {"url": upstream.url},
                "security": {"key_file": "/var/run/secrets/only-in-the-pod"},  # not read for an address
            }
        )
    )
    code, out, err = await piped("call", "--config", str(config), "echo", "text=from the config")
    assert (code, out) == (0, "from the config\n"), err


async def test_credentials_own_the_task_and_a_missing_one_is_said(
    make_proxy: Callable[..., Any], upstream: Upstream
) -> None:
    client: Client = await make_proxy(upstream.url, tasks=TOOLS, security={"anonymous": "refuse"})
    url = str(client.make_url("/mcp"))
    code, _, err = await piped("call", "--url", url, "echo", "text=x")
    assert code == 1
    assert "send a credential" in err
    alice = {"MCP_TASKS_CLIENT_TOKEN": "alice-token"}
    code, out, err = await piped("call", "--url", url, "--json", "sleep", "seconds=0.2", env=alice)
    assert code == 0, err
    task_id = err.split("task ", 1)[1].split()[0]
    code, out, _ = await piped("follow", "--url", url, "--header", "Authorization: Bearer alice-token", task_id)
    assert (code, out) == (0, "slept 0.2\n")
    code, _, err = await piped("follow", "--url", url, task_id, env={"MCP_TASKS_CLIENT_TOKEN": "mallory"})
    assert code == 1  # another caller's task is not found
    assert "-32602" in err


# --- a person's runs: a terminal --------------------------------------------------------------------------------


async def test_a_question_is_asked_on_the_terminal_while_the_task_shows_its_progress(
    proxy_url: str, terminals: list[Terminal]
) -> None:
    terminal = on_terminal(terminals, "call", "--url", proxy_url, "ask_name")
    await terminal.shows("The server asks: What is your name?")
    assert "ask_name" in terminal.text  # the live display's label
    await terminal.shows("Answer (a), decline (d) or cancel (c)?")
    terminal.type("a")
    await terminal.shows("name (string, required):")
    terminal.type("Ada")
    assert await terminal.exit_code() == 0
    assert "Hello, Ada" in terminal.text


async def test_the_progress_of_a_task_is_shown_live(proxy_url: str, terminals: list[Terminal]) -> None:
    terminal = on_terminal(terminals, "call", "--url", proxy_url, "sleep", "seconds=1.5")
    await terminal.shows("/1.5 s")  # the upstream's progress message, as the task's statusMessage says it
    assert await terminal.exit_code() == 0
    assert "slept 1.5" in terminal.text


async def test_ctrl_c_offers_to_cancel_the_task_and_the_proxy_logs_the_cancel(
    proxy_url: str, terminals: list[Terminal]
) -> None:
    with structlog.testing.capture_logs() as events:
        terminal = on_terminal(terminals, "call", "--url", proxy_url, "sleep", "seconds=60")
        await terminal.shows("task task_")
        terminal.interrupt()
        await terminal.shows("Cancel task")
        terminal.type("y")
        assert await terminal.exit_code() == 1
        assert "cancelled" in terminal.text
        task_id = terminal.text.split("task ", 1)[1].split()[0]
        code, out, _ = await piped("follow", "--url", proxy_url, "--json", task_id)
    assert code == 1
    assert json.loads(out)["status"] == "cancelled"
    settled = [event for event in events if event.get("task_id") == task_id and event["event"] == "task_settled"]
    assert [event["status"] for event in settled] == ["cancelled"]


async def test_ctrl_c_can_leave_the_task_running_and_follow_takes_it_to_its_end(
    proxy_url: str, terminals: list[Terminal]
) -> None:
    terminal = on_terminal(terminals, "call", "--url", proxy_url, "sleep", "seconds=2")
    await terminal.shows("task task_")
    terminal.interrupt()
    await terminal.shows("Cancel task")
    terminal.type("n")
    assert await terminal.exit_code() == 130
    assert "keeps running; follow it with: mcp-tasks-proxy follow task_" in terminal.text
    task_id = terminal.text.split("follow it with: mcp-tasks-proxy follow ", 1)[1].split()[0]
    code, out, err = await piped("follow", "--url", proxy_url, task_id)
    assert (code, out) == (0, "slept 2\n"), err


# --- the client guide's snippets (docs/guides/clients.md) ---------------------------------------------------------

GUIDE = ROOT / "docs" / "guides" / "clients.md"
DEFAULT_URL = "http://127.0.0.1:8080/mcp"
INSPECTOR = ROOT / "conformance" / "node_modules" / "@modelcontextprotocol" / "inspector"


def snippet(name: str) -> str:
    """The code block after `<!-- client: NAME -->` in the guide."""
    text = GUIDE.read_text()
    start = text.index("```", text.index(f"<!-- client: {name} -->"))
    body = text[text.index("\n", start) + 1 :]
    return body[: body.index("```")]


def commands(block: str) -> list[list[str]]:
    return [shlex.split(line.split(" #", 1)[0]) for line in block.splitlines() if line.strip()]


async def test_the_guides_own_client_lines_answer_as_they_say(proxy_url: str) -> None:
    outputs = []
    for words in commands(snippet("the proxy's own")):
        assert words[0] == "mcp-tasks-proxy"
        code, out, err = await piped(words[1], "--url", proxy_url, *words[2:])  # the guide's default URL is 8080's
        assert code == 0, err
        outputs.append(out)
    assert "echo" in outputs[0]
    assert outputs[1] == "hello\n"
    assert outputs[2] == "slow_compute finished: label=first seconds=2\n"


async def test_the_guides_inspector_lines_answer_as_they_say(proxy_url: str) -> None:
    """The Inspector the guide pins (conformance/package.json installs that version: `make unit`)."""
    pinned = json.loads((ROOT / "conformance" / "package.json").read_text())["dependencies"]
    launcher = INSPECTOR / "clients" / "launcher" / "build" / "index.js"
    assert launcher.is_file(), "the MCP Inspector is not installed: run `make unit` (npm ci in conformance/)"
    outputs = []
    for words in commands(snippet("inspector")):
        assert words[:3] == [
            "npx",
            "-y",
            f"@modelcontextprotocol/inspector@{pinned['@modelcontextprotocol/inspector']}",
        ]
        argv = [str(NODE), str(launcher), *(proxy_url if word == DEFAULT_URL else word for word in words[3:])]
        done = await asyncio.to_thread(run_piped, argv, ROOT)
        assert done.returncode == 0, done.stderr
        outputs.append(json.loads(done.stdout))
    assert "echo" in {tool["name"] for tool in outputs[0]["tools"]}
    assert outputs[1]["content"] == [{"type": "text", "text": "hello"}]
    assert outputs[1]["isError"] is False


@pytest.mark.parametrize("client", ["claude-code", "cursor", "vscode", "claude-desktop"])
def test_the_guides_client_configurations_name_the_endpoint(client: str) -> None:
    config = json.loads(snippet(client))
    servers = config.get("mcpServers") or config["servers"]
    (entry,) = servers.values()
    named = entry.get("url") or entry["args"][entry["args"].index(DEFAULT_URL)]
    assert named == DEFAULT_URL
    assert "Authorization" in json.dumps(entry)  # how the credential goes with it
