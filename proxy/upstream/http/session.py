"""The Streamable HTTP kind of upstream: what its sessions share and how the pool bounds them (`HttpKind`), and one
session (`HttpSession`): `initialize`, the `Mcp-Session-Id` and `MCP-Protocol-Version` headers, one POST per
request, a re-`initialize` when the upstream forgot the session, and its GET stream. Failures become typed
UpstreamErrors (`answers.py`); a 401/403 is the caller's credential refused. Imports aiohttp's client side and
tracing; never the store, the front or the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from contextlib import AbstractAsyncContextManager
from typing import Any, Final, NamedTuple

import aiohttp
import structlog
from multidict import CIMultiDict
from yarl import URL

from proxy.background import Background
from proxy.config.schema import HttpUpstreamConfig
from proxy.errors import (
    AUTH_STATUSES,
    ProxyError,
    RequestId,
    ResultTooLargeError,
    UpstreamAuthError,
    UpstreamError,
    UpstreamRefusedError,
    UpstreamSessionGoneError,
    UpstreamTimeoutError,
)
from proxy.observe import tracing
from proxy.observe.metrics import Metrics
from proxy.principals import Identity
from proxy.upstream.auth import AuthMode, UpstreamAuth
from proxy.upstream.credentials import Credentials, Forward
from proxy.upstream.http.answers import CLIENT_FAILURES, AiohttpAnswer, Answer, checked_headers, failure
from proxy.upstream.http.get_stream import GetStream, SessionGone, StreamEvent
from proxy.upstream.http.lean import KEEPALIVE_SECONDS, LeanClient
from proxy.upstream.http.request_stream import HttpRequestStream, read_body
from proxy.upstream.session import (
    CLIENT_CAPABILITIES,
    CLIENT_INFO,
    Learned,
    Lending,
    PoolLimits,
    Session,
    Subscribers,
    answer,
    measured,
    read_param_headers,
    read_task_support,
    request,
)
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader
from proxy.wire.fields import is_safe_value
from proxy.wire.jsonrpc import JSON, dumps, error_message, notification_message, request_message, result_message
from proxy.wire.sse import EventTooLargeError
from proxy.wire.upstream_events import UpstreamErrorResponse

log = structlog.get_logger(__name__)

SESSION_GONE_STATUSES: Final = frozenset({400, 404, 410})  # the upstream does not know the session (or the task)
STANDALONE_REFUSED: Final = "cannot be relayed to 2026-07-28 clients: no call of theirs holds this upstream session"


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


PROBE_TIMEOUT_SECONDS: Final = 2.0  # a readiness probe's initialize; kubelet's own timeout is short too


class HttpKind:
    """What every session of one upstream shares (the HTTP client and URL, timeouts, request ids, background work,
    what the upstream said most recently), and how the pool bounds them: sessions are cheap, so every call whose
    client could answer a question gets one of its own and idle ones are kept up to `upstream.max_sessions`;
    readiness starts a throwaway session when the upstream has been quiet; whether the upstream requires
    credentials is found out with an anonymous `initialize` (`upstream/auth.py`)."""

    def __init__(
        self,
        config: HttpUpstreamConfig,
        http: aiohttp.ClientSession,
        principal_header: str,
        metrics: Metrics | None,
        max_result_bytes: int | None = None,
        auth_mode: AuthMode = "detect",
        credentials: Credentials | None = None,
    ) -> None:
        self.config = config
        self.credentials = credentials if credentials is not None else Forward(principal_header)
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
        self.learned = Learned()
        self.auth = UpstreamAuth(auth_mode, self._anonymous_initialize)
        # A call whose client could answer a question gets a session of its own (its GET stream is the call's);
        # the others share the principal's session, so a thousand quiet tasks are not a thousand sessions.
        self.limits = PoolLimits(
            max_idle=config.max_sessions,
            max_open=config.max_open_sessions,
            share_quiet_calls=True,
            wait_seconds=config.connect_timeout_seconds,
            limit_name="upstream.max_open_sessions",
            refuse_new_calls_when_full=True,
        )
        self._ids = itertools.count(1)
        self._background = Background("upstream_background_task_failed")
        self._probe_lock = asyncio.Lock()

    def next_id(self) -> int:
        return next(self._ids)

    def new(self, principal: Identity | None) -> Session:
        return HttpSession(self, principal)

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._background.spawn(coroutine, name)

    async def _anonymous_initialize(self) -> None:
        """One `initialize` without any caller's credential, on a throwaway session: does the upstream need one?"""
        session = HttpSession(self, None)
        try:
            await asyncio.wait_for(session.initialize(listen=False), PROBE_TIMEOUT_SECONDS)
        except TimeoutError:
            raise UpstreamTimeoutError(
                f"Upstream did not answer initialize within {PROBE_TIMEOUT_SECONDS:g} s"
            ) from None
        finally:
            await session.close()

    async def probe(self, max_age_seconds: float, shared: Callable[[], AbstractAsyncContextManager[Session]]) -> None:
        """Readiness: fine when the upstream answered within `max_age_seconds`; otherwise a fresh `initialize`
        on a throwaway session (ended with DELETE) must succeed within PROBE_TIMEOUT_SECONDS, or be refused for
        want of a credential (the upstream is there; it requires auth). Raises UpstreamError saying what failed.
        Concurrent probes share one attempt."""
        async with self._probe_lock:
            last = self.learned.last_answer_at
            if last is not None and time.monotonic() - last <= max_age_seconds:
                return
            try:
                await self._anonymous_initialize()
            except UpstreamAuthError:  # it answered: it wants a credential the probe lacks
                return
            except UpstreamError as exc:  # readiness names where it asked (the path, never the query)
                raise UpstreamError(f"{exc.message} (initialize at {self.url.path})", detail=exc.detail) from None

    async def close(self) -> None:
        await self._background.close()
        await self.credentials.close()
        if self.lean is not None:
            await self.lean.close()


