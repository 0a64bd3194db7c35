"""Which server legacy clients get in front of the upstream the pool reaches: an HTTP upstream's clients are
relayed verbatim (`passthrough.py`, on an HTTP client of their own), a stdio upstream's are served by the proxy
itself, one process each, counted against `upstream.max_processes` through the pool (`_stdio_server.py`).
The choice lives here, above the upstream package: `proxy/upstream/` never imports `proxy/legacy/`.
"""

from __future__ import annotations

from proxy.legacy import LegacyFront
from proxy.legacy._stdio_server import StdioLegacyServer
from proxy.legacy.passthrough import PassThrough
from proxy.upstream.http.session import HttpKind, relay_client
from proxy.upstream.pool import SessionPool
from proxy.upstream.stdio.session import StdioKind


def legacy_front(pool: SessionPool) -> LegacyFront:
    """What serves legacy clients in front of `pool`'s upstream; its sessions count against the pool's bound
    where they cost as much as the pool's own."""
    kind = pool.kind
    if isinstance(kind, HttpKind):
        config = kind.config
        return PassThrough(
            config.url,
            relay_client(),
            config.headers,
            config.connect_timeout_seconds,
            config.call_timeout_seconds,
            kind.max_result_bytes,
            kind.credentials,
            kind.principal_header,
        )
    if isinstance(kind, StdioKind):
        return StdioLegacyServer(kind, pool, kind.config, kind.principal_header, replay_bytes=kind.legacy_replay_bytes)
    raise TypeError(f"no legacy front for an upstream of kind {type(kind).__name__}")
