"""One supervised legacy MCP server process on the stdio transport: its lines in and out, its stderr rate-limited,
its process group stopped as the spec says. Owns no session logic: imports only the errors, the rates and the
wire's JSON writer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import structlog

from proxy.errors import InvalidRequestError, UpstreamError
from proxy.upstream.stdio import rates
from proxy.wire.jsonrpc import dumps

# Spec: https://modelcontextprotocol.io/specification/2025-11-25/basic/transports#stdio (one JSON-RPC message per line
# on stdin/stdout, nothing else on stdout, stderr free-form) and .../basic/lifecycle#stdio (shutdown: close stdin,
# then SIGTERM, then SIGKILL).
#
#     process = await StdioProcess.start(argv, env, cwd, max_line_bytes=..., on_message=..., name=...)
#     await process.send(message)                   # one line on its stdin
#     exited = await process.stop(grace_seconds)    # or wait_closed(), or the on_exit callback
#
# - `on_message(message)` is called synchronously, in order, for each JSON object read from stdout (a JSON
#   array of objects, a 2025-03-26 batch, gives one call per element). It must not raise and must not block.
#   With `oversized=SizeLimit(max_bytes, handler)`, the messages of a line longer than `max_bytes` go to
#   `handler` instead: the session refuses them, and the process lives on.
# - `on_exit(exited)` (optional) is called once, after the last `on_message`, when the process is gone.
# - A stdout line that is not JSON or not an object is logged (a short prefix only) and skipped; a line over
#   `max_line_bytes` kills the process group, and `ProcessExit.cause` says so.
# - stderr is logged line by line as `upstream_stderr` (truncated), rate-limited by a token bucket; what the
#   budget refuses is counted and logged as `upstream_stderr_suppressed`, at most once a second.
# - The server runs in a session (process group) of its own; every signal goes to the whole group, and what
#   is left of the group when the server exits is killed, so helpers it started do not outlive it.
#
# The protocol frames lines itself (no StreamReader): the exit is learnt from the child watcher, not from the pipes
# closing, so a grandchild holding stdout open cannot hang the proxy. Owns no session logic: it imports only
# proxy.errors, proxy.upstream.stdio.rates and the wire's JSON writer, never session, call or tasks modules.

log = structlog.get_logger(__name__)

# Inherited from the proxy's environment when present: the mcp SDK's list, plus locale, zone and temp dir;
# the cache and config directories `uvx` and `npx` keep their downloads in; the trust store (a corporate CA
# bundle) and the outbound proxy that pip, uv, npm, Node, requests and curl read. Nothing else of it (credentials,
# MCP_TASKS_PROXY_*) reaches the server unless `upstream.env` names it.
BASIC_ENV_VARS = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR")
CACHE_ENV_VARS = (
    "XDG_CACHE_HOME",
    "XDG_CONFIG_HOME",
    "XDG_DATA_HOME",
    "XDG_STATE_HOME",
    "XDG_RUNTIME_DIR",
    "UV_CACHE_DIR",
    "UV_TOOL_DIR",
    "UV_PYTHON_INSTALL_DIR",
    "npm_config_cache",
    "NPM_CONFIG_CACHE",
)
TRUST_ENV_VARS = (
    "SSL_CERT_FILE",
    "SSL_CERT_DIR",
    "REQUESTS_CA_BUNDLE",
    "CURL_CA_BUNDLE",
    "NODE_EXTRA_CA_CERTS",
    "PIP_CERT",
    "UV_NATIVE_TLS",
)
PROXY_ENV_VARS = (
    "HTTP_PROXY",
    "HTTPS_PROXY",
    "NO_PROXY",
    "ALL_PROXY",
    "http_proxy",
    "https_proxy",
    "no_proxy",
    "all_proxy",
)
INHERITED_ENV_VARS = BASIC_ENV_VARS + CACHE_ENV_VARS + TRUST_ENV_VARS + PROXY_ENV_VARS
STDERR_LINE_CHARS = 1000  # a logged stderr line is cut here
MALFORMED_PREFIX_CHARS = 40  # of a skipped stdout line, only this much is logged
DRAIN_SECONDS = 1.0  # how long the exit and the end of stdout may be apart (the two arrive separately)

MessageHandler = Callable[[dict[str, Any]], None]


@dataclass(frozen=True, slots=True)
class SizeLimit:
    """Messages of a line longer than `max_bytes` (and within `max_line_bytes`) go to `handler`, not to
    `on_message`."""

    max_bytes: int
    handler: MessageHandler


def child_environment(configured: Mapping[str, str], parent: Mapping[str, str]) -> dict[str, str]:
    """The server's environment: INHERITED_ENV_VARS taken from `parent`, then `configured` over them."""
    env = {
        name: parent[name]
        for name in INHERITED_ENV_VARS
        if name in parent and not parent[name].startswith("()")  # skip exported shell functions
    }
    env.update(configured)
    return env