class HttpSession:
    """One Streamable HTTP session of the upstream (see the module doc); a `Session`."""

    def __init__(self, kind: HttpKind, principal: Identity | None) -> None:
        self.kind = kind
        self.principal = principal
        self.session_id: str | None = None
        self.protocol_version: str = kind.config.protocol_version
        self.initialize_result: JSON | None = None
        self.in_flight = 0  # calls open on this session right now
        self.subscribers = Subscribers(self.request, kind.learned.tools_changed)
        self.lending = Lending(self.subscribers)  # the call the session is lent to gets its GET-stream traffic
        self._get_stream: GetStream | None = None
        self._lock = asyncio.Lock()
        self._cookies: aiohttp.CookieJar | None = None  # what the upstream set on this session (made on the first)

    async def request(self, method: str, params: JSON | None) -> JSON:
        return await request(self, method, params)

    async def param_headers(self, tool: str) -> tuple[ParamHeader, ...]:
        return await read_param_headers(self, self.kind.learned, tool)

    async def task_support(self, tool: str) -> legacy_tasks.TaskSupport | None:
        return await read_task_support(self, self.kind.learned, tool)

    # --- headers and plumbing -------------------------------------------------------------------------

    def headers(
        self,
        extra: Mapping[str, str] | None = None,
        *,
        initialized: bool = True,
        credential: Mapping[str, str] | None = None,
    ) -> CIMultiDict[str]:
        """Headers of a request on this session. The caller's credential is its principal header as it came
        (`forward`), or `credential` (what the credential source made for it, never the inbound token); the
        operator's `upstream.headers` come after it, so a configured credential wins (as it does on the
        pass-through); names are matched whatever their case, so each header is sent once."""
        headers = CIMultiDict({"Accept": "application/json, text/event-stream", "Content-Type": "application/json"})
        if self._cookies is not None and (cookies := self._cookies.filter_cookies(self.kind.url)):
            headers["Cookie"] = "; ".join(f"{morsel.key}={morsel.coded_value}" for morsel in cookies.values())
        if credential is not None:
            headers.update(credential)
        elif self.principal and self.principal.credential:
            headers[self.kind.principal_header] = self.principal.credential
        headers.update(self.kind.config.headers)
        if initialized:
            headers["MCP-Protocol-Version"] = self.protocol_version
            if self.session_id is not None:
                headers["Mcp-Session-Id"] = self.session_id
        if extra:
            headers.update(extra)
        return headers

    async def headers_now(
        self, extra: Mapping[str, str] | None = None, *, initialized: bool = True, tool: str | None = None
    ) -> CIMultiDict[str]:
        """`headers`, with the caller's credential as the credential source makes it at this moment (a token
        exchanged or renewed now if need be; `tool`: the tool the request is about). The proxy's own sessions
        of no caller (readiness, the anonymous probe) carry none: callers are never anonymous where the source
        makes credentials (the edge refuses them)."""
        credentials = self.kind.credentials
        if credentials.forwards or self.principal is None:
            return self.headers(extra, initialized=initialized)
        credential = await credentials.headers(self.principal, tool)
        return self.headers(extra, initialized=initialized, credential=credential)

    async def stream_headers(self, last_event_id: str | None) -> CIMultiDict[str]:
        """Headers of a GET that opens (or resumes) an SSE stream of this session."""
        headers = await self.headers_now({"Accept": "text/event-stream"})
        headers.pop("Content-Type", None)
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        return headers

    def _keep_cookies(self, response: Answer | aiohttp.ClientResponse) -> None:
        """Cookies the upstream sets are this session's: sent on its later requests (a load balancer's affinity
        cookie keeps the session on its server), never on another session's, so never another caller's."""
        if "Set-Cookie" in response.headers:
            if self._cookies is None:
                self._cookies = aiohttp.CookieJar(unsafe=True)  # a sidecar's upstream is an IP address
            self._cookies.update_cookies_from_headers(response.headers.getall("Set-Cookie"), self.kind.url)

    async def _post(self, message: JSON, headers: Mapping[str, str]) -> Answer:
        kind = self.kind
        response: Answer
        try:
            if kind.lean is not None:  # (checks what it writes itself)
                response = await kind.lean.post(kind.url.raw_path_qs, headers.items(), dumps(message))
            else:
                headers = checked_headers(headers)
                response = AiohttpAnswer(
                    await kind.http.post(kind.url, data=dumps(message), headers=headers, timeout=kind.timeout)
                )
        except CLIENT_FAILURES as exc:
            raise failure(exc) from None
        if response.status < 500:
            kind.learned.last_answer_at = time.monotonic()  # the upstream is there and speaks HTTP (readiness)
        self._keep_cookies(response)
        return response

    # --- lifecycle --------------------------------------------------------------------------------------

    async def ensure_initialized(self) -> JSON:
        if self.initialize_result is not None:
            return self.initialize_result
        async with self._lock:
            if self.initialize_result is None:
                await self.initialize()
            assert self.initialize_result is not None
            return self.initialize_result

    async def initialize(self, *, listen: bool = True) -> None:
        self.session_id = None
        request_id = self.kind.next_id()
        params = {
            "protocolVersion": self.kind.config.protocol_version,
            "capabilities": CLIENT_CAPABILITIES,
            "clientInfo": CLIENT_INFO,
        }
        headers = await self.headers_now(initialized=False)
        response = await self._post(request_message(request_id, "initialize", params), headers)
        session_id = response.headers.get("Mcp-Session-Id")
        if response.status in AUTH_STATUSES:
            raise self._refused(response, "initialize")
        if not 200 <= response.status < 300:
            # An upstream that will not start sessions (a wrong path: 404, a redirect) answers, but cannot serve:
            # that answer does not count for readiness, which asks again (and so reports the refusal) at once.
            self.kind.learned.last_answer_at = None
        body: bytes | None = None
        if response.status >= 400:
            despite = await _answer_despite_status(response, request_id, self.kind.max_result_bytes)
            if isinstance(despite, _Refusal):
                raise UpstreamError(
                    f"Upstream refused initialize: HTTP {response.status}{despite.said}", detail=despite.raw
                )
            body = despite
        call = HttpRequestStream(self, request_id, "initialize", response, self.kind.max_result_bytes, body)
        final = await answer(call)
        if isinstance(final, UpstreamErrorResponse):
            raise UpstreamError(f"Upstream refused initialize: {final.error.get('message')}")
        result = final.result
        if not isinstance(result.get("protocolVersion"), str):
            raise UpstreamError("Upstream sent an invalid InitializeResult")
        # Both go back upstream as header values on every later request of the session (RFC 9110 §5.5).
        if not is_safe_value(result["protocolVersion"]) or (session_id is not None and not is_safe_value(session_id)):
            raise UpstreamError("Upstream sent a protocol version or session id that cannot be sent back as a header")
        if not self.principal:
            self.kind.auth.saw_anonymous_success()
        self.session_id = session_id
        self.protocol_version = result["protocolVersion"]
        await self.notify("notifications/initialized", None)
        self.initialize_result = result
        self.kind.learned.initialized(result)
        if listen and session_id is not None:  # a stateless upstream has no standalone stream
            await self._listen(session_id)
        log.info("upstream_session_initialized", protocol_version=self.protocol_version, stateful=bool(session_id))
        if self.subscribers.resources:
            # Not awaited here: initialize runs under the session lock, and these requests may need it.
            self.kind.spawn(self.subscribers.resubscribe(), "upstream-resubscribe")

    async def _open_stream(self, last_event_id: str | None) -> aiohttp.ClientResponse:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.kind.config.connect_timeout_seconds)
        headers = checked_headers(await self.stream_headers(last_event_id))
        response = await self.kind.http.get(self.kind.url, headers=headers, timeout=timeout)
        self._keep_cookies(response)
        return response

    async def _listen(self, session_id: str) -> None:
        """Read the session's GET stream (from now on, in the background), each message bounded by
        `limits.max_result_bytes` as any other upstream answer is."""
        self._stop_listening()
        self._get_stream = GetStream(session_id, self._open_stream, self._on_stream, self.kind.max_result_bytes)
        await self._get_stream.start(self.kind.spawn, self.kind.config.connect_timeout_seconds)

    def _stop_listening(self) -> None:
        if self._get_stream is not None:
            self._get_stream.stop()
            self._get_stream = None

    async def _reinitialize(self, stale_session_id: str | None) -> None:
        """A 404 for a request that carried the session id means the upstream forgot the session."""
        async with self._lock:
            # Someone else may have re-initialized already (keep theirs), or forgotten the session (start one).
            if self.session_id == stale_session_id or self.initialize_result is None:
                log.info("upstream_session_expired")
                self.initialize_result = None
                await self.initialize()

    async def adopt(self, session_id: str) -> None:
        """Take over a session an earlier proxy process initialized, which holds a task the upstream still runs:
        no `initialize` (that would start another session), its GET stream opened again. Should the upstream
        have forgotten it, a request answered 404 starts a new session as usual."""
        self._stop_listening()
        self.session_id = session_id
        self.protocol_version = self.kind.config.protocol_version  # tasks exist only from 2025-11-25 on
        self.initialize_result = {}  # initialized, by someone else: its InitializeResult is not known here
        await self._listen(session_id)
        log.info("upstream_session_adopted")

    def detach(self) -> None:
        """Let go of the session without ending it (no DELETE): the upstream keeps it, and the work in it, for
        the next proxy process."""
        self._stop_listening()
        self.session_id = None
        self.initialize_result = None

    async def revive(self) -> None:
        """Start a new session now (not at the next request), so listen streams keep receiving."""
        try:
            await self.ensure_initialized()
        except UpstreamError as exc:
            log.warning("upstream_session_revive_failed", error=exc.message)

    def forget(self, stale_session_id: str) -> None:
        """The upstream no longer knows this session id: the next request initializes a new session."""
        if self.session_id == stale_session_id:
            self._stop_listening()
            self.session_id = None
            self.initialize_result = None

    async def close(self) -> None:
        """End the upstream session with DELETE (the server may answer 405; that is fine); a kept session is only
        let go (`detach`)."""
        self._stop_listening()
        if self.lending.kept:  # holds upstream work a later proxy process resumes: never ended with DELETE
            self.detach()
        if self.session_id is None:
            return
        with contextlib.suppress(*CLIENT_FAILURES, ProxyError):  # (a credential that cannot be made: not ended)
            headers = checked_headers(await self.headers_now())
            async with self.kind.http.delete(self.kind.url, headers=headers, timeout=aiohttp.ClientTimeout(total=2)):
                pass
        self.session_id = None
        self.initialize_result = None

    # --- the GET stream ---------------------------------------------------------------------------------------

    async def _on_stream(self, event: StreamEvent) -> None:
        """Everything on the GET stream of a leased session is its lessee's; on a shared session nobody can tell
        whose a question is, so it is refused (an elicitation is declined). Notifications also reach listen
        subscribers (`Lending`)."""
        if isinstance(event, SessionGone):
            # With listen streams waiting, start a new session now; otherwise the next request does. (Not from
            # the GET stream's task: initializing stops the old reader, i.e. cancels it.)
            self.forget(event.session_id)
            if self.subscribers.subscriptions:
                self.kind.spawn(self.revive(), "upstream-session-revive")
            return
        await self.lending.route(event, self.respond, f"outside a request {STANDALONE_REFUSED}")

    # --- requests ------------------------------------------------------------------------------------------

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Background work of one of this session's requests, owned by the kind (cancelled when it closes)."""
        return self.kind.spawn(coroutine, name)

    async def resume(self, last_event_id: str) -> Answer:
        """Continue a request's SSE stream the upstream closed early (GET + Last-Event-ID)."""
        headers = checked_headers(await self.stream_headers(last_event_id))
        sent_with = self.session_id
        try:
            response = AiohttpAnswer(
                await self.kind.http.get(self.kind.url, headers=headers, timeout=self.kind.timeout)
            )
        except CLIENT_FAILURES as exc:
            raise UpstreamError("Upstream stream could not be resumed", detail=str(exc)) from None
        self._keep_cookies(response)
        if response.status == 200 and response.media_type == "text/event-stream":
            return response
        response.release()
        if response.status == 404 and sent_with is not None:
            self.forget(sent_with)  # the session is gone: the next request initializes a new one
        raise UpstreamError(f"Upstream lost the call: resuming its stream answered HTTP {response.status}")

    @contextlib.asynccontextmanager
    async def call(
        self,
        method: str,
        params: JSON | None,
        extra_headers: Mapping[str, str] | None = None,
        *,
        tool: str | None = None,
    ) -> AsyncIterator[HttpRequestStream]:
        """Send one request upstream; the HttpRequestStream streams what comes back. Leaving the context closes it."""
        await self.ensure_initialized()
        if tool is None and method == "tools/call" and params is not None and isinstance(params.get("name"), str):
            tool = params["name"]
        span = tracing.client_span(method, params, transport="tcp", protocol_version=self.protocol_version)
        with measured(self.kind.metrics, method), span as traced:
            request_id = self.kind.next_id()
            traced.request(request_id, self.session_id)
            message = request_message(request_id, method, traced.params(params, always=False))
            extra_headers = traced.headers(extra_headers)
            for attempt in range(2):
                sent_with = self.session_id
                try:
                    response = await self._post(message, await self.headers_now(extra_headers, tool=tool))
                except asyncio.CancelledError:
                    # Abandoned while the POST was on its way: the upstream may already run it.
                    await asyncio.shield(self._cancel_unanswered(request_id))
                    raise
                if response.status == 404 and sent_with is not None and attempt == 0:
                    response.release()
                    await self._reinitialize(sent_with)
                    continue
                break
            if response.status in AUTH_STATUSES:
                raise self._refused(response, method)
            body: bytes | None = None
            if response.status >= 400:
                body = await _raise_unless_answer(response, request_id, method, self.kind.max_result_bytes)
            upstream_call = HttpRequestStream(self, request_id, method, response, self.kind.max_result_bytes, body)
            self.in_flight += 1
            try:
                yield upstream_call
            finally:
                self.in_flight -= 1
                upstream_call.close()

    def _refused(self, response: Answer, method: str) -> UpstreamAuthError:
        """The upstream refused this session's credential: the caller is told, with the server's challenge."""
        self.kind.auth.saw_refusal()
        challenge = response.headers.get("WWW-Authenticate")
        response.release()
        log.info("upstream_refused_credential", method=method, status=response.status)
        return UpstreamAuthError(response.status, challenge, method)

    async def _cancel_unanswered(self, request_id: int) -> None:
        try:
            await self.notify("notifications/cancelled", {"requestId": request_id, "reason": "request abandoned"})
        except ProxyError as exc:  # (an upstream failure, or a credential that cannot be made now)
            log.info("upstream_cancel_failed", error=exc.message)

    async def notify(self, method: str, params: JSON | None) -> None:
        response = await self._post(notification_message(method, params), await self.headers_now())
        response.release()

    async def respond(self, request_id: RequestId, *, result: JSON | None = None, error: JSON | None = None) -> None:
        """Answer a server→client request (a JSON-RPC response POSTed with the session id)."""
        message = result_message(request_id, result or {}) if error is None else error_message(request_id, error)
        response = await self._post(message, await self.headers_now())
        response.release()


