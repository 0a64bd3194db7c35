"""upstream/stdio/process.py against real server processes: the mcp 1.x fixture over stdio and the faulty servers of
tests/upstream/faulty_stdio.py. Every test ends with no child process and no member of a server's process
group left (counted in /proc)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import structlog

from proxy.errors import InvalidRequestError, UpstreamError
from proxy.upstream.stdio.process import (
    INHERITED_ENV_VARS,
    STDERR_LINE_CHARS,
    ProcessExit,
    SizeLimit,
    StdioProcess,
    child_environment,
)
from proxy.wire.jsonrpc import RawJSON
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = [sys.executable, "-m", "tests.upstream", "--stdio"]
TIMEOUT_SECONDS = 20  # generous: the fixture imports the mcp SDK on a shared 2-core machine
INITIALIZE = {
    "protocolVersion": "2025-11-25",
    "capabilities": {"elicitation": {}},
    "clientInfo": {"name": "stdio-test", "version": "1"},
}


def faulty(mode: str, *options: str) -> list[str]:
    return [sys.executable, "-m", "tests.upstream.faulty_stdio", mode, *options]


def children() -> set[int]:
    """Direct children of this test process (of all its threads), zombies included."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # gone meanwhile
            found.update(int(pid) for pid in (task / "children").read_text().split())
    return found


def group_members(pgid: int) -> set[int]:
    """Every live process whose process group is `pgid`. The SIGKILL the group gets when its leader exits is
    delivered asynchronously: a member may still be running its exit (its pipes already closed) when `stop()`
    returns, so callers wait for the set to empty rather than read it once."""
    members = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # gone meanwhile
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()  # state, ppid, pgrp, ...
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.add(int(entry.name))
    return members