@dataclass(frozen=True)
class ProcessExit:
    """Why a server process is gone: the text a session puts in the error of the calls it fails."""

    returncode: int  # negative: killed by signal -returncode
    cause: str | None  # what the proxy saw and acted on (e.g. an oversized line); None: it exited by itself
    requested: bool  # stop() was called: not a crash
    lived_seconds: float

    def __str__(self) -> str:
        if self.returncode >= 0:
            how = f"exited with code {self.returncode}"
        else:
            try:
                how = f"killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                how = f"killed by signal {-self.returncode}"
        return f"{self.cause}; {how}" if self.cause else how


class _Pipes(asyncio.SubprocessProtocol):
    """asyncio's callbacks, handed to the StdioProcess that owns them."""

    def __init__(self, owner: StdioProcess) -> None:
        self.owner = owner

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Runs before subprocess_exec() returns, and before any other callback (even an immediate exit). A
        # subprocess transport (uvloop's does not derive from asyncio's class, hence a cast, not a check).
        transport = cast(asyncio.SubprocessTransport, transport)
        self.owner._transport = transport
        self.owner.pid = transport.get_pid()

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        assert isinstance(data, bytes)
        if fd == 1:
            self.owner._stdout_data(data)
        elif fd == 2:
            self.owner._stderr_data(data)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        self.owner._pipe_lost(fd)

    def process_exited(self) -> None:
        self.owner._process_exited()

    def pause_writing(self) -> None:
        self.owner._writable.clear()

    def resume_writing(self) -> None:
        self.owner._writable.set()