class _Refusal(NamedTuple):
    """An HTTP error status whose body is no JSON-RPC answer to the request: what it said, for the error."""

    raw: str  # the body's start, for the log
    said: str  # ": <the upstream's own JSON-RPC error message>" when it sent one, else ""


async def _answer_despite_status(response: Answer, request_id: int, max_bytes: int | None) -> bytes | _Refusal | None:
    """What an answer with an HTTP error status holds: None for an SSE stream (read as the request's stream),
    the body when it is the JSON-RPC answer to `request_id` (some servers send errors that way: it is read once,
    here, and handed to the request's stream), a `_Refusal` otherwise (the response released)."""
    if response.media_type == "text/event-stream":
        return None
    try:
        body = await read_body(response, max_bytes)
    except EventTooLargeError:
        response.close()
        raise ResultTooLargeError(max_bytes or 0) from None
    except CLIENT_FAILURES as exc:
        response.close()
        raise failure(exc) from None
    said = ""  # the upstream's own JSON-RPC error message, if it sent one: the client may see that
    if response.media_type == "application/json":
        try:
            message = json.loads(body)
        except ValueError:
            message = None
        if isinstance(message, dict):
            if message.get("id") == request_id and ("result" in message or "error" in message):
                return body
            error = message.get("error")
            if isinstance(error, dict) and isinstance(error.get("message"), str):
                said = f": {error['message']}"
    response.release()
    return _Refusal(body.decode("utf-8", errors="replace")[:200], said)


async def _raise_unless_answer(response: Answer, request_id: int, method: str, max_bytes: int | None) -> bytes | None:
    """An HTTP error status is fine when its body is the JSON-RPC answer to this request (returned, to be read
    as the request's stream) or an SSE stream (None); anything else (a transport-level refusal) is an
    UpstreamRefusedError naming what it said, an UpstreamSessionGoneError when the status says the upstream does
    not know the session."""
    answer = await _answer_despite_status(response, request_id, max_bytes)
    if not isinstance(answer, _Refusal):
        return answer
    refused = UpstreamSessionGoneError if response.status in SESSION_GONE_STATUSES else UpstreamRefusedError
    raise refused(f"Upstream answered {method} with HTTP {response.status}{answer.said}", response.status, answer.raw)
