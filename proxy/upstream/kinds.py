"""Which kind of upstream session the configuration describes: the one place that tells the two apart.

Stdio server processes the proxy runs (`upstream.command`), else Streamable HTTP sessions (`upstream.url`).
Imports both kinds; nothing else imports them.
"""

from __future__ import annotations

import aiohttp

from proxy.config.schema import Config, StdioUpstreamConfig
from proxy.observe.metrics import Metrics
from proxy.principals import Principals
from proxy.upstream.credentials import GrantStore, credentials_of
from proxy.upstream.http.session import HttpKind
from proxy.upstream.session import SessionKind
from proxy.upstream.stdio.session import StdioKind


def session_kind(
    config: Config,
    http: aiohttp.ClientSession,
    metrics: Metrics | None,
    principals: Principals | None = None,
    grants: GrantStore | None = None,
) -> SessionKind:
    """The kind of upstream session `config.upstream` describes; `http` is the HTTP kind's client; `principals`
    and `grants` (the deployment key, the store's kept grants) serve a token exchange's refresh tokens."""
    max_result_bytes = config.limits.max_result_bytes
    principal_header = config.security.principal_header
    upstream = config.upstream
    credentials = credentials_of(
        upstream.credentials,
        principal_header=principal_header,
        kind="environment" if isinstance(upstream, StdioUpstreamConfig) else "headers",
        principals=principals,
        grants=grants,
    )
    if isinstance(upstream, StdioUpstreamConfig):
        return StdioKind(
            upstream,
            metrics,
            max_result_bytes=max_result_bytes,
            principal_header=principal_header,
            legacy_replay_bytes=config.limits.legacy_replay_bytes,
            credentials=credentials,
        )
    return HttpKind(
        upstream, http, principal_header, metrics, max_result_bytes, config.security.upstream_auth, credentials
    )
