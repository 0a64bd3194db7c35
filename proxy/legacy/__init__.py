"""The servers the proxy runs for legacy (2025-06-18 / 2025-11-25) clients: the pass-through to an HTTP
upstream (`passthrough.py`) and the proxy's own Streamable HTTP server in front of a stdio upstream
(`_stdio_server.py`, a client's session with its process in `_stdio_sessions.py`, its SSE event store
for resumable streams in `_event_store.py`). Which one legacy clients get follows the upstream's kind (`serving.py`).
This package imports aiohttp's web side and the upstream pool's protocols; never tasks or the front.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web

from proxy.principals import Identity
from proxy.wire.jsonrpc import JSON

# What the proxy changes in the answer to a request it relays: the response message, given as read.
Rewrite = Callable[[JSON], JSON]


class LegacyFront(Protocol):
    """Serves a legacy client's request: the pass-through for an HTTP upstream, the proxy's own Streamable
    HTTP server for a stdio one."""

    def relay(
        self,
        request: web.Request,
        body: bytes | None,
        rewrite: Rewrite | None = None,
        *,
        identity: Identity | None = None,
        tool: str | None = None,
    ) -> Awaitable[web.StreamResponse]:
        """Relay (or serve) one request; with `rewrite`, the response message to it is rewritten. `identity`: the
        verified caller, where the upstream gets a credential of the proxy's making for it (`upstream.credentials`),
        never the caller's own header; `tool`: what the request calls, when known."""

    async def close(self) -> None:
        """Shutdown: end what the front holds (its sessions, its HTTP client)."""
