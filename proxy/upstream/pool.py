"""The proxy's own upstream sessions (not the pass-through of legacy clients): which session serves a request.

- `use(principal)`: the principal's shared session, for requests that cannot ask the client anything (lists,
  discover, completion, listen streams). A legacy server may bind a session to a token, so sessions are never
  shared between principals.
- `lease(principal, sink)`: a session of the principal that nothing else uses while the lease lasts, for a
  call that may ask the client something (`tools/call`, `prompts/get`, `resources/read`). The upstream may
  send that question on the session's GET stream (naming no request); on a leased session it can only be the
  lessee's, so it goes to `sink`.
- `adopt(principal, session_id, sink)`: the same, on a session an earlier proxy process initialized (it holds a
  task the upstream runs itself, resumed after a restart): no `initialize`.
- `keep(session)`: a session whose upstream work outlives this process is let go without DELETE.

List changes and resource updates seen on a lent session reach the principal's listen streams too. Sessions
nobody uses are kept for reuse, least recently used first out: beyond `upstream.max_sessions` idle
sessions, the oldest is ended with DELETE. Sessions in use are bounded by the call limits instead. Imports the
session module; the sessions know nothing of the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import aiohttp
import structlog

from proxy.config import UpstreamConfig
from proxy.errors import UpstreamTimeoutError
from proxy.observability import Metrics
from proxy.upstream.events import UpstreamNotification
from proxy.upstream.session import Sink, UpstreamLink, UpstreamSession, principal_key
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

PROBE_TIMEOUT_SECONDS: Final = 2.0  # a readiness probe's initialize; kubelet's own timeout is short too


class UpstreamClient:
    def __init__(
        self,
        config: UpstreamConfig,
        http: aiohttp.ClientSession,
        principal_header: str,
        metrics: Metrics | None = None,
        max_result_bytes: int | None = None,
    ) -> None:
        self.link = UpstreamLink(config, http, principal_header, metrics, max_result_bytes)
        self.max_idle = config.max_sessions
        self._shared: dict[str, UpstreamSession] = {}  # principal key → its shared session
        self._spare: dict[str, list[UpstreamSession]] = {}  # principal key → idle sessions to lease
        self._users: dict[UpstreamSession, int] = {}
        self._idle: OrderedDict[UpstreamSession, str] = OrderedDict()  # idle session → its principal key, oldest first
        self._probe_lock = asyncio.Lock()

    @property
    def server_info(self) -> JSON | None:
        """The upstream's serverInfo from the latest initialize (on any session)."""
        return self.link.server_info

    # --- handing sessions out ----------------------------------------------------------------------------

    def session(self, principal: str | None) -> UpstreamSession:
        """The principal's shared session (created on first use). Prefer `use()`, which keeps it from being
        evicted while in use."""
        key = principal_key(principal)
        session = self._shared.get(key)
        if session is None:
            session = self._shared[key] = UpstreamSession(self.link, principal)
            self._idle[session] = key
            self._evict()
        return session

    @asynccontextmanager
    async def use(self, principal: str | None) -> AsyncIterator[UpstreamSession]:
        session = self.session(principal)
        self._take(session)
        try:
            yield session
        finally:
            self._release(session, principal_key(principal))

    @asynccontextmanager
    async def lease(self, principal: str | None, sink: Sink, *, asks: bool = True) -> AsyncIterator[UpstreamSession]:
        """A session of the principal for one call alone, initialized (its GET stream open) before it is
        handed out; its GET-stream traffic goes to `sink` until the lease ends. `asks`: the call's client could
        answer a question. HTTP sessions are cheap, so every call gets one of its own regardless (then even a
        client that declared nothing is the one told what it lacks)."""
        key = principal_key(principal)
        spare = self._spare.get(key)
        session = spare.pop() if spare else UpstreamSession(self.link, principal)
        if spare is not None and not spare:
            del self._spare[key]
        async with self._lent(session, key):
            await session.ensure_initialized()
            session.lessee = sink
            yield session

    @asynccontextmanager
    async def adopt(self, principal: str | None, session_id: str | None, sink: Sink) -> AsyncIterator[UpstreamSession]:
        """A lease on the upstream session `session_id`, which an earlier proxy process initialized and left
        behind with a task the upstream still runs: taken over without `initialize`, its GET stream opened again.
        None (a stateless upstream, where any session serves): an ordinary lease."""
        if session_id is None:
            async with self.lease(principal, sink) as session:
                yield session
            return
        session = UpstreamSession(self.link, principal)
        async with self._lent(session, principal_key(principal)):
            await session.adopt(session_id)
            session.lessee = sink
            yield session

    @asynccontextmanager
    async def _lent(self, session: UpstreamSession, key: str) -> AsyncIterator[None]:
        session.on_notification = lambda notification: self._to_shared(key, notification)
        self._take(session)
        try:
            yield
        finally:
            session.lessee = None
            self._release(session, key, spare=True)

    def keep(self, session: UpstreamSession) -> None:
        """The session holds upstream work a later proxy process resumes (a task the upstream runs itself): when
        its use ends it is let go without DELETE, which would end that work."""
        session.kept = True

    def _to_shared(self, key: str, notification: UpstreamNotification) -> None:
        """A list change or resource update seen on a lent session reaches the principal's listen streams,
        which read its shared session."""
        shared = self._shared.get(key)
        if shared is not None:
            shared.deliver(notification)

    def _take(self, session: UpstreamSession) -> None:
        self._users[session] = self._users.get(session, 0) + 1
        self._idle.pop(session, None)

    def _release(self, session: UpstreamSession, key: str, *, spare: bool = False) -> None:
        users = self._users.get(session, 1) - 1
        if users > 0:
            self._users[session] = users
            return
        self._users.pop(session, None)
        if session.kept:
            session.detach()
            return
        if session.subscriptions:
            return  # a listen stream still reads it (it ends with its own use)
        if spare:
            if session.initialize_result is None:  # never initialized, or forgotten by the upstream
                self._close(session)
                return
            self._spare.setdefault(key, []).append(session)
        self._idle[session] = key
        self._evict()

    def _evict(self) -> None:
        """End the least recently used idle sessions beyond `upstream.max_sessions`."""
        while len(self._idle) > self.max_idle:
            session, key = self._idle.popitem(last=False)
            if self._shared.get(key) is session:
                del self._shared[key]
            spare = self._spare.get(key)
            if spare is not None and session in spare:
                spare.remove(session)
                if not spare:
                    del self._spare[key]
            self._close(session)

    def _close(self, session: UpstreamSession) -> None:
        self.link.spawn(session.close(), "upstream-session-close")

    def spare_sessions(self, principal: str | None) -> list[UpstreamSession]:
        """The principal's idle sessions waiting to be leased again, most recently returned last."""
        return list(self._spare.get(principal_key(principal), ()))

    @property
    def calls_in_flight(self) -> int:
        """Upstream requests open right now, on every session in use."""
        return sum(session.in_flight for session in self._users)

    @property
    def idle_sessions(self) -> int:
        return len(self._idle)

    @property
    def open_sessions(self) -> int:
        """Sessions the pool holds: shared ones, leased ones and spare ones."""
        spare = sum(len(sessions) for sessions in self._spare.values())
        leased = sum(1 for session in self._users if session.lessee is not None)
        return len(self._shared) + spare + leased

    # --- what needs no session of the caller's own when a recent answer will do ---------------------------

    async def initialize_result(self, principal: str | None, max_age_ms: int) -> JSON:
        """The upstream's InitializeResult: the latest one any session got, when it is at most `max_age_ms` old
        (server/discover opens no session per caller), else from the caller's shared session."""
        recent = self.link.recent_initialize(max_age_ms)
        if recent is not None:
            return recent
        async with self.use(principal) as session:
            return await session.ensure_initialized()

    async def param_headers(self, principal: str | None, tool: str) -> tuple[ParamHeader, ...]:
        """The tool's `x-mcp-header` annotations, from the shared catalog; read through the caller's shared
        session only when the catalog cannot answer."""
        known = self.link.known_headers(tool)
        if known is not None:
            return known
        async with self.use(principal) as session:
            return await session.param_headers(tool)

    async def task_support(self, principal: str | None, tool: str) -> legacy_tasks.TaskSupport | None:
        """How the upstream runs `tool` as its own 2025-11-25 task, or None: from the shared catalog when the
        latest InitializeResult and the catalog can answer, else through the caller's shared session."""
        initialize_result = self.link.initialize_result
        if initialize_result is not None and not legacy_tasks.runs_tool_tasks(initialize_result):
            return None
        if initialize_result is not None and self.link.known_headers(tool) is not None:
            support = self.link.tool_task_support.get(tool)
            return support if support in ("optional", "required") else None
        async with self.use(principal) as session:
            return await session.task_support(tool)

    # --- readiness and shutdown ---------------------------------------------------------------------------

    async def probe(self, max_age_seconds: float) -> None:
        """Readiness: fine when the upstream answered within `max_age_seconds`; otherwise a fresh `initialize`
        on a throwaway session (ended with DELETE) must succeed within PROBE_TIMEOUT_SECONDS. Raises
        UpstreamError saying what failed. Concurrent probes share one attempt."""
        async with self._probe_lock:
            last = self.link.last_answer_at
            if last is not None and time.monotonic() - last <= max_age_seconds:
                return
            session = UpstreamSession(self.link, None)
            try:
                await asyncio.wait_for(session.initialize(listen=False), PROBE_TIMEOUT_SECONDS)
            except TimeoutError:
                raise UpstreamTimeoutError(
                    f"Upstream did not answer initialize within {PROBE_TIMEOUT_SECONDS:g} s"
                ) from None
            finally:
                await session.close()

    def end_subscriptions(self) -> None:
        """Shutdown: every listen stream ends with its graceful result."""
        for session in self._shared.values():
            session.end_subscriptions()

    async def close(self) -> None:
        sessions = {*self._shared.values(), *self._users, *self._idle}
        for spare in self._spare.values():
            sessions.update(spare)
        self._shared.clear()
        self._spare.clear()
        self._idle.clear()
        await asyncio.gather(*(session.close() for session in sessions), return_exceptions=True)
        await self.link.close()