class Peer:
    """The proxy's side of one server: what it sent, in order, and how it ended."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.exits: list[ProcessExit] = []
        self.process: StdioProcess

    async def next(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.inbox.get(), TIMEOUT_SECONDS)

    async def request(self, request_id: int, method: str, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        await self.process.send(message)
        return await self.next()

    async def initialize(self) -> dict[str, Any]:
        answer = await self.request(1, "initialize", INITIALIZE)
        await self.process.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        return answer


Spawn = Callable[..., Awaitable[Peer]]


@pytest.fixture
async def spawn() -> AsyncIterator[Spawn]:
    """Start servers; afterwards stop them all and check that nothing they started is left."""
    before = children()
    peers: list[Peer] = []

    async def start(argv: list[str], env: Mapping[str, str] | None = None, cwd: Path = ROOT, **options: Any) -> Peer:
        peer = Peer()
        options.setdefault("max_line_bytes", 1024 * 1024)
        options.setdefault("stop_grace_seconds", 2.0)
        peer.process = await StdioProcess.start(
            argv,
            child_environment({}, os.environ) if env is None else env,
            str(cwd),
            on_message=peer.inbox.put_nowait,
            on_exit=peer.exits.append,
            name=f"test-{len(peers)}",
            **options,
        )
        peers.append(peer)
        return peer

    yield start
    for peer in peers:
        await peer.process.stop(1.0)
        assert peer.exits == [peer.process.exited], "on_exit is called exactly once, with the exit"
        await group_ends(peer.process.pid, "a member of the server's process group survived it")
    assert children() == before, "a server process was left behind (or not reaped)"


async def group_ends(pgid: int, what: str) -> None:
    await until(lambda: not group_members(pgid), what, TIMEOUT_SECONDS)


def text_of(response: dict[str, Any]) -> str:
    content = response["result"]["content"]
    assert isinstance(content, list)
    text = content[0]["text"]
    assert isinstance(text, str)
    return text


# --- the real fixture over stdio ---------------------------------------------------------------------------


async def test_the_fixture_answers_initialize_a_tool_call_and_a_question_over_stdio(spawn: Spawn) -> None:
    server = await spawn(FIXTURE)
    initialized = await server.initialize()
    assert initialized["id"] == 1
    assert initialized["result"]["serverInfo"]["name"] == "legacy-fixture-upstream"
    assert initialized["result"]["protocolVersion"] == "2025-11-25"

    greeted = await server.request(2, "tools/call", {"name": "greet", "arguments": {"name": "stdio"}})
    assert greeted["id"] == 2
    assert text_of(greeted) == "Hello, stdio!"

    # A server→client request arrives on stdout and is answered on stdin.
    await server.process.send({"jsonrpc": "2.0", "id": 3, "method": "tools/call", "params": {"name": "ask_name"}})
    question = await server.next()
    assert question["method"] == "elicitation/create"
    answer = {"action": "accept", "content": {"name": "Ada"}}
    await server.process.send({"jsonrpc": "2.0", "id": question["id"], "result": answer})
    asked = await server.next()
    assert (asked["id"], text_of(asked)) == (3, "Hello, Ada")

    exited = await server.process.stop(5.0)
    assert (exited.returncode, exited.requested, exited.cause) == (0, True, None), str(exited)
    assert str(exited) == "exited with code 0"  # closing stdin was enough: no signal needed


async def test_messages_arrive_in_order_and_the_whole_process_group_ends_with_the_server(spawn: Spawn) -> None:
    # `cat` echoes every line back: a perfect stdio peer. The background `sleep` shares its process group
    # and holds its stdout open; it must not outlive the server.
    server = await spawn(["sh", "-c", "sleep 300 & exec cat"])
    sent = [{"jsonrpc": "2.0", "method": "n", "params": {"i": i, "text": "line\nbreak ü"}} for i in range(300)]
    sent.append({"jsonrpc": "2.0", "method": "n", "params": {"lone surrogate": "\ud800"}})  # not UTF-8-encodable
    for message in sent:
        await server.process.send(message)
    received = [await server.next() for _ in sent]
    assert received == sent
    await until(lambda: len(group_members(server.process.pid)) == 2, "sleep and cat both run", TIMEOUT_SECONDS)
    exited = await server.process.stop(5.0)
    assert exited.returncode == 0
    await group_ends(server.process.pid, "the background sleep outlived the server")


@pytest.mark.parametrize("break_", ["\n", "\r", "\r\n"])
async def test_a_message_that_would_not_be_one_line_is_refused_before_a_byte_is_written(
    spawn: Spawn, break_: str
) -> None:
    """MCP stdio transport: messages MUST NOT contain embedded newlines. A raw line break can only come from
    kept JSON text spliced in as it is (whitespace between its tokens); the message is refused with the proxy's
    own error, nothing of it reaches the server, and the server lives on."""
    server = await spawn(["cat"])
    smuggled = {"jsonrpc": "2.0", "method": "n", "params": {"kept": RawJSON(f'{{"a":{break_}{{"jsonrpc":"2.0"}}}}')}}
    with pytest.raises(InvalidRequestError, match="line break"):
        await server.process.send(smuggled)
    after = {"jsonrpc": "2.0", "method": "n", "params": {"i": 1}}
    await server.process.send(after)
    assert await server.next() == after  # the first line the server read: nothing of the refused message
    assert server.process.exited is None


async def test_the_environment_is_the_inherited_few_plus_the_configured_and_cwd_applies(
    spawn: Spawn, tmp_path: Path
) -> None:
    parent = {**os.environ, "SECRET_TOKEN": "do-not-pass", "LANG": "C.UTF-8", "BASH_FUNC_x%%": "() { :; }"}
    env = child_environment({"GREETING": "hi", "LANG": "en_US.UTF-8"}, parent)
    assert env["GREETING"] == "hi"
    assert env["LANG"] == "en_US.UTF-8"  # configured beats inherited
    assert "SECRET_TOKEN" not in env
    assert set(env) <= {*INHERITED_ENV_VARS, "GREETING"}
    assert env["PATH"] == os.environ["PATH"]
    script = "import json, os; print(json.dumps({'env': dict(os.environ), 'cwd': os.getcwd()}), flush=True)"
    server = await spawn([sys.executable, "-c", script], env=env, cwd=tmp_path)
    exited = await asyncio.wait_for(server.process.wait_closed(), TIMEOUT_SECONDS)
    assert exited.returncode == 0
    seen = await server.next()
    assert server.inbox.empty()
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"]["GREETING"] == "hi"
    assert "SECRET_TOKEN" not in seen["env"]


async def test_a_program_that_cannot_start_is_an_upstream_error(tmp_path: Path) -> None:
    with pytest.raises(UpstreamError, match=r"Cannot start stdio server broken: .*no-such-program"):
        await StdioProcess.start(
            [str(tmp_path / "no-such-program")], {}, None, max_line_bytes=1024, on_message=print, name="broken"
        )


# --- faulty servers ----------------------------------------------------------------------------------------


async def test_a_server_that_exits_at_start_reports_its_exit_code(spawn: Spawn) -> None:
    server = await spawn(faulty("exit-at-start"))
    exited = await asyncio.wait_for(server.process.wait_closed(), TIMEOUT_SECONDS)
    assert (exited.returncode, exited.requested, exited.cause) == (3, False, None)
    assert str(exited) == "exited with code 3"
    assert server.exits == [exited]
    with pytest.raises(UpstreamError, match="is gone: exited with code 3"):
        await server.process.send({"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert await server.process.stop(1.0) is exited  # stopping a gone server just returns its exit


async def test_garbage_lines_are_logged_by_prefix_and_skipped(spawn: Spawn) -> None:
    server = await spawn(faulty("garbage"))
    with structlog.testing.capture_logs() as events:
        initialized = await server.initialize()
        called = await server.request(2, "tools/call", {"name": "echo", "arguments": {"a": 1}})
        pinged = await server.request(3, "ping")
    assert initialized["result"]["serverInfo"]["name"] == "faulty-stdio"
    assert text_of(called) == '{"a": 1}'
    assert pinged == {"jsonrpc": "2.0", "id": 3, "result": {}}
    assert server.inbox.empty(), "only the three answers are messages"
    malformed = [event for event in events if event["event"] == "upstream_stdout_malformed"]
    # Per answer: "this is not JSON", invalid UTF-8 and 1000 x's are not JSON; [1, 2], "a string", 42 and
    # null are not objects; the blank line is skipped silently.
    assert sorted(event["reason"] for event in malformed[:7]) == ["not JSON"] * 3 + ["not a JSON object"] * 4
    assert len(malformed) == 21
    long_one = next(event for event in malformed if event["length"] == 1000)
    assert long_one["prefix"] == "x" * 40  # never the whole line


async def test_a_server_that_never_answers_is_stopped_by_sigterm(spawn: Spawn) -> None:
    with structlog.testing.capture_logs() as events:
        server = await spawn(faulty("no-initialize"))
        await until(
            lambda: any(e.get("line") == "ready" for e in events),
            "the server says it is ready on stderr",
            TIMEOUT_SECONDS,
        )
    await server.process.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": INITIALIZE})
    started = asyncio.get_running_loop().time()
    exited = await server.process.stop(0.5)  # closing stdin does not end it: SIGTERM after 0.5 s does
    assert exited.returncode == -signal.SIGTERM
    assert exited.requested
    assert str(exited) == "killed by SIGTERM"
    assert asyncio.get_running_loop().time() - started < 10  # a safety bound, not a timing measurement
    assert server.inbox.empty()


async def test_a_server_that_ignores_sigterm_is_killed(spawn: Spawn) -> None:
    with structlog.testing.capture_logs() as events:
        server = await spawn(faulty("no-initialize", "--ignore-sigterm"))
        await until(
            lambda: any(e.get("line") == "ready" for e in events),
            "the server says it is ready on stderr",
            TIMEOUT_SECONDS,
        )
    exited = await server.process.stop(0.3)
    assert exited.returncode == -signal.SIGKILL
    assert str(exited) == "killed by SIGKILL"
    with pytest.raises(UpstreamError, match="is gone: killed by SIGKILL"):
        await server.process.send({"jsonrpc": "2.0", "method": "notifications/initialized"})


async def test_a_stderr_flood_stays_within_the_log_budget_and_the_server_keeps_answering(spawn: Spawn) -> None:
    rate, burst = 5.0, 10
    with structlog.testing.capture_logs() as events:
        started = asyncio.get_running_loop().time()
        server = await spawn(faulty("stderr-flood"), stderr_lines_per_second=rate, stderr_burst=burst)
        await server.initialize()
        for request_id in range(2, 12):
            called = await server.request(request_id, "tools/call", {"name": "echo", "arguments": {"n": request_id}})
            assert text_of(called) == f'{{"n": {request_id}}}'

        def suppressed() -> int:
            return sum(e["lines"] for e in events if e["event"] == "upstream_stderr_suppressed")

        await until(lambda: suppressed() > 50_000, "megabytes of stderr were read", TIMEOUT_SECONDS)
        exited = await server.process.stop(2.0)
        elapsed = asyncio.get_running_loop().time() - started
    assert exited.requested
    logged = [event for event in events if event["event"] == "upstream_stderr"]
    assert logged, "some stderr lines are logged"
    assert len(logged) <= burst + rate * elapsed + 1
    summaries = [event for event in events if event["event"] == "upstream_stderr_suppressed"]
    assert len(summaries) <= elapsed + 2  # at most one a second, plus the last one
    assert all(event["pid"] == server.process.pid and event["upstream"] == "test-0" for event in logged)
    assert all(len(event["line"]) <= STDERR_LINE_CHARS + 2 for event in logged)


async def test_a_line_over_the_cap_kills_the_server_after_what_came_before(spawn: Spawn) -> None:
    server = await spawn(faulty("huge-line", "--bytes", str(1024 * 1024)), max_line_bytes=65536)
    initialized = await server.initialize()
    assert initialized["result"]["serverInfo"]["name"] == "faulty-stdio"
    exited = await asyncio.wait_for(server.process.wait_closed(), TIMEOUT_SECONDS)
    assert exited.cause == "a stdout line over 65536 bytes (upstream.max_line_bytes)"
    assert exited.returncode == -signal.SIGKILL
    assert not exited.requested
    assert str(exited) == "a stdout line over 65536 bytes (upstream.max_line_bytes); killed by SIGKILL"
    assert server.inbox.empty(), "nothing of the oversized line is delivered"
    with pytest.raises(UpstreamError, match="over 65536 bytes"):
        await server.process.send({"jsonrpc": "2.0", "id": 2, "method": "ping"})


async def test_a_line_over_the_message_limit_goes_to_its_handler_and_the_server_lives_on(spawn: Spawn) -> None:
    """Within `max_line_bytes` but over the `oversized` limit: the message is handed to the limit's handler (the
    session refuses it), not to `on_message`, and what follows arrives as usual."""
    oversized: list[dict[str, Any]] = []
    server = await spawn(FIXTURE, oversized=SizeLimit(100_000, oversized.append))
    await server.initialize()
    await server.process.send(
        {
            "jsonrpc": "2.0",
            "id": 2,
            "method": "tools/call",
            "params": {"name": "big_text", "arguments": {"size": 200_000}},
        }
    )
    small = await server.request(3, "tools/call", {"name": "big_text", "arguments": {"size": 1_000}})
    assert (small["id"], len(text_of(small))) == (3, 1_000)
    assert [message["id"] for message in oversized] == [2]
    assert len(text_of(oversized[0])) == 200_000
    assert server.inbox.empty()
    assert server.process.exited is None


async def test_a_server_that_closes_stdout_but_lives_on_is_terminated(spawn: Spawn) -> None:
    server = await spawn(["sh", "-c", "exec 1>&-; exec sleep 300"])
    exited = await asyncio.wait_for(server.process.wait_closed(), TIMEOUT_SECONDS)
    assert exited.cause == "closed its stdout"
    assert exited.returncode == -signal.SIGTERM
    assert not exited.requested


async def test_a_send_waits_while_the_server_does_not_read_and_fails_once_it_is_stopped(spawn: Spawn) -> None:
    server = await spawn(["sleep", "300"])  # never reads its stdin
    padding = {"jsonrpc": "2.0", "method": "n", "params": {"pad": "x" * 65536}}

    async def send_many() -> None:
        for _ in range(20):  # 1.3 MB: far more than a pipe and the write buffer hold
            await server.process.send(padding)

    sending = asyncio.get_running_loop().create_task(send_many())
    done, _ = await asyncio.wait({sending}, timeout=0.5)
    assert not done, "the sends wait for the server to read"
    exited = await server.process.stop(0.2)
    assert exited.returncode == -signal.SIGTERM
    # Woken when its pipe broke, or when the exit was recorded: whichever asyncio reported first.
    with pytest.raises(UpstreamError, match=r"Stdio server test-0 is (stopping|gone: killed by SIGTERM)"):
        await sending
    with pytest.raises(UpstreamError, match="Stdio server test-0 is gone: killed by SIGTERM"):
        await server.process.send(padding)
