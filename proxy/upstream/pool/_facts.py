"""What a call needs to know before it starts (the InitializeResult, a tool's annotations and task support):
from what the kind knows when any caller's answer may serve, else each caller's own. Imports the session protocol."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from proxy.principals import Identity
from proxy.upstream.session import Session, SessionKind, ToolCatalog, read_tools
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader
from proxy.wire.jsonrpc import JSON


@dataclass(frozen=True, slots=True)
class ToolFacts:
    """What the front needs to know of a tool before its call starts (`ToolFactsReader.tool_facts`)."""

    initialize_result: JSON
    param_headers: tuple[ParamHeader, ...]
    task_support: legacy_tasks.TaskSupport | None  # how the upstream runs it as its own task, or None


class ToolFactsReader:
    """From what the kind already knows when any caller's answer may serve (an upstream that needs no credentials);
    else each caller's own, read through its shared session and kept while that session is (a server may show each
    caller other tools). Imports the session protocol and the catalog; the pool hands it its `use`."""

    def __init__(
        self,
        kind: SessionKind,
        use: Callable[[Identity | None], AbstractAsyncContextManager[Session]],
        is_shared: Callable[[str, Session], bool],
    ) -> None:
        self.kind = kind
        self._use = use  # the principal's shared session, from the pool
        self._is_shared = is_shared  # is this (still) the principal's shared session?
        self._catalogs: dict[str, ToolCatalog] = {}  # principal key → its own tools (kept with its shared session)

    def forget(self, key: str) -> None:
        """The principal's shared session closed: its own catalog goes with it."""
        self._catalogs.pop(key, None)

    def clear(self) -> None:
        self._catalogs.clear()

    async def initialize_result(self, principal: Identity | None, max_age_ms: int) -> JSON:
        """The upstream's InitializeResult: the latest one any session got, when it is at most `max_age_ms` old
        (server/discover opens no session per caller), else from the caller's shared session. When the upstream
        requires credentials (`kind.auth`), always the caller's own: a caller the upstream refuses gets its
        refusal, never what another caller's session learned."""
        if await self.kind.auth.shared():
            recent = self.kind.learned.recent_initialize(max_age_ms)
            if recent is not None:
                return recent
        async with self._use(principal) as session:
            return await session.ensure_initialized()

    async def tool_facts(self, principal: Identity | None, tool: str, max_age_ms: int) -> ToolFacts:
        """What a call of `tool` needs before it starts, in one turn: the InitializeResult (at most `max_age_ms`
        old), the tool's `x-mcp-header` annotations and how the upstream runs it as its own task. From what the
        kind already knows; the caller's shared session is used (once) only for what it does not. When the
        upstream requires credentials (`kind.auth`), all through the caller's shared session, initialized first,
        and from the caller's own tool catalog: the upstream has accepted this caller's credential before
        anything learned from it answers, and what it showed another caller never does."""
        if not await self.kind.auth.shared():
            return await self._own_tool_facts(principal, tool)
        initialize_result = self.kind.learned.recent_initialize(max_age_ms)
        headers = self.kind.learned.known_headers(tool)
        latest = self.kind.learned.initialize_result  # does the upstream run tool tasks at all? (any age will do)
        runs_tasks = latest is not None and legacy_tasks.runs_tool_tasks(latest)
        support_known = latest is not None and (headers is not None or not runs_tasks)
        support: legacy_tasks.TaskSupport | None = None
        if support_known and runs_tasks:
            known = self.kind.learned.catalog.task_support.get(tool)
            support = known if known in ("optional", "required") else None
        if initialize_result is None or headers is None or not support_known:
            async with self._use(principal) as session:
                if initialize_result is None:
                    initialize_result = await session.ensure_initialized()
                if headers is None:
                    headers = await session.param_headers(tool)
                if not support_known:
                    support = await session.task_support(tool)
        return ToolFacts(initialize_result, headers, support)

    async def _own_tool_facts(self, principal: Identity | None, tool: str) -> ToolFacts:
        """`tool_facts` when the upstream requires credentials: the caller's own InitializeResult and tool catalog
        (a server may show each caller other tools, with other annotations), read through its shared session and
        kept while that session is."""
        key = self.kind.credentials.session_key(principal)
        async with self._use(principal) as session:
            initialize_result = await session.ensure_initialized()
            catalog = self._catalogs.get(key) or ToolCatalog()
            generation = self.kind.learned.tools_generation
            headers = catalog.known_headers(tool, generation)
            if headers is None:
                catalog.read(*await read_tools(session), generation)
                headers = catalog.known_headers(tool, generation) or ()
            if self._is_shared(key, session):  # not closed meanwhile: the catalog lives as long as it does
                self._catalogs[key] = catalog
        support: legacy_tasks.TaskSupport | None = None
        if legacy_tasks.runs_tool_tasks(initialize_result):
            known = catalog.task_support.get(tool)
            support = known if known in ("optional", "required") else None
        return ToolFacts(initialize_result, headers, support)
