"""Which kind of upstream session the configuration describes: the one place that tells the two apart.

Stdio server processes the proxy runs (`upstream.command`), else Streamable HTTP sessions (`upstream.url`).
Imports both kinds; nothing else imports them.
"""

from __future__ import annotations

import aiohttp

from proxy.config.schema import Config, StdioUpstreamConfig
from proxy.observe.metrics import Metrics
from proxy.upstream.http.session import HttpKind
from proxy.upstream.session import SessionKind
from proxy.upstream.stdio.session import StdioKind


def session_kind(config: Config, http: aiohttp.ClientSession, metrics: Metrics | None) -> SessionKind:
    """The kind of upstream session `config.upstream` describes; `http` is the HTTP kind's client."""
    max_result_bytes = config.limits.max_result_bytes
    principal_header = config.security.principal_header
    upstream = config.upstream
    if isinstance(upstream, StdioUpstreamConfig):
        return StdioKind(
            upstream,
            metrics,
            max_result_bytes=max_result_bytes,
            principal_header=principal_header,
            legacy_replay_bytes=config.limits.legacy_replay_bytes,
        )
    return HttpKind(upstream, http, principal_header, metrics, max_result_bytes, config.security.upstream_auth)
