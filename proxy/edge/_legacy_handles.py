"""The legacy front's reading of `tools/list` and `tools/call` while some policy says `handle`: a list is relayed
with its answer rewritten (`front/handles/tools.py`); a call of a task tool or a `handle` tool is served on the
proxy's own upstream sessions and answered on the client's POST; anything else is relayed as it came. Imports
the edge's answer stream, the handles and the legacy fronts' protocol.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import structlog
from aiohttp import web

from proxy.config.schema import Config
from proxy.edge._error_edge import CHANNEL, RPC_ID, HttpChannel
from proxy.edge._jwt_identity import JwtIdentity, caller_identity
from proxy.errors import DrainingError, ParseError, RequestId
from proxy.front.handles import tools
from proxy.front.handles.service import Handles
from proxy.legacy import LegacyFront
from proxy.observe.tracing import ServerSpan
from proxy.policy import decide
from proxy.tasks.live_call import UpstreamRequest
from proxy.upstream.pool import SessionPool
from proxy.wire import jsonrpc
from proxy.wire.envelope import Caller, ModernRequest
from proxy.wire.jsonrpc import JSON

log = structlog.get_logger(__name__)

Serve = Callable[[ServerSpan], Awaitable[web.StreamResponse]]
NOT_READ: Final = object()  # a legacy body nothing has read as JSON yet
LEGACY_VERSION: Final = "2025-11-25"  # what a legacy request without the version header is taken to speak
VERSION_HEADER: Final = "MCP-Protocol-Version"


@dataclass(eq=False, slots=True)
class LegacyHandles:
    handles: Handles
    front: LegacyFront  # the pass-through, or the stdio front: what relays everything else
    pool: SessionPool
    jwt: JwtIdentity | None
    draining: Callable[[], bool]  # a draining replica starts no new call (its client goes to another replica)
    # What a fresh call passes before it starts, as a modern one does (`Front.admit_legacy_call`): the descriptor
    # budget, the caller's quotas, the upstream session cap.
    admit: Callable[[ModernRequest, Caller, UpstreamRequest, Config], Awaitable[None]]

    def serve(self, request: web.Request, body: bytes, message: Any, config: Config) -> Serve | None:
        """What serves this legacy POST when the handles read it; None: relayed as it came. `message` is the
        body as read, or NOT_READ: then it is read only when its bytes may name a tool the handles serve;
        `config` is the config in force as the edge read it for this request."""
        serving = tools.served(config.tasks, config.handles.tool_prefix)
        if message is NOT_READ:
            if not tools.may_concern(body, serving):
                return None
            try:
                message = jsonrpc.loads(body)
            except ParseError:
                return None
        if type(message) is not dict or "id" not in message:
            return None
        method, params = message.get("method"), message.get("params")
        if method == "tools/list":
            rewrite = self._listed(message["id"], config)
            return lambda span: self._relayed(span, request, body, rewrite, config)
        if method != "tools/call" or not isinstance(params, dict) or not serving.may_serve(params.get("name")):
            return None
        request_id, name = message["id"], params.get("name")
        base = tools.names(config.handles.tool_prefix).base_of(name)
        if base is not None:
            return lambda span: self._tool(request, request_id, base, params, config)
        if isinstance(name, str) and tools.handles(config.tasks, name):
            return lambda span: self._call(request, body, request_id, name, params, config)
        return None

    def _listed(self, request_id: RequestId, config: Config) -> Callable[[JSON], JSON]:
        names = tools.names(config.handles.tool_prefix)

        def rewrite(message: JSON) -> JSON:
            result = message.get("result")
            if message.get("id") != request_id or not isinstance(result, dict):
                return message
            listed, clashes = tools.listed(result, config.tasks, names, config.handles.hold_ms)
            if clashes:
                log.warning("task_tool_name_taken", tools=clashes, detail="the upstream lists a tool of that name")
            return {**message, "result": listed}

        return rewrite

    async def _relayed(
        self, span: ServerSpan, request: web.Request, body: bytes, rewrite: Callable[[JSON], JSON], config: Config
    ) -> web.StreamResponse:
        response = await self._relay(request, body, config, rewrite)
        span.status(response.status)
        return response

    async def _relay(
        self,
        request: web.Request,
        body: bytes,
        config: Config,
        rewrite: Callable[[JSON], JSON] | None = None,
        tool: str | None = None,
    ) -> web.StreamResponse:
        """Relayed by the legacy front; where the proxy makes the upstream credential (`upstream.credentials`),
        for the verified caller."""
        if config.upstream.credentials.forwards:
            return await self.front.relay(request, body, rewrite)
        identity = await caller_identity(request.headers, config, self.jwt)
        return await self.front.relay(request, body, rewrite, identity=identity, tool=tool)

    async def _caller(self, request: web.Request, request_id: RequestId, config: Config) -> tuple[Caller, HttpChannel]:
        """Who calls (the principal as for every call, in either era) and the answer's stream; from here on an
        error answers with the request's id."""
        request[RPC_ID] = request_id
        principal = await caller_identity(request.headers, config, self.jwt)
        channel = request[CHANNEL] = HttpChannel(request, config.limits.write_timeout_seconds)
        return Caller(principal=principal, headers=request.headers), channel

    async def _tool(
        self, request: web.Request, request_id: RequestId, base: str, params: JSON, config: Config
    ) -> web.StreamResponse:
        caller, channel = await self._caller(request, request_id, config)
        meta = params.get("_meta")
        token = meta.get("progressToken") if isinstance(meta, dict) else None
        progress_token = token if isinstance(token, str | int) and not isinstance(token, bool) else None
        answer = await self.handles.tool(
            request_id, base, params.get("arguments"), caller, channel, progress_token, None, config, modern=False
        )
        return await channel.finish(answer)

    async def _call(
        self, request: web.Request, body: bytes, request_id: RequestId, name: str, params: JSON, config: Config
    ) -> web.StreamResponse:
        """A `handle` tool's call, run as a call of the proxy's own (a task once the hold is over)."""
        arrived = time.monotonic()
        if self.draining():
            raise DrainingError(request_id=request_id)
        caller, channel = await self._caller(request, request_id, config)
        meta = params.get("_meta")
        version = request.headers.get(VERSION_HEADER, LEGACY_VERSION)
        legacy = ModernRequest(request_id, "tools/call", params, meta if isinstance(meta, dict) else {}, version, {})
        outgoing = UpstreamRequest.of(legacy, caller)
        facts = await self.pool.facts.tool_facts(caller.principal, name, config.discovery.cache_ttl_ms)
        decision = decide(
            config.tasks,
            name,
            declares_tasks=False,
            upstream_support=facts.task_support,
            hold_ms=config.handles.hold_ms,
        )
        if not decision.handle:  # (the upstream's own task support can change what the policy said)
            del request[RPC_ID], request[CHANNEL]
            return await self._relay(request, body, config, tool=name)
        await self.admit(legacy, caller, outgoing, config)
        answer = await self.handles.call(
            outgoing, caller, channel, decision, None, config, modern=False, arrived=arrived
        )
        return await channel.finish(answer)
