"""The paths that are not the proxy's, relayed verbatim to the upstream's origin through the legacy pass-through
when the router has no route for them: only those under `relay.prefixes` (by default `/.well-known/`) and the
endpoints an embedded authorization server's metadata names. Owns that decision only; imports the config, never
the front, the tasks or a legacy server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Final, Protocol, runtime_checkable

import structlog
from aiohttp import web
from yarl import URL

from proxy.config.schema import RelayConfig

log = structlog.get_logger(__name__)

# An MCP server that requires OAuth serves more than its MCP endpoint: its protected-resource metadata
# (`/.well-known/oauth-protected-resource/...`), perhaps an embedded authorization server (its metadata, `/authorize`,
# `/token`, `/register`). A client that reaches the server through the proxy must find those at the same public URL,
# and nothing else the upstream serves (static pages, an admin UI) should be exposed: only paths under
# `relay.prefixes` are relayed, plus the endpoints the authorization server's own metadata names on the upstream's
# origin, learned when the upstream requires credentials. What is the proxy's comes from the router itself (`app.py`),
# whatever is added to it later; a request goes out through the legacy pass-through (same header rules, limits and
# X-Forwarded-*).

NO_ORIGIN: Final = (
    "Not found: this proxy serves a stdio MCP server, which has no web origin; only the MCP endpoint and the "
    "proxy's own paths exist here"
)
NOT_RELAYED: Final = (
    "Not found: this path is not relayed to the upstream MCP server (only the paths under relay.prefixes are)"
)
AUTH_SERVER_METADATA: Final = "/.well-known/oauth-authorization-server"
# The endpoints of RFC 8414 (and OpenID Connect Discovery) metadata an authorization server serves itself.
_ENDPOINT_FIELDS: Final = (
    "authorization_endpoint",
    "token_endpoint",
    "registration_endpoint",
    "revocation_endpoint",
    "introspection_endpoint",
    "device_authorization_endpoint",
    "pushed_authorization_request_endpoint",
    "userinfo_endpoint",
    "end_session_endpoint",
    "jwks_uri",
)
LEARN_INTERVAL_SECONDS: Final = 60.0  # between two look-ups of the metadata (a scanner's misses cost one a minute)
METADATA_MAX_BYTES: Final = 64 * 1024
METADATA_TIMEOUT_SECONDS: Final = 5.0
_MAX_AUTH_SERVERS: Final = 4  # of those a protected resource names


@runtime_checkable
class Forwarder(Protocol):
    """What relays one request to a URL of the upstream's origin (the legacy pass-through: its `url` is the
    upstream's MCP endpoint, `relay_to` sends a request elsewhere by the same rules, `fetch_json` reads a small
    JSON document there)."""

    url: URL

    async def relay_to(self, url: URL, request: web.Request, body: bytes | None) -> web.StreamResponse: ...

    async def fetch_json(self, url: URL, max_bytes: int, timeout_seconds: float) -> object: ...


class OriginRelay:
    """Relays a request for a path the proxy does not serve to the same path (and query) at the upstream's
    origin, when `relay.prefixes` (or a learned authorization endpoint) covers it; `forwarder` is None for a
    stdio upstream, which has no origin. `requires_auth` says whether the upstream requires credentials."""

    def __init__(
        self,
        config: RelayConfig,
        upstream_url: str | None,
        forwarder: Forwarder | None,
        requires_auth: Callable[[], Awaitable[bool]] | None = None,
    ) -> None:
        self.config = config
        self.origin = URL(upstream_url).origin() if upstream_url else None
        self.forwarder = forwarder
        self.requires_auth = requires_auth
        self.auth_endpoints: frozenset[str] = frozenset()  # paths, learned from the authorization server's metadata
        self._learned_at: float | None = None
        self._learning = asyncio.Lock()

    @classmethod
    def of(
        cls, config: RelayConfig, legacy_front: object, requires_auth: Callable[[], Awaitable[bool]] | None = None
    ) -> OriginRelay:
        """The relay beside the server legacy clients get: the pass-through of an HTTP upstream forwards; the
        proxy's own server in front of a stdio upstream does not (there is no origin)."""
        if isinstance(legacy_front, Forwarder):
            return cls(config, str(legacy_front.url), legacy_front, requires_auth)
        return cls(config, None, None)

    def relays(self, path: str) -> bool:
        """Is `path` under a relayed prefix?"""
        return self.config.enabled and any(path.startswith(prefix) for prefix in self.config.prefixes)

    def learns_auth_endpoints(self) -> bool:
        """The authorization server's metadata is relayed, so the endpoints it names may be too."""
        return self.forwarder is not None and self.relays(AUTH_SERVER_METADATA)

    def target(self, raw_path: str) -> URL | None:
        """The upstream URL of a request target, kept as the client encoded it (path and query)."""
        if self.origin is None or not raw_path.startswith("/") or raw_path.startswith("//"):
            return None
        return URL(f"{self.origin}{raw_path}", encoded=True)

    async def relay(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        if self.forwarder is None:
            return not_found(NO_ORIGIN)
        if not self.relays(request.path) and not await self._is_auth_endpoint(request.path):
            return not_found(NOT_RELAYED)
        target = self.target(request.raw_path)
        if target is None:
            return not_found(NOT_RELAYED)
        return await self.forwarder.relay_to(target, request, body)

    # --- the authorization server's endpoints ---------------------------------------------------------------

    async def _is_auth_endpoint(self, path: str) -> bool:
        if path in self.auth_endpoints:
            return True
        if not self.learns_auth_endpoints() or not self._due():
            return False
        async with self._learning:  # concurrent misses share one look-up
            if self._due():
                await self._learn()
        return path in self.auth_endpoints

    def _due(self) -> bool:
        return self._learned_at is None or time.monotonic() - self._learned_at >= LEARN_INTERVAL_SECONDS

    async def _learn(self) -> None:
        """The endpoints named by the metadata of the authorization servers the upstream's protected-resource
        metadata names (RFC 9728), where the upstream's origin serves that metadata itself (RFC 8414): an
        embedded authorization server. Nothing is looked up for an upstream that requires no credentials."""
        self._learned_at = time.monotonic()
        if self.forwarder is None or self.requires_auth is None or not await self.requires_auth():
            return
        found: set[str] = set()
        for document in await _auth_server_metadata(self.forwarder):
            found.update(_endpoint_paths(document, self.forwarder.url.origin()))
        if frozenset(found) != self.auth_endpoints:
            self.auth_endpoints = frozenset(found)
            log.info("relay_auth_endpoints", paths=sorted(found))


async def _auth_server_metadata(forwarder: Forwarder) -> list[dict[str, object]]:
    """The metadata documents of the authorization servers the upstream's protected-resource metadata names,
    as the upstream's origin serves them (RFC 8414 section 3.1, and OpenID Connect Discovery's two forms)."""
    upstream_path = forwarder.url.path.rstrip("/")
    resource_metadata = "/.well-known/oauth-protected-resource"
    resource = await _fetch(forwarder, f"{resource_metadata}{upstream_path}", resource_metadata)
    issuers = resource.get("authorization_servers") if resource else None
    paths = [""]
    if isinstance(issuers, list):
        paths = [URL(issuer).path.rstrip("/") for issuer in issuers[:_MAX_AUTH_SERVERS] if isinstance(issuer, str)]
    documents = []
    for path in dict.fromkeys(paths):
        openid = "/.well-known/openid-configuration"
        document = await _fetch(forwarder, f"{AUTH_SERVER_METADATA}{path}", f"{openid}{path}", f"{path}{openid}")
        if document is not None:
            documents.append(document)
    return documents


async def _fetch(forwarder: Forwarder, *paths: str) -> dict[str, object] | None:
    """The first of these paths on the upstream's origin that answers a JSON object."""
    for path in paths:
        document = await forwarder.fetch_json(
            forwarder.url.origin().with_path(path), METADATA_MAX_BYTES, METADATA_TIMEOUT_SECONDS
        )
        if isinstance(document, dict):
            return document
    return None


def relayed_shown(config: RelayConfig, has_origin: bool) -> list[str]:
    """What is relayed, as the start line says it (an empty list: nothing)."""
    if not has_origin or not config.enabled:
        return []
    shown = [f"{prefix}*" for prefix in config.prefixes]
    if any(AUTH_SERVER_METADATA.startswith(prefix) for prefix in config.prefixes) and "/" not in config.prefixes:
        shown.append("the authorization endpoints its metadata names, when the upstream requires credentials")
    return shown


def _endpoint_paths(document: dict[str, object], upstream_origin: URL | None) -> Iterable[str]:
    """The paths of the endpoints `document` names on the authorization server's own origin (its `issuer`'s) or
    on the upstream's: those the upstream serves. An endpoint elsewhere is reached there, not through here."""
    issuer = document.get("issuer")
    origins = {upstream_origin}
    if isinstance(issuer, str) and URL(issuer).absolute:
        origins.add(URL(issuer).origin())
    for field in _ENDPOINT_FIELDS:
        value = document.get(field)
        if not isinstance(value, str):
            continue
        url = URL(value)
        if url.absolute and url.origin() in origins and url.path.startswith("/") and url.path != "/":
            yield url.path


def not_found(message: str) -> web.Response:
    return web.json_response({"error": "not_found", "message": message}, status=404)
