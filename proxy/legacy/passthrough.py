"""Legacy traffic relayed verbatim (POST, GET streams, DELETE): status, body and end-to-end headers copied, SSE
streamed as it arrives, nothing added but X-Forwarded-*, trace context parsed and what is written checked where
it is written; an answer the proxy rewrites (`Rewrite`: a `tools/list` with task handles on) is read whole.
Imports the upstream's HTTP clients, the wire and tracing; never tasks or the front."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Mapping
from contextlib import suppress
from typing import Final

import aiohttp
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from proxy.errors import InvalidRequestError, ParseError, ResultTooLargeError
from proxy.legacy import Rewrite
from proxy.observe import tracing
from proxy.principals import Identity
from proxy.upstream.credentials import Credentials
from proxy.upstream.http.answers import CLIENT_FAILURES, AiohttpAnswer, Answer, checked_headers, failure
from proxy.upstream.http.h1 import H1RequestError
from proxy.upstream.http.lean import LeanClient
from proxy.wire import jsonrpc, trace_context
from proxy.wire.fields import FieldError, check_target

# A legacy client through the proxy must see what it sees directly: status, body and end-to-end headers are copied,
# SSE is streamed chunk by chunk as it arrives (no buffering, no decompression), hop-by-hop headers are dropped, and
# nothing is added but the conventional X-Forwarded-For/-Proto/-Host. The proxy's own Host/Origin checks ran before;
# the upstream sees the proxy as its client. Trace context is parsed, not copied (a value that does not parse is
# dropped, W3C Trace Context and Baggage), and what is written is checked where it is written (`wire/fields.py`: the
# target here, each header by the client that writes it): a target or header that could split a line fails the request
# with the proxy's own JSON-RPC error before a byte leaves. A request whose answer the proxy rewrites (`Rewrite`: a
# `tools/list` with task handles on) is read whole, within `limits.max_result_bytes`, and only its response message
# changes (an SSE answer keeps its events and their ids).

# Plain answers up to this size are read whole and sent in one write; larger ones and SSE are streamed.
BUFFERED_BODY_MAX_BYTES: Final = 1 << 20

# Hop-by-hop headers (RFC 9110, section 7.6.1), plus those the proxy must set itself for its own connection.
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


# aiohttp's client adds these to a request that lacks them (`Accept-Encoding: gzip, deflate` made upstreams
# compress answers the client never asked to be compressed): a relayed request carries the client's only.
NO_AUTO_HEADERS: Final = ("Accept", "Accept-Encoding", "Content-Type", "User-Agent")


def _add_forwarded(headers: CIMultiDict[str], request: web.Request) -> None:
    """The conventional reverse-proxy headers: this hop's client is appended to X-Forwarded-For (earlier values
    kept, several lines joined in order), X-Forwarded-Proto and X-Forwarded-Host say what this hop received and
    replace whatever the client claimed."""
    chain = headers.popall("X-Forwarded-For", [])
    if request.remote:
        chain.append(request.remote)
    if chain:
        headers["X-Forwarded-For"] = ", ".join(chain)
    headers["X-Forwarded-Proto"] = request.scheme
    headers.popall("X-Forwarded-Host", None)
    if (host := request.headers.get("Host")) is not None:
        headers["X-Forwarded-Host"] = host


_HOP_BY_HOP_NAMES: Final = tuple(sorted(HOP_BY_HOP))


def _end_to_end(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """`headers` without the hop-by-hop ones, nor those the first Connection header names (RFC 9110 §7.6.1), in
    their order. (A copy in C, then a lookup a hop-by-hop name: cheaper than a loop over the headers in Python.)"""
    kept: CIMultiDict[str] = CIMultiDict(headers)
    connection = kept.get("Connection")
    for name in _HOP_BY_HOP_NAMES:
        if name in kept:
            del kept[name]
    if connection:
        for token in connection.split(","):
            if token := token.strip():
                kept.popall(token, None)
    return kept


def _trace_parsed(headers: CIMultiDict[str]) -> None:
    """The request's trace headers as the W3C grammars read them (W3C Trace Context §3.2, §3.3; W3C Baggage
    §3): a value that does not parse is dropped, never relayed. Several tracestate or baggage lines are one
    list (RFC 9110 §5.3); several traceparent lines are none (Trace Context §3.2: one traceparent)."""
    if not trace_context.has_trace_key(headers):
        return
    carrier: dict[str, str] = {}
    for key in trace_context.TRACE_KEYS:
        values = headers.popall(key, [])
        if values and (key != "traceparent" or len(values) == 1):
            carrier[key] = ",".join(values)
    headers.update(trace_context.parsed(carrier))


def _checked(target: str) -> None:
    """Whether the request target is origin-form visible ASCII (RFC 9112 §3.2); if not, the request fails with
    an InvalidRequestError (a JSON-RPC answer, HTTP 400) and nothing is sent. Before aiohttp's client; the lean
    client's writer checks the target itself, and a request it refused is checked here only to answer the same
    error. Every header is checked by the client that writes it: the lean client's writer, or `checked_headers`
    before aiohttp's."""
    try:
        check_target(target)
    except FieldError as exc:
        raise InvalidRequestError(f"The request cannot be relayed upstream: {exc}") from None


