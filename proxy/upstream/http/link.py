"""What every Streamable HTTP session of one upstream shares: the HTTP client and URL, the principal header,
timeouts, request ids and the largest answer read, besides what every link holds (`upstream/link.py`).
Imports aiohttp's client side and the config; never a session.
"""

from __future__ import annotations

import itertools

import aiohttp
from yarl import URL

from proxy.config import HttpUpstreamConfig
from proxy.observability import Metrics
from proxy.upstream.link import LinkBase


class HttpLink(LinkBase):
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
        self.timeout = aiohttp.ClientTimeout(
            total=config.call_timeout_seconds,
            connect=config.connect_timeout_seconds,
            sock_connect=config.connect_timeout_seconds,
        )
        self._ids = itertools.count(1)

    def next_id(self) -> int:
        return next(self._ids)
