"""What every process of one stdio server command shares: the link of the stdio kind.

`StdioLink` starts the processes (argv, environment, working directory and limits from `upstream.*`), keeps the
crash backoff (a server that keeps crashing is not started again before its time: requests get a 503 saying
when), request ids, background work, and what the server said most recently (serverInfo; when a process last
wrote, for readiness). Imports the process layer and the rates; never a session, aiohttp, the store or tasks.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from proxy.config import StdioUpstreamConfig
from proxy.errors import UpstreamUnreachableError
from proxy.observability import Metrics
from proxy.upstream.link import LinkBase
from proxy.upstream.stdio.process import ProcessExit, SizeLimit, StdioProcess, child_environment
from proxy.upstream.stdio.rates import Backoff


class StdioLink(LinkBase):
    """What every process of one server command shares: the command and its environment, request ids,
    the crash backoff, background work, and what the server said most recently."""

    def __init__(
        self,
        config: StdioUpstreamConfig,
        metrics: Metrics | None = None,
        environ: Mapping[str, str] = os.environ,
        max_result_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.metrics = metrics
        self.max_result_bytes = max_result_bytes  # a longer message is refused (the line is read: max_line_bytes)
        self.env = child_environment(config.env, environ)
        self.program = Path(config.command[0]).name
        self.backoff = Backoff()
        self.retry_at = 0.0  # monotonic: while crashing, no process is started before this
        self._ids = itertools.count(1)
        self._numbers = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    async def start(
        self,
        on_message: Callable[[dict[str, Any]], None],
        on_exit: Callable[[ProcessExit], None],
        on_oversized: Callable[[dict[str, Any]], None] | None = None,
    ) -> StdioProcess:
        """A new server process, unless the server keeps crashing (then a 503 saying when it is retried).
        Messages over `max_result_bytes` go to `on_oversized` when given."""
        wait = self.retry_at - time.monotonic()
        if wait > 0:
            raise UpstreamUnreachableError(
                f"Upstream stdio server {self.program} keeps crashing ({self.backoff.crashes} times in a row); "
                f"it is started again in {wait:.1f} s",
                http_status=503,
            )
        config = self.config
        return await StdioProcess.start(
            config.command,
            self.env,
            config.cwd,
            max_line_bytes=config.max_line_bytes,
            on_message=on_message,
            on_exit=on_exit,
            name=f"{self.program}#{next(self._numbers)}",
            stop_grace_seconds=config.stop_grace_seconds,
            oversized=(
                None
                if on_oversized is None or self.max_result_bytes is None
                else SizeLimit(self.max_result_bytes, on_oversized)
            ),
        )

    def crashed(self, lived_seconds: float) -> None:
        """A process ended without the proxy asking (or never became a session). The first is restarted at
        once; each further quick one waits longer (`Backoff`)."""
        delay = self.backoff.crashed(lived_seconds)
        if self.backoff.crashes > 1:
            self.retry_at = time.monotonic() + delay

    def answered(self) -> None:
        self.last_answer_at = time.monotonic()