class PassThrough:
    """Relays a legacy client's requests to the HTTP upstream verbatim, on HTTP clients of its own (`close`
    closes them): POSTs, the hot path, through the lean client when the upstream is plain HTTP, everything else
    (GET streams, DELETE, HEAD, an https upstream) through aiohttp's."""

    def __init__(
        self,
        url: str,
        http: aiohttp.ClientSession,
        extra_headers: Mapping[str, str],
        connect_timeout_seconds: float,
        call_timeout_seconds: float,
        max_result_bytes: int | None = None,
        credentials: Credentials | None = None,
        principal_header: str = "authorization",
    ) -> None:
        # Where the proxy makes the caller's upstream credential (`upstream.credentials` exchange or secrets),
        # the caller's own principal header is never relayed: its credential is put in its place.
        self.credentials = credentials if credentials is not None and not credentials.forwards else None
        self.principal_header = principal_header
        self.url = URL(url)  # parsed once, not per request
        # The most of an answer read whole to be rewritten (`limits.max_result_bytes`).
        self.max_result_bytes = max_result_bytes if max_result_bytes is not None else BUFFERED_BODY_MAX_BYTES * 4
        self.http = http
        self.lean = LeanClient.of(self.url, connect_timeout_seconds, call_timeout_seconds)
        self.extra_headers = dict(extra_headers)
        self.timeout = aiohttp.ClientTimeout(
            total=call_timeout_seconds, connect=connect_timeout_seconds, sock_connect=connect_timeout_seconds
        )

    async def close(self) -> None:
        if self.lean is not None:
            await self.lean.close()
        await self.http.close()

    def relay(
        self,
        request: web.Request,
        body: bytes | None,
        rewrite: Rewrite | None = None,
        *,
        identity: Identity | None = None,
        tool: str | None = None,
    ) -> Awaitable[web.StreamResponse]:
        # (the query string first: parsing it into `request.query` costs more than the relay's header checks)
        url = self.url.with_query(request.query) if request.query_string else self.url
        if self.credentials is None:
            return self.relay_to(url, request, body, rewrite)
        return self._relay_with_credential(url, request, body, rewrite, identity, tool)

    async def _relay_with_credential(
        self,
        url: URL,
        request: web.Request,
        body: bytes | None,
        rewrite: Rewrite | None,
        identity: Identity | None,
        tool: str | None,
    ) -> web.StreamResponse:
        assert self.credentials is not None
        credential = await self.credentials.headers(identity, tool)
        return await self.relay_to(url, request, body, rewrite, credential)

    async def fetch_json(self, url: URL, max_bytes: int, timeout_seconds: float) -> object:
        """A small JSON document at `url` on the upstream's origin (the relay reads an authorization server's
        metadata with it): its value, or None when it is not there, larger than `max_bytes`, not JSON or late."""
        headers = checked_headers(CIMultiDict({"Accept": "application/json", **self.extra_headers}))
        try:
            async with self.http.get(
                url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_seconds), allow_redirects=False
            ) as response:
                if response.status != 200:
                    return None
                body = await response.content.read(max_bytes + 1)
        except CLIENT_FAILURES:
            return None
        if len(body) > max_bytes:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None

    async def relay_to(
        self,
        url: URL,
        request: web.Request,
        body: bytes | None,
        rewrite: Rewrite | None = None,
        credential: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        """The request relayed to `url` (another path of the upstream's origin: `edge/_relay.py`), by the same
        rules; with `rewrite`, its answer is read whole and its response message rewritten. Where the proxy makes
        upstream credentials, without the caller's principal header, and with `credential` (the caller's, made
        for the MCP endpoint) in its place."""
        headers = _end_to_end(request.headers)
        if rewrite is not None:
            headers.popall("Accept-Encoding", None)  # an answer the proxy reads comes as it is, not compressed
        if self.credentials is not None:
            headers.popall(self.principal_header, None)
            if credential:
                headers.update(credential)
        _add_forwarded(headers, request)
        for name, value in self.extra_headers.items():
            headers[name] = value
        _trace_parsed(headers)
        upstream: Answer
        try:
            if self.lean is not None and request.method == "POST":  # every URL relayed is on the upstream's origin
                # (a CLIENT span until the answer's headers are in; the writer checks the target and headers)
                upstream = await tracing.relayed(headers, self.lean.post, url.raw_path_qs, headers.items(), body or b"")
            else:
                _checked(url.raw_path_qs)
                upstream = AiohttpAnswer(
                    await tracing.relayed(
                        headers,
                        self.http.request,
                        request.method,
                        url,
                        headers=checked_headers(headers),  # (the lean client checks what it writes itself)
                        skip_auto_headers=NO_AUTO_HEADERS,
                        data=body if body else None,
                        timeout=self.timeout,
                        allow_redirects=False,
                    )
                )
        except CLIENT_FAILURES as exc:
            if isinstance(exc, H1RequestError):  # the lean writer refused: a target is the request's own fault
                _checked(url.raw_path_qs)
            raise failure(exc) from None
        headers = _end_to_end(upstream.headers)
        if rewrite is not None and request.method == "POST":
            return await _rewritten(upstream, headers, rewrite, self.max_result_bytes)
        length = upstream.headers.get("Content-Length")
        size = int(length) if length is not None and length.isdigit() else None
        buffered = size is not None and size <= BUFFERED_BODY_MAX_BYTES and not _is_event_stream(upstream)
        if buffered and request.method != "HEAD":  # a HEAD answer's Content-Length describes a body it lacks
            return await _buffered(upstream, headers)
        return await _streamed(request, upstream, headers, size)


async def _buffered(upstream: Answer, headers: CIMultiDict[str]) -> web.Response:
    """A plain (JSON) answer of known, bounded size: read whole, then sent with its headers in one write."""
    try:
        body = await upstream.read()  # releases the connection for reuse once the body is in
    except CLIENT_FAILURES as exc:
        upstream.close()
        raise failure(exc) from None
    return web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=body)


