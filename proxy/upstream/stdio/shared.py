"""What every process of one stdio server command shares: the shared state of the stdio kind.

`StdioShared` starts the processes (argv, environment, working directory and limits from `upstream.*`), keeps
the crash backoff (a server that keeps crashing is not started again before its time: requests get a 503 saying
when), request ids, background work, and what the server said most recently (serverInfo; when a process last
wrote, for readiness). Imports the process layer and the rates; never a session, aiohttp, the store or tasks.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, Final, TypeVar

import structlog

from proxy.config.schema import StdioUpstreamConfig
from proxy.errors import UpstreamUnreachableError
from proxy.observe.metrics import Metrics
from proxy.upstream.shared import SharedBase
from proxy.upstream.stdio.process import ProcessExit, SizeLimit, StdioProcess, child_environment
from proxy.upstream.stdio.rates import Backoff

log = structlog.get_logger(__name__)
T = TypeVar("T")

CRASHING: Final = "keeps crashing"
STILL_STARTING_EVERY_SECONDS: Final = 10.0  # a start still waiting for `initialize` is logged this often


def not_initialized(timeout_seconds: float) -> str:
    return f"did not answer initialize within {timeout_seconds:g} s"


class StdioShared(SharedBase):
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
        self.failure = CRASHING  # how the latest processes failed, as the backoff's 503 says it
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
            # Rounded up: a wait is never said to be "0.0 s".
            raise UpstreamUnreachableError(
                f"Upstream stdio server {self.program} {self.failure} ({self.backoff.crashes} times in a row); "
                f"it is started again in {math.ceil(wait * 10) / 10:.1f} s",
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

    def crashed(self, lived_seconds: float, failure: str = CRASHING) -> None:
        """A process ended without the proxy asking (or never became a session: `failure` says how, for the
        503 of the backoff). The first is restarted at once; each further quick one waits longer (`Backoff`)."""
        self.failure = failure
        delay = self.backoff.crashed(lived_seconds)
        if self.backoff.crashes > 1:
            self.retry_at = time.monotonic() + delay

    def answered(self) -> None:
        self.last_answer_at = time.monotonic()

    async def initialized_within(self, initialize: Awaitable[T], name: str) -> T:
        """`initialize` awaited for at most `upstream.start_timeout_seconds` (then TimeoutError). A slow start
        is said to be one: `upstream_process_still_starting` is logged every STILL_STARTING_EVERY_SECONDS (a
        quarter of the timeout when that is shorter) until the server answers."""
        timeout = self.config.start_timeout_seconds
        every = min(STILL_STARTING_EVERY_SECONDS, timeout / 4)

        loop = asyncio.get_running_loop()
        started = loop.time()
        timer: asyncio.TimerHandle | None = None

        def still_starting() -> None:
            nonlocal timer
            seconds = round(loop.time() - started, 1)
            log.info("upstream_process_still_starting", upstream=name, seconds=seconds, start_timeout_seconds=timeout)
            timer = loop.call_later(every, still_starting)

        timer = loop.call_later(every, still_starting)
        try:
            return await asyncio.wait_for(initialize, timeout)
        finally:
            timer.cancel()
