"""Legacy traffic relayed verbatim: POST, GET (standalone SSE stream) and DELETE.

A legacy client through the proxy must see what it sees directly: status, body and end-to-end headers are
copied, SSE is streamed chunk by chunk as it arrives (no buffering, no decompression), hop-by-hop headers are
dropped. The proxy's own Host/Origin checks ran before; the upstream sees the proxy as its client.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import UpstreamError, UpstreamTimeoutError

# RFC 9110 §7.6.1 hop-by-hop headers, plus those the proxy must set itself for its own connection.
HOP_BY_HOP: Final = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "origin",
    }
)


def _end_to_end(headers: Mapping[str, str]) -> CIMultiDict[str]:
    connection_tokens = {token.strip().lower() for token in headers.get("Connection", "").split(",") if token.strip()}
    kept: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in HOP_BY_HOP or lowered in connection_tokens:
            continue
        kept.add(name, value)
    return kept


class PassThrough:
    def __init__(
        self,
        url: str,
        http: aiohttp.ClientSession,
        extra_headers: Mapping[str, str],
        connect_timeout_seconds: float,
        call_timeout_seconds: float,
    ) -> None:
        self.url = url
        self.http = http
        self.extra_headers = dict(extra_headers)
        self.timeout = aiohttp.ClientTimeout(
            total=call_timeout_seconds, connect=connect_timeout_seconds, sock_connect=connect_timeout_seconds
        )

    async def relay(self, request: web.Request, body: bytes | None) -> web.StreamResponse:
        headers = _end_to_end(request.headers)
        for name, value in self.extra_headers.items():
            headers[name] = value
        try:
            upstream = await self.http.request(
                request.method,
                self.url,
                params=request.query,
                headers=headers,
                data=body if body else None,
                timeout=self.timeout,
                allow_redirects=False,
            )
        except TimeoutError:
            raise UpstreamTimeoutError() from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"Upstream MCP server unavailable: {exc}") from None
        complete = False
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        try:
            for name, value in _end_to_end(upstream.headers).items():
                response.headers.add(name, value)
            length = upstream.headers.get("Content-Length")
            if length is not None and length.isdigit():
                response.content_length = int(length)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            complete = True
        except (aiohttp.ClientError, TimeoutError):
            pass  # the upstream dropped mid-body: headers are out, the client sees a cut stream, as it would directly
        except ConnectionResetError:
            pass  # the client went away mid-body
        finally:
            # A finished body leaves a reusable connection; anything else must not be reused.
            if complete:
                upstream.release()
            else:
                upstream.close()
        return response