async def _streamed(
    request: web.Request, upstream: Answer, headers: CIMultiDict[str], size: int | None
) -> web.StreamResponse:
    """SSE or a large body: each chunk goes out as it arrives, never buffered. Headers leave with the first
    chunk when it came in with them, and the last chunk with the end of the body when that is known."""
    complete = False
    try:
        first = upstream.ready()  # what arrived with the headers, if anything
    except CLIENT_FAILURES as exc:
        upstream.close()
        raise failure(exc) from None
    response = (_HeadersWithFirstChunk if first else web.StreamResponse)(status=upstream.status, reason=upstream.reason)
    response.headers.extend(headers)
    if size is not None:
        response.content_length = size
    try:
        await response.prepare(request)
        chunk = first
        while True:
            if not chunk:
                chunk = await upstream.next_chunk()
                if not chunk:
                    break
            if upstream.ended:
                break
            await response.write(chunk)
            chunk = b""
        await response.write_eof(chunk)  # the last chunk, if any, and the end in one write
        complete = True
    except CLIENT_FAILURES:
        # The upstream dropped mid-body and the headers are out: the client's connection is closed without the
        # body's end, so it sees a cut stream, as it would directly (not a well-ended, shorter one).
        if request.transport is not None:
            request.transport.close()
    except ConnectionResetError:
        pass  # the client went away mid-body
    finally:
        # A finished body leaves a reusable connection; anything else must not be reused.
        if complete:
            upstream.release()
        else:
            upstream.close()
    return response


