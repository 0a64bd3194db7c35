"""A command run on a pseudo-terminal, driven as a person at it would: wait for what it shows, type a line, press
Ctrl-C (SIGINT, what the terminal sends). Its stdin, stdout and stderr are all the terminal, so the command sees a
person there (progress display, questions). And the command run without one (pipes), for comparison. Imports
nothing of the proxy."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.support.waiting import until

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")  # colours, cursor moves, titles


def client_argv(*words: str) -> list[str]:
    """`mcp-tasks-proxy WORDS…` as this checkout runs it."""
    return [sys.executable, "-m", "proxy", *words]


class Terminal:
    """`argv` on a new pseudo-terminal of 200 columns."""

    def __init__(self, argv: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None) -> None:
        master, child = pty.openpty()
        os.set_blocking(master, False)
        self._master = master
        self._raw = b""
        self.process = subprocess.Popen(
            list(argv),
            stdin=child,
            stdout=child,
            stderr=child,
            cwd=cwd,
            env={**os.environ, "COLUMNS": "200", "TERM": "xterm", **(env or {})},
            close_fds=True,
        )
        os.close(child)

    @property
    def text(self) -> str:
        """Everything shown so far, without colours and cursor moves."""
        self._read()
        return ANSI.sub("", self._raw.decode("utf-8", errors="replace")).replace("\r", "")

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except (BlockingIOError, OSError):  # nothing now, or the command ended and closed its side
                return
            if not chunk:
                return
            self._raw += chunk

    async def shows(self, text: str, timeout_seconds: float = 30) -> None:
        await until(
            lambda: text in self.text, lambda: f"the terminal never showed {text!r}:\n{self.text}", timeout_seconds
        )

    def type(self, line: str) -> None:
        os.write(self._master, line.encode() + b"\n")

    def interrupt(self) -> None:
        self.process.send_signal(signal.SIGINT)

    async def exit_code(self, timeout_seconds: float = 30) -> int:
        await until(lambda: self.process.poll() is not None, lambda: f"still running:\n{self.text}", timeout_seconds)
        self._read()
        return int(self.process.returncode)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self._master)


def run_piped(argv: Sequence[str], cwd: Path, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`argv` with pipes for stdin, stdout and stderr: no person at it."""
    return subprocess.run(
        list(argv),
        cwd=cwd,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
