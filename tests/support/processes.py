"""Child processes and the config that starts them: a legacy fixture upstream (`python -m tests.upstream`), the
proxy as `python -m proxy serve`, the `upstream` section for the fixture as a stdio server, an in-process
proxy's config, and this test process's children. Everything runs from the repository root, nothing outside."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.config.loader import load_config
from proxy.config.schema import Config
from proxy.edge._app_keys import POOL
from proxy.upstream.stdio.session import StdioSession
from tests.support.clients import Tasks
from tests.support.waiting import until

ROOT = Path(__file__).resolve().parent.parent.parent  # the repository
STDIO_FIXTURE = [sys.executable, "-m", "tests.upstream", "--stdio"]


class Upstream:
    """A legacy fixture server running in its own process."""

    def __init__(self, *flags: str) -> None:
        self.flags = flags
        self.process: subprocess.Popen[str] | None = None
        self.url = ""

    def start(self, port: int = 0) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.upstream", "--host", "127.0.0.1", "--port", str(port), *self.flags],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().strip()
        if not line.startswith("ready "):
            self.stop()
            raise RuntimeError(f"upstream did not start: {line!r}")
        self.url = line.split(" ", 1)[1]

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1].split("/", 1)[0])

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def key_file(tmp_path: Path) -> str:
    """A deployment key (security.key_file) for proxies of one test: they share it, as replicas or restarts do."""
    path = tmp_path / "deployment.key"
    if not path.exists():
        path.write_text(os.urandom(32).hex())
    return str(path)


def proxy_config(upstream_url: str, tmp_path: Path, **sections: dict[str, Any]) -> Config:
    # Each proxy gets its own database unless the test names one (a file serves one proxy at a time).
    database = tmp_path / "tasks.db"
    number = 1
    while database.exists():
        number += 1
        database = tmp_path / f"tasks-{number}.db"
    overrides: dict[str, dict[str, Any]] = {
        "upstream": {"url": upstream_url, "call_timeout_seconds": 30},
        "store": {"path": str(database), "synchronous": "normal"},
        "logging": {"level": "warning"},
    }
    for name, values in sections.items():
        overrides.setdefault(name, {}).update(values)
    return load_config(None, environ={}, overrides=overrides)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class ProxyProcess:
    """`python -m proxy serve` with a config file; stderr (the JSON log) goes to a file."""

    def __init__(self, tmp_path: Path, upstream_url: str, **sections: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self.log = tmp_path / f"proxy-{self.port}.log"
        self.config = tmp_path / f"proxy-{self.port}.yaml"
        config: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": self.port},
            "upstream": {"url": upstream_url},
            "store": {"path": str(tmp_path / "ops.db"), "synchronous": "normal"},
            "logging": {"level": "info", "format": "json"},
        }
        for name, values in sections.items():
            config.setdefault(name, {}).update(values)
        self.config.write_text(yaml.safe_dump(config))
        self.process: subprocess.Popen[bytes] | None = None
        self.preexec: Callable[[], None] | None = None  # run in the child before the proxy starts (its rlimits)

    def _spawn(self) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(self.config)],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("wb"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            preexec_fn=self.preexec,
        )

    async def start(self) -> None:
        process = self.process = await asyncio.to_thread(self._spawn)
        async with aiohttp.ClientSession() as http:

            async def healthy() -> bool:
                assert process.poll() is None, self.log.read_text()
                try:
                    async with http.get(f"http://127.0.0.1:{self.port}/healthz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await until(healthy, "the proxy did not start", 20)

    async def terminate(self) -> int:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        return await asyncio.to_thread(self.process.wait, 60)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.log.read_text().splitlines() if line.startswith("{")]


def children() -> set[int]:
    """Direct children of this test process (the proxy runs in it, so its server processes are among them)."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            found.update(int(pid) for pid in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


# --- the fixture as a stdio server ------------------------------------------------------------------------------


def stdio_upstream(command: list[str] | None = None, **fields: Any) -> dict[str, Any]:
    """The `upstream` config section for a stdio server (the fixture by default), run from the repository root;
    its start imports the mcp SDK, slow on a busy 2-core machine, hence the generous start timeout (and wait for
    a process at `max_processes`)."""
    timeouts = {"start_timeout_seconds": 20, "connect_timeout_seconds": 20}
    return {"url": None, "command": command or STDIO_FIXTURE, "cwd": str(ROOT), **timeouts, **fields}


def stdio_sessions(client: Tasks) -> list[StdioSession]:
    """The stdio server processes of the proxy behind `client`."""
    sessions = client.client.app[POOL].sessions()
    assert all(isinstance(session, StdioSession) for session in sessions)
    return [session for session in sessions if isinstance(session, StdioSession)]