async def _rewritten(upstream: Answer, headers: CIMultiDict[str], rewrite: Rewrite, max_bytes: int) -> web.Response:
    """An answer read whole (at most `max_bytes`: past that the upstream's answer is dropped and the client gets
    the proxy's -32603), its response message rewritten: a JSON body, or the SSE event that holds it (the other
    events, ids and fields, as they came). A body that is neither goes as it came."""
    body = bytearray()
    try:
        chunk = upstream.ready()
        while True:
            if not chunk:
                chunk = await upstream.next_chunk()
                if not chunk:
                    break
            body += chunk
            if len(body) > max_bytes:
                upstream.close()
                raise ResultTooLargeError(max_bytes, "the answer was dropped")
            if upstream.ended:
                break
            chunk = b""
    except CLIENT_FAILURES as exc:
        upstream.close()
        raise failure(exc) from None
    upstream.release()
    data = bytes(body)
    read = _sse_rewritten if _is_event_stream(upstream) else _json_rewritten
    with suppress(ParseError, ValueError):  # not what it says it is: relayed as it came, for the client to judge
        data = read(data, rewrite)
    return web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=data)


def _json_rewritten(data: bytes, rewrite: Rewrite) -> bytes:
    message = jsonrpc.loads(data)
    return jsonrpc.dumps(rewrite(message)) if isinstance(message, dict) else data


_LINE_ENDS: Final = re.compile(r"(\r\n|\r|\n)")  # SSE lines end with any of the three (WHATWG event streams)


def _sse_rewritten(data: bytes, rewrite: Rewrite) -> bytes:
    """The SSE answer with the data of the event that holds the response replaced, and every other byte (its
    other fields, the other events, the line ends) as it came."""
    text = data.decode()
    pieces = _LINE_ENDS.split(text)  # line, end, line, end, ..., last line (without an end)
    out: list[str] = []
    block: list[tuple[str, str]] = []  # (line, its end) of the event being read
    for index in range(0, len(pieces), 2):
        line, end = pieces[index], pieces[index + 1] if index + 1 < len(pieces) else ""
        block.append((line, end))
        if line == "" and end:
            out.append(_event_rewritten(block, rewrite))
            block = []
    out.append("".join(line + end for line, end in block))
    return "".join(out).encode()


def _event_rewritten(block: list[tuple[str, str]], rewrite: Rewrite) -> str:
    """One event (its lines and their ends, the blank line last): as it came, or with the response in its data
    rewritten (one `data:` line where its first one was)."""
    lines = [line for line, _ in block]
    data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
    if not data:
        return "".join(line + end for line, end in block)
    try:
        message = jsonrpc.loads("\n".join(data).encode())
    except ParseError:
        message = None
    if not isinstance(message, dict) or "method" in message:
        return "".join(line + end for line, end in block)
    written = "data: " + jsonrpc.dumps(rewrite(message)).decode()
    out: list[str] = []
    first = True
    for line, end in block:
        if line.startswith("data:"):
            if first:
                out.append(written + end)
                first = False
            continue
        out.append(line + end)
    return "".join(out)


def _is_event_stream(upstream: Answer) -> bool:
    return upstream.headers.get("Content-Type", "").lower().startswith("text/event-stream")


class _HeadersWithFirstChunk(web.StreamResponse):
    """A streamed response whose headers wait for its first body write (one packet instead of two). Used only
    when that first chunk is already in hand, so an SSE stream's headers are never held back."""

    _send_headers_immediately = False
