"""Every path that is not the proxy's (OAuth metadata, an embedded authorization server, static pages), relayed
verbatim to the upstream's origin through the legacy pass-through, when the router has no route for it.
Owns that decision only; imports the config, never the front, the tasks or a legacy server."""

from __future__ import annotations

from typing import Final, Protocol, runtime_checkable

from aiohttp import web
from yarl import URL

from proxy.config.schema import RelayConfig

# An MCP server that requires OAuth serves more than its MCP endpoint: its protected-resource metadata
# (`/.well-known/oauth-protected-resource/...`), perhaps an embedded authorization server (`/authorize`, `/token`,
# `/register`, its own well-known documents) and static pages. A client that reaches the server through the proxy must
# find them at the same public URL. A request is relayed only when the proxy's router has no route for its path
# (`app.py`), so what is the proxy's comes from the router itself, whatever is added to it later; it goes out through
# the legacy pass-through (same header rules, limits and X-Forwarded-*). Owns that decision only; imports the config,
# never the front, the tasks or a legacy server.

NO_ORIGIN: Final = (
    "Not found: this proxy serves a stdio MCP server, which has no web origin; only the MCP endpoint and the "
    "proxy's own paths exist here"
)
NOT_RELAYED: Final = "Not found: this path is not relayed to the upstream MCP server (relay settings)"


@runtime_checkable
class Forwarder(Protocol):
    """What relays one request to a URL of the upstream's origin (the legacy pass-through: its `url` is the
    upstream's MCP endpoint, `relay_to` sends a request elsewhere by the same rules)."""

    url: URL

    async def relay_to(self, url: URL, request: web.Request, body: bytes | None) -> web.StreamResponse: ...


class OriginRelay:
    """Relays a request for a path the proxy does not serve to the same path (and query) at the upstream's
    origin; `forwarder` is None for a stdio upstream, which has none."""

    def __init__(self, config: RelayConfig, upstream_url: str | None, forwarder: Forwarder | None) -> None:
        self.config = config
        self.origin = URL(upstream_url).origin() if upstream_url else None
        self.forwarder = forwarder

    @classmethod
    def of(cls, config: RelayConfig, legacy_front: object) -> OriginRelay:
        """The relay beside the server legacy clients get: the pass-through of an HTTP upstream forwards; the
        proxy's own server in front of a stdio upstream does not (there is no origin)."""
        if isinstance(legacy_front, Forwarder):
            return cls(config, str(legacy_front.url), legacy_front)
        return cls(config, None, None)

    def relays(self, path: str) -> bool:
        if not self.config.enabled:
            return False
        return not self.config.prefixes or any(path.startswith(prefix) for prefix in self.config.prefixes)

    def target(self, raw_path: str) -> URL | None:
        """The upstream URL of a request target, kept as the client encoded it (path and query)."""
        if self.origin is None or not raw_path.startswith("/") or raw_path.startswith("//"):
            return None
        return URL(f"{self.origin}{raw_path}", encoded=True)

    async def relay(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        if not self.relays(request.path):
            return not_found(NOT_RELAYED)
        target = self.target(request.raw_path)
        if target is None or self.forwarder is None:
            return not_found(NO_ORIGIN if self.forwarder is None else NOT_RELAYED)
        return await self.forwarder.relay_to(target, request, body)


def not_found(message: str) -> web.Response:
    return web.json_response({"error": "not_found", "message": message}, status=404)
