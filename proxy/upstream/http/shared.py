"""What every Streamable HTTP session of one upstream shares: the HTTP client and URL, the principal header,
timeouts, request ids and the largest answer read, besides what every shared state holds (`upstream/shared.py`).
Imports aiohttp's client side and the config; never a session.
"""

from __future__ import annotations

import itertools

import aiohttp
from yarl import URL

from proxy.config.schema import HttpUpstreamConfig
from proxy.observe.metrics import Metrics
from proxy.upstream.http.lean import KEEPALIVE_SECONDS, LeanClient
from proxy.upstream.shared import SharedBase


def upstream_connector() -> aiohttp.TCPConnector:
    """The connection pool of an HTTP client to the upstream: no count limit of its own (the proxy's limits on
    calls and tasks bound the requests in flight, and a limit here would queue them unseen), idle connections
    kept for KEEPALIVE_SECONDS, as the lean client keeps its own."""
    return aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)


def relay_client() -> aiohttp.ClientSession:
    """The aiohttp client legacy clients' requests are relayed on (GET streams, DELETE, HEAD, an https upstream):
    no automatic headers, no decompression (the bytes pass as they are), and no cookie jar (each client's own
    Cookie header goes up, and a cookie the upstream sets reaches that client only, never another client's
    request)."""
    return aiohttp.ClientSession(
        connector=upstream_connector(),
        auto_decompress=False,
        skip_auto_headers=("User-Agent",),
        cookie_jar=aiohttp.DummyCookieJar(),
    )


class HttpShared(SharedBase):
    """What every session of one upstream shares: the HTTP client and URL, timeouts, request ids, background
    work, and what the upstream said most recently (serverInfo; when it last answered, for readiness)."""

    def __init__(
        self,
        config: HttpUpstreamConfig,
        http: aiohttp.ClientSession,
        principal_header: str,
        metrics: Metrics | None,
        max_result_bytes: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.max_result_bytes = max_result_bytes  # the largest upstream answer or stream message read
        self.http = http
        self.principal_header = principal_header
        self.metrics = metrics
        self.url = URL(config.url)  # parsed once, not per request
        # A plain-HTTP upstream gets the sessions' POSTs (requests, answers, notifications) on the lean client;
        # GET streams, DELETE and an https upstream use `http`.
        self.lean = LeanClient.of(self.url, config.connect_timeout_seconds, config.call_timeout_seconds)
        self.timeout = aiohttp.ClientTimeout(
            total=config.call_timeout_seconds,
            connect=config.connect_timeout_seconds,
            sock_connect=config.connect_timeout_seconds,
        )
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)

    async def close(self) -> None:
        await super().close()
        if self.lean is not None:
            await self.lean.close()
