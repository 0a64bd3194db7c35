"""The stdio kind of upstream session for the pool: one server process is one session, and processes are
costly, so they are bounded by `upstream.max_processes`, idle ones stopped after
`upstream.process_idle_seconds`, and calls that cannot ask share one. Readiness asks the shared process for a
`ping`. Imports the stdio shared state and session; never the pool, aiohttp, the store, tasks or the servers
legacy clients get (`legacy/serving.py` picks one).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager

from proxy.config.schema import StdioUpstreamConfig
from proxy.errors import UpstreamTimeoutError
from proxy.observe.metrics import Metrics
from proxy.principals import Identity
from proxy.upstream.session import PoolLimits, Session
from proxy.upstream.stdio.session import StdioSession
from proxy.upstream.stdio.shared import StdioShared


class StdioKind(StdioShared):
    """Makes stdio sessions (one process each) and says how the pool bounds them."""

    def __init__(
        self,
        config: StdioUpstreamConfig,
        metrics: Metrics | None = None,
        environ: Mapping[str, str] = os.environ,
        max_result_bytes: int | None = None,
        principal_header: str = "authorization",
        legacy_replay_bytes: int = 0,
    ) -> None:
        super().__init__(config, metrics, environ, max_result_bytes)
        self.principal_header = principal_header  # binds a legacy client's session to the caller that opened it
        self.legacy_replay_bytes = legacy_replay_bytes  # what a legacy client's session keeps for a resume
        self.limits = PoolLimits(
            max_idle=config.max_processes,
            max_open=config.max_processes,
            idle_seconds=config.process_idle_seconds,
            share_quiet_calls=True,
            wait_seconds=config.connect_timeout_seconds,
            limit_name="upstream.max_processes",
        )
        self._probe_lock = asyncio.Lock()

    def new(self, principal: Identity | None) -> Session:
        return StdioSession(self, principal)

    async def probe(self, max_age_seconds: float, shared: Callable[[], AbstractAsyncContextManager[Session]]) -> None:
        """Readiness: fine when a process spoke within `max_age_seconds`; otherwise the anonymous shared
        process (started if need be) must answer `ping` within `upstream.connect_timeout_seconds`."""
        async with self._probe_lock:
            last = self.last_answer_at
            if last is not None and time.monotonic() - last <= max_age_seconds:
                return
            timeout = self.config.connect_timeout_seconds
            async with shared() as session:
                try:
                    await asyncio.wait_for(session.request("ping", None), timeout)
                except TimeoutError:
                    raise UpstreamTimeoutError(
                        f"Upstream stdio server {self.program} did not answer ping within {timeout:g} s"
                    ) from None
