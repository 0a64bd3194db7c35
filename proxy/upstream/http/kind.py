"""The Streamable HTTP kind of upstream session for the pool: sessions are cheap, so every call whose client
could answer a question gets one of its own and idle ones are kept up to `upstream.max_sessions`; readiness
starts a throwaway session when the upstream has been quiet; whether the upstream requires credentials is
found out with an anonymous `initialize` (`upstream/auth.py`). Imports the HTTP shared state and session; never the
pool, nor the servers legacy clients get (`legacy/serving.py` picks one).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Final

import aiohttp

from proxy.config.schema import HttpUpstreamConfig
from proxy.errors import UpstreamAuthError, UpstreamError, UpstreamTimeoutError
from proxy.observe.metrics import Metrics
from proxy.principals import Identity
from proxy.upstream.auth import AuthMode, UpstreamAuth
from proxy.upstream.http.session import HttpSession
from proxy.upstream.http.shared import HttpShared
from proxy.upstream.session import PoolLimits, Session

PROBE_TIMEOUT_SECONDS: Final = 2.0  # a readiness probe's initialize; kubelet's own timeout is short too


class HttpKind(HttpShared):
    """Makes HTTP sessions and says how the pool bounds them."""

    def __init__(
        self,
        config: HttpUpstreamConfig,
        http: aiohttp.ClientSession,
        principal_header: str,
        metrics: Metrics | None,
        max_result_bytes: int | None = None,
        auth_mode: AuthMode = "detect",
    ) -> None:
        super().__init__(config, http, principal_header, metrics, max_result_bytes)
        self.auth = UpstreamAuth(auth_mode, self._anonymous_initialize)
        # A call whose client could answer a question gets a session of its own (its GET stream is the call's);
        # the others share the principal's session, so a thousand quiet tasks are not a thousand sessions.
        self.limits = PoolLimits(max_idle=config.max_sessions, share_quiet_calls=True)
        self._probe_lock = asyncio.Lock()

    def new(self, principal: Identity | None) -> Session:
        return HttpSession(self, principal)

    async def _anonymous_initialize(self) -> None:
        """One `initialize` without any caller's credential, on a throwaway session: does the upstream need one?"""
        session = HttpSession(self, None)
        try:
            await asyncio.wait_for(session.initialize(listen=False), PROBE_TIMEOUT_SECONDS)
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"Upstream did not answer initialize within {PROBE_TIMEOUT_SECONDS:g} s"
            ) from None
        finally:
            await session.close()

    async def probe(self, max_age_seconds: float, shared: Callable[[], AbstractAsyncContextManager[Session]]) -> None:
        """Readiness: fine when the upstream answered within `max_age_seconds`; otherwise a fresh `initialize`
        on a throwaway session (ended with DELETE) must succeed within PROBE_TIMEOUT_SECONDS, or be refused for
        want of a credential (the upstream is there; it requires auth). Raises UpstreamError saying what failed.
        Concurrent probes share one attempt."""
        async with self._probe_lock:
            last = self.last_answer_at
            if last is not None and time.monotonic() - last <= max_age_seconds:
                return
            try:
                await self._anonymous_initialize()
            except UpstreamAuthError:  # it answered: it wants a credential the probe lacks
                return
            except UpstreamError as exc:  # readiness names where it asked (the path, never the query)
                raise UpstreamError(f"{exc.message} (initialize at {self.url.path})", detail=exc.detail) from None