class StdioProcess:
    """One server process: write messages to it, get its messages by callback, stop it. See the module doc."""

    def __init__(
        self,
        name: str,
        *,
        max_line_bytes: int,
        on_message: MessageHandler,
        on_exit: Callable[[ProcessExit], None] | None,
        stop_grace_seconds: float,
        stderr_lines_per_second: float,
        stderr_burst: int,
        oversized: SizeLimit | None = None,
    ) -> None:
        self.name = name
        self.pid = 0
        self.max_line_bytes = max_line_bytes
        self.oversized = oversized
        self.stop_grace_seconds = stop_grace_seconds
        self.exited: ProcessExit | None = None
        self._on_message = on_message
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.SubprocessTransport | None = None
        self._started_at = self._loop.time()
        self._closed: asyncio.Future[ProcessExit] = self._loop.create_future()
        self._writable = asyncio.Event()
        self._writable.set()
        self._write_lock = asyncio.Lock()
        self._stdin_open = True
        self._stdout = bytearray()
        self._stdout_scanned = 0  # bytes of _stdout known to hold no newline
        self._stdout_open = True
        self._stderr = rates.LineSampler(
            rates.TokenBucket(stderr_lines_per_second, stderr_burst, self._started_at),
            4 * STDERR_LINE_CHARS,  # bytes: a UTF-8 character takes up to 4
            self._started_at,
        )
        self._malformed_budget = rates.TokenBucket(stderr_lines_per_second, stderr_burst, self._started_at)
        self._returncode: int | None = None
        self._cause: str | None = None
        self._requested = False
        self._timers: list[asyncio.TimerHandle] = []

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        env: Mapping[str, str],
        cwd: str | None,
        *,
        max_line_bytes: int,
        on_message: MessageHandler,
        name: str,
        on_exit: Callable[[ProcessExit], None] | None = None,
        stop_grace_seconds: float = 5.0,
        stderr_lines_per_second: float = 10.0,
        stderr_burst: int = 50,
        oversized: SizeLimit | None = None,
    ) -> StdioProcess:
        """Spawn `argv` with exactly `env` (see child_environment) in `cwd` (None: the proxy's).

        Raises UpstreamError when it cannot be started (no such program, not executable, bad cwd). A server
        that starts and exits at once is started: its exit arrives through wait_closed()/on_exit."""
        if not argv:
            raise ValueError("argv is empty")
        process = cls(
            name,
            max_line_bytes=max_line_bytes,
            on_message=on_message,
            on_exit=on_exit,
            stop_grace_seconds=stop_grace_seconds,
            stderr_lines_per_second=stderr_lines_per_second,
            stderr_burst=stderr_burst,
            oversized=oversized,
        )
        try:
            transport, _ = await process._loop.subprocess_exec(
                lambda: _Pipes(process),
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,  # its own process group: signals reach what it starts, too
            )
        except OSError as exc:
            raise UpstreamError(f"Cannot start stdio server {name}: {argv[0]}: {exc.strerror or exc}") from None
        assert transport is process._transport
        log.info("upstream_process_started", upstream=name, pid=process.pid, program=argv[0])
        return process

    # --- towards the server -------------------------------------------------------------------------------

    async def send(self, message: Mapping[str, Any]) -> None:
        """Write one message as one line of compact JSON and wait while the pipe is full (backpressure).

        Raises UpstreamError when the server is gone, is being stopped, or closed its stdin; InvalidRequestError,
        with nothing written, when the message would not be one line."""
        # One line: compact JSON (its strings escape any newline; a lone surrogate is sent escaped), `\n`-ended.
        encoded = dumps(message if isinstance(message, dict) else dict(message))
        if b"\n" in encoded or b"\r" in encoded:
            # MCP stdio transport: "Messages are delimited by newlines, and MUST NOT contain embedded newlines";
            # a CR is a line end to many readers. jsonrpc.dumps never writes either, but a RawJSON it splices
            # in (text kept from elsewhere) might: such a message is refused, not split into two.
            raise InvalidRequestError("The message cannot be sent to the stdio server: it holds a line break")
        line = encoded + b"\n"
        async with self._write_lock:
            self._check_writable()
            stdin = self._stdin()
            stdin.write(line)
            await self._writable.wait()
            self._check_writable()  # the pipe broke while the line was queued

    def _stdin(self) -> asyncio.WriteTransport:
        assert self._transport is not None
        return cast(asyncio.WriteTransport, self._transport.get_pipe_transport(0))  # stdin (as with the transport)

    def _check_writable(self) -> None:
        if self.exited is not None:
            raise UpstreamError(f"Stdio server {self.name} is gone: {self.exited}")
        if self._requested or self._cause is not None or self._returncode is not None:
            raise UpstreamError(f"Stdio server {self.name} is stopping")
        if not self._stdin_open:
            raise UpstreamError(f"Stdio server {self.name} does not read its stdin any more")

    # --- ending it ----------------------------------------------------------------------------------------

    async def wait_closed(self) -> ProcessExit:
        """Wait until the server is gone and reaped; every message it wrote has been delivered by then."""
        return await asyncio.shield(self._closed)

    async def stop(self, grace_seconds: float | None = None) -> ProcessExit:
        """Close its stdin and give it `grace_seconds` (default: stop_grace_seconds) to exit; then SIGTERM to
        its process group and as long again; then SIGKILL. Returns once it is reaped. Safe to call twice and
        after it exited; if the caller is cancelled meanwhile, the group is killed at once."""
        grace = self.stop_grace_seconds if grace_seconds is None else grace_seconds
        self._requested = True
        try:
            if self._transport is not None and self._stdin_open and self.exited is None:
                self._stdin_open = False
                self._stdin().close()
            for escalation in (signal.SIGTERM, signal.SIGKILL):
                if await self._exited_within(grace):
                    break
                self._signal_group(escalation)
            return await asyncio.shield(self._closed)
        except asyncio.CancelledError:
            self._signal_group(signal.SIGKILL)
            raise

    async def _exited_within(self, seconds: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(self._closed), seconds)
        except TimeoutError:
            return False
        return True

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.pid and self.exited is None:
            # ESRCH: nothing left in the group; EPERM: the id now names someone else's group.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)

    def _kill(self, cause: str) -> None:
        if self._cause is None:
            self._cause = cause
        self._signal_group(signal.SIGKILL)

    def _process_exited(self) -> None:
        assert self._transport is not None
        self._returncode = self._transport.get_returncode()
        # The leader is reaped; its group id stays reserved while anything it started still runs in it.
        self._signal_group(signal.SIGKILL)
        if self._stdout_open:
            self._timers.append(self._loop.call_later(DRAIN_SECONDS, self._finish))
        else:
            self._finish()

    def _pipe_lost(self, fd: int) -> None:
        if fd == 0:
            self._stdin_open = False
            self._writable.set()  # wake a sender waiting for room: it finds the pipe gone
        elif fd == 1:
            self._stdout_open = False
            if self._returncode is not None:
                self._finish()
            else:
                # Usually the exit is just about to be reported; if not, it closed stdout and lives on.
                self._timers.append(self._loop.call_later(DRAIN_SECONDS, self._stdout_closed_early))

    def _stdout_closed_early(self) -> None:
        """A server that closed stdout can say nothing more: end it as stop() would (it got stdin's grace)."""
        if self._returncode is None and self._cause is None and not self._requested:
            self._cause = "closed its stdout"
            self._signal_group(signal.SIGTERM)
            self._timers.append(self._loop.call_later(self.stop_grace_seconds, self._signal_group, signal.SIGKILL))

    def _finish(self) -> None:
        if self.exited is not None:
            return
        assert self._returncode is not None
        for timer in self._timers:
            timer.cancel()
        if self._stdout and self._cause is None:
            self._stdout_line(bytes(self._stdout))  # a last line without its newline
        self._stdout.clear()
        now = self._loop.time()
        self._log_stderr(self._stderr.flush(now), self._stderr.report(now, final=True))
        assert self._transport is not None
        self._transport.close()  # our ends of the pipes, also those a grandchild still holds open
        exited = ProcessExit(self._returncode, self._cause, self._requested, self._loop.time() - self._started_at)
        self.exited = exited
        (log.info if exited.requested else log.warning)(
            "upstream_process_exited", upstream=self.name, pid=self.pid, reason=str(exited)
        )
        self._closed.set_result(exited)
        self._writable.set()
        if self._on_exit is not None:
            self._on_exit(exited)

    # --- from the server ----------------------------------------------------------------------------------

    def _stdout_data(self, data: bytes) -> None:
        if self._cause is not None:
            return  # killed for an oversized line: the rest is discarded
        buffer = self._stdout
        buffer += data
        while (end := buffer.find(b"\n", self._stdout_scanned)) >= 0:
            line = bytes(buffer[:end])
            del buffer[: end + 1]  # bytearray drops its head without copying the rest
            self._stdout_scanned = 0
            if len(line) > self.max_line_bytes:
                break
            self._stdout_line(line)
            if self.exited is not None or self._cause is not None:
                return
        else:
            self._stdout_scanned = len(buffer)
            if len(buffer) <= self.max_line_bytes:
                return
        buffer.clear()
        self._kill(f"a stdout line over {self.max_line_bytes} bytes (upstream.max_line_bytes)")

    def _stdout_line(self, line: bytes) -> None:
        if not line.strip():
            return
        try:
            decoded = json.loads(line)
        except (ValueError, RecursionError):  # not UTF-8, not JSON, or nested too deep to parse
            self._malformed(line, "not JSON")
            return
        if isinstance(decoded, list) and decoded and all(isinstance(item, dict) for item in decoded):
            messages = decoded
        elif isinstance(decoded, dict):
            messages = [decoded]
        else:
            self._malformed(line, "not a JSON object")
            return
        oversized = self.oversized
        handle = oversized.handler if oversized is not None and len(line) > oversized.max_bytes else self._on_message
        for message in messages:
            handle(message)

    def _malformed(self, line: bytes, reason: str) -> None:
        if self._malformed_budget.take(self._loop.time()):
            prefix = line[: MALFORMED_PREFIX_CHARS * 4].decode("utf-8", "replace")[:MALFORMED_PREFIX_CHARS]
            context = {"upstream": self.name, "pid": self.pid, "length": len(line), "prefix": prefix}
            log.warning("upstream_stdout_malformed", reason=reason, **context)

    def _stderr_data(self, data: bytes) -> None:
        now = self._loop.time()
        self._log_stderr(self._stderr.feed(data, now), self._stderr.report(now))

    def _log_stderr(self, lines: list[tuple[bytes, bool]], suppressed: int) -> None:
        for line, cut in lines:
            text = line.decode("utf-8", "replace").rstrip("\r")
            cut = cut or len(text) > STDERR_LINE_CHARS
            shown = text[:STDERR_LINE_CHARS] + (" …" if cut else "")
            log.info("upstream_stderr", upstream=self.name, pid=self.pid, line=shown)
        if suppressed:
            log.warning("upstream_stderr_suppressed", upstream=self.name, pid=self.pid, lines=suppressed)
