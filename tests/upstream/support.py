"""Shared plumbing for the legacy fixture tools: the typed ``Ctx`` alias, imperative helpers
(elicit with a raw schema, sample, roots/list, level-filtered logging) that keep server->client
traffic on the calling request's stream, and the module-level records tests introspect
(cancelled request ids, resource subscriptions, per-session log level).
"""

from __future__ import annotations

import weakref
from typing import Any

from mcp import types
from mcp.server.fastmcp import Context
from mcp.server.session import ServerSession
from mcp.shared.message import ServerMessageMetadata
from starlette.requests import Request

Ctx = Context[ServerSession, object, Request]
"""The context type every fixture tool/prompt annotates (FastMCP injects it by annotation)."""

JsonSchema = dict[str, Any]

_LEVEL_ORDER: tuple[types.LoggingLevel, ...] = (
    "debug",
    "info",
    "notice",
    "warning",
    "error",
    "critical",
    "alert",
    "emergency",
)

CANCELLED_REQUEST_IDS: list[types.RequestId] = []
"""Request ids whose tools/call was cancelled by a client ``notifications/cancelled``."""

CALL_COUNTS: dict[str, int] = {}
"""How many times the ``counted`` tool ran, per key."""

CALLS_STARTED: dict[str, int] = {}
"""How many calls of ``sleep`` and ``counted`` this server has started, per tool (tests wait on it for a call to
be running upstream)."""


HELD: dict[str, int] = {"now": 0, "most": 0}
"""The ``held`` calls running now, and the most that ever ran at once (``held_at_once`` reads and resets it)."""


def call_started(tool: str) -> None:
    """Count one more call of ``tool`` started."""
    CALLS_STARTED[tool] = CALLS_STARTED.get(tool, 0) + 1


_log_levels: weakref.WeakKeyDictionary[ServerSession, types.LoggingLevel] = weakref.WeakKeyDictionary()
_subscriptions: weakref.WeakKeyDictionary[ServerSession, set[str]] = weakref.WeakKeyDictionary()


def text_result(text: str, *, is_error: bool = False) -> types.CallToolResult:
    """A tools/call result holding one text block."""
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)], isError=is_error)


def record_cancelled(request_id: types.RequestId) -> None:
    """Remember that the client cancelled ``request_id``."""
    CANCELLED_REQUEST_IDS.append(request_id)


def set_log_level(session: ServerSession, level: types.LoggingLevel) -> None:
    """Store the minimum level set by ``logging/setLevel`` for ``session``."""
    _log_levels[session] = level


def subscribe(session: ServerSession, uri: str) -> None:
    """Record a ``resources/subscribe`` of ``uri`` by ``session``."""
    _subscriptions.setdefault(session, set()).add(uri)


def unsubscribe(session: ServerSession, uri: str) -> None:
    """Forget a subscription (unknown ones are ignored, as the spec allows)."""
    _subscriptions.get(session, set()).discard(uri)


def subscribers(uri: str) -> list[ServerSession]:
    """Sessions currently subscribed to ``uri``."""
    return [session for session, uris in list(_subscriptions.items()) if uri in uris]


async def log(ctx: Ctx, level: types.LoggingLevel, message: str, *, logger: str | None = None) -> None:
    """Send ``notifications/message`` on the request's stream unless below the session's level."""
    session = ctx.request_context.session
    minimum = _log_levels.get(session, "debug")
    if _LEVEL_ORDER.index(level) < _LEVEL_ORDER.index(minimum):
        return
    await session.send_log_message(
        level=level, data=message, logger=logger, related_request_id=ctx.request_context.request_id
    )


async def elicit(ctx: Ctx, message: str, schema: JsonSchema) -> types.ElicitResult:
    """``elicitation/create`` (form mode) with a raw JSON schema, related to the current request."""
    return await ctx.request_context.session.elicit_form(
        message, schema, related_request_id=ctx.request_context.request_id
    )


async def sample(ctx: Ctx, prompt: str, *, max_tokens: int = 100) -> str:
    """``sampling/createMessage`` with one user text message; returns the model's text."""
    result = await ctx.request_context.session.create_message(
        messages=[types.SamplingMessage(role="user", content=types.TextContent(type="text", text=prompt))],
        max_tokens=max_tokens,
        related_request_id=ctx.request_context.request_id,
    )
    content = result.content
    return content.text if isinstance(content, types.TextContent) else f"<{content.type} content>"


async def list_roots(ctx: Ctx) -> list[types.Root]:
    """``roots/list`` sent on the current request's stream.

    ``ServerSession.list_roots()`` takes no related request id, so on Streamable HTTP it would go
    to the standalone GET stream; sending it explicitly keeps it on the tools/call stream.
    """
    result = await ctx.request_context.session.send_request(
        types.ServerRequest(types.ListRootsRequest(method="roots/list")),
        types.ListRootsResult,
        metadata=ServerMessageMetadata(related_request_id=ctx.request_context.request_id),
    )
    return result.roots


def client_supports(ctx: Ctx, capability: types.ClientCapabilities) -> bool:
    """Whether the client declared ``capability`` at initialize."""
    return ctx.request_context.session.check_client_capability(capability)


def content_str(result: types.ElicitResult, field: str, default: str = "unknown") -> str:
    """A string field of an accepted elicitation, or ``default``."""
    if result.action != "accept" or result.content is None:
        return default
    value = result.content.get(field)
    return value if isinstance(value, str) else default
