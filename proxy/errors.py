"""The ProxyError tree: every error the proxy itself raises towards a client.

Each class carries its JSON-RPC code and HTTP status; `app.py` turns any ProxyError into a response in one
place. Upstream JSON-RPC errors are data and never become ProxyErrors. Imports only the wire's field checks.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from mcp_types import jsonrpc

from proxy.wire.fields import check_fields

RequestId = int | str


class ProxyError(Exception):
    code: ClassVar[int] = jsonrpc.INTERNAL_ERROR
    http_status: ClassVar[int] = 500
    default_message: ClassVar[str] = "Internal error"
    headers: ClassVar[Mapping[str, str]] = {}

    def __init__(
        self,
        message: str | None = None,
        *,
        data: Any = None,
        request_id: RequestId | None = None,
        http_status: int | None = None,
        detail: str | None = None,
    ) -> None:
        self.message = message or self.default_message
        self.data = data
        self.detail = detail  # for the proxy's log only (addresses, paths, what a library said): never sent
        self.request_id = request_id
        self.status = http_status if http_status is not None else self.http_status
        super().__init__(self.message)

    def response_headers(self) -> Mapping[str, str]:
        """Headers of the HTTP answer that carries this error."""
        return self.headers

    def error_object(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


class ParseError(ProxyError):
    code = jsonrpc.PARSE_ERROR
    http_status = 400
    default_message = "Parse error: the body is not valid JSON"


class InvalidRequestError(ProxyError):
    code = jsonrpc.INVALID_REQUEST
    http_status = 400
    default_message = "Invalid Request"


class MethodNotFoundError(ProxyError):
    code = jsonrpc.METHOD_NOT_FOUND
    http_status = 404  # Unknown and removed methods are HTTP 404 + -32601 on the modern path (Streamable HTTP).
    default_message = "Method not found"


class InvalidParamsError(ProxyError):
    code = jsonrpc.INVALID_PARAMS
    http_status = 400  # A malformed request (e.g. missing required _meta) is HTTP 400.
    default_message = "Invalid params"


class HeaderMismatchError(ProxyError):
    code = jsonrpc.HEADER_MISMATCH
    http_status = 400  # A routing header missing, invalid or unequal to the body (Streamable HTTP: server validation).
    default_message = "Header mismatch"


class MissingCapabilityError(ProxyError):
    """The client did not declare a capability this request needs; `data.requiredCapabilities` is a
    ClientCapabilities object naming it (keyed by capability, not a list)."""

    code = jsonrpc.MISSING_REQUIRED_CLIENT_CAPABILITY
    http_status = 400
    default_message = "Missing required client capability"

    def __init__(
        self, required: dict[str, Any], message: str | None = None, *, request_id: RequestId | None = None
    ) -> None:
        super().__init__(message, data={"requiredCapabilities": required}, request_id=request_id)


class UnsupportedVersionError(ProxyError):
    code = jsonrpc.UNSUPPORTED_PROTOCOL_VERSION
    http_status = 400  # The answer lists the versions served (`data.supported`) and the one asked for.
    default_message = "Unsupported protocol version"

    def __init__(self, requested: Any, supported: list[str], *, request_id: RequestId | None = None) -> None:
        super().__init__(
            f"Unsupported protocol version: {requested!r}; supported: {', '.join(supported)}",
            data={"supported": supported, "requested": requested},
            request_id=request_id,
        )


class UnauthorizedError(ProxyError):
    """A request without the principal header where `security.anonymous: refuse` (HTTP 401)."""

    code = jsonrpc.INVALID_REQUEST
    http_status = 401
    default_message = "Unauthorized"
    headers: ClassVar[Mapping[str, str]] = {"WWW-Authenticate": 'Bearer realm="mcp-tasks-proxy"'}


class ForbiddenError(ProxyError):
    """Host or Origin not allowed (DNS-rebinding protection; an invalid Origin is HTTP 403)."""

    code = jsonrpc.INVALID_REQUEST
    http_status = 403
    default_message = "Forbidden"


class MethodNotAllowedError(ProxyError):
    """GET and DELETE have no meaning for a 2026-07-28 client: it has no GET stream and no session to end."""

    code = jsonrpc.INVALID_REQUEST
    http_status = 405
    default_message = "Method Not Allowed: 2026-07-28 clients use POST only"
    headers: ClassVar[Mapping[str, str]] = {"Allow": "POST"}


class PayloadTooLargeError(ProxyError):
    code = jsonrpc.INVALID_REQUEST
    http_status = 413
    default_message = "Request body too large"


class BodyTimeoutError(ProxyError):
    """The request body did not arrive within `security.body_read_timeout_seconds`. The connection is closed
    after the answer: what is left of the body is never read as a next request."""

    code = jsonrpc.INVALID_REQUEST
    http_status = 408
    default_message = "Request body not received in time"
    headers: ClassVar[Mapping[str, str]] = {"Connection": "close"}


class UpstreamError(ProxyError):
    """The upstream could not be reached or broke the protocol: the proxy answers as a gateway."""

    code = jsonrpc.INTERNAL_ERROR
    http_status = 502
    default_message = "Upstream MCP server unavailable"


class UpstreamUnreachableError(UpstreamError):
    """The upstream could not be reached at all: no connection, or a stdio server that cannot be started now."""


class UpstreamRequestInvalidError(UpstreamError):
    """A request the proxy refused to write upstream: a header name or value, or the request target, would not
    be valid on the wire (a CR, LF, NUL or other control character, a name that is not a token; RFC 9110 §5.5,
    RFC 9112 §3.2). Nothing of it was sent. The value came with the request, so the caller is told (-32602,
    HTTP 400); the message names the header, never its value."""

    code = jsonrpc.INVALID_PARAMS
    http_status = 400
    default_message = "Request not sent upstream: a header or the request target is not valid HTTP"


class UpstreamRefusedError(UpstreamError):
    """The upstream refused a request at the transport level, with no JSON-RPC answer (an HTTP error status);
    `upstream_status` is that status, for logs only: callers tell refusals apart by their class."""

    def __init__(self, message: str, upstream_status: int, detail: str | None = None) -> None:
        super().__init__(message, detail=detail)
        self.upstream_status = upstream_status


class UpstreamSessionGoneError(UpstreamRefusedError):
    """The upstream no longer knows the session (or the task) a request named: it refused it as unknown (HTTP
    400, 404 or 410). Work that lived in that session is lost."""


class UpstreamAuthError(UpstreamRefusedError):
    """The upstream refused the caller's credential: HTTP 401 (none, expired or invalid) or 403 (e.g.
    `insufficient_scope`, for step-up authorization). A modern client gets the same status with the upstream's
    `WWW-Authenticate`, so it can run the authorization flow the server asks for; never a 5xx. The header is
    the server's challenge (realm, scope, resource_metadata, error): it names no credential of the caller."""

    code = jsonrpc.INVALID_REQUEST

    def __init__(self, upstream_status: int, www_authenticate: str | None, method: str = "initialize") -> None:
        what = "Unauthorized" if upstream_status == 401 else "Forbidden"
        super().__init__(
            f"{what}: the upstream MCP server refused the credential of this request ({method}: HTTP "
            f"{upstream_status}); authorize with the server named in WWW-Authenticate and send the request again",
            upstream_status,
        )
        self.status = upstream_status
        self.www_authenticate = www_authenticate
        self.data = {"upstreamStatus": upstream_status}

    def response_headers(self) -> Mapping[str, str]:
        return {"WWW-Authenticate": self.www_authenticate} if self.www_authenticate else {}


AUTH_STATUSES = frozenset({401, 403})  # the upstream statuses that are an UpstreamAuthError


class CredentialRefusedError(UnauthorizedError):
    """No upstream credential can be made for the caller, because of the caller (`upstream.credentials`): the
    token endpoint refused the exchange for the caller's token (`invalid_grant`, `invalid_request`,
    `invalid_target`, `invalid_scope`: the endpoint's `error` is in `data.error`), or a task's credential can no
    longer be renewed (its refresh token was refused, or the endpoint gave none). HTTP 401 with a Bearer
    challenge: the caller authorizes again. A task that meets it fails with this message. Names no token."""

    def __init__(self, message: str, error: str | None = None) -> None:
        super().__init__(message, data={"error": error} if error is not None else None)

    def response_headers(self) -> Mapping[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="mcp-tasks-proxy", error="invalid_token"'}


class NoCredentialError(ForbiddenError):
    """`upstream.credentials: secrets` has no entry for this verified caller: HTTP 403, before anything reaches
    the upstream (never a shared or forwarded credential instead)."""

    default_message = (
        "Forbidden: no upstream credential is configured for this caller (upstream.credentials.secrets); ask the "
        "operator to add one"
    )


# What fails a task whose credential can no longer be made for its caller (a poll meeting it does not poll again).
CALLER_CREDENTIAL_ERRORS: Final = (CredentialRefusedError, NoCredentialError)


class CredentialUnavailableError(UpstreamError):
    """The token endpoint cannot make the caller's upstream credential now, for a reason that is not the
    caller's: it is down, slow or answers 5xx, or it refused the proxy's own client (`invalid_client`,
    `unauthorized_client`). HTTP 503 with `Retry-After`; logged at error level where it happens. Never answered by
    forwarding the caller's token instead. A task's poll meeting it polls again later."""

    http_status = 503
    default_message = "Service unavailable: the upstream credential could not be obtained from the token endpoint"

    def __init__(self, message: str | None = None, *, retry_after_seconds: int = 5, detail: str | None = None) -> None:
        super().__init__(message, detail=detail, data={"reason": "token_endpoint"})
        self.retry_after_seconds = retry_after_seconds

    def response_headers(self) -> Mapping[str, str]:
        return {"Retry-After": str(self.retry_after_seconds)}


class ResultTooLargeError(UpstreamError):
    """An upstream answer (or one message on an upstream stream) is larger than `limits.max_result_bytes`: it is
    never held whole, and the caller is told which limit stopped it."""

    def __init__(self, maximum: int, outcome: str = "the call was cancelled") -> None:
        super().__init__(
            f"Upstream answer larger than limits.max_result_bytes ({maximum} bytes); {outcome}",
            data={"limit": "max_result_bytes", "max": maximum},
        )


class UpstreamTimeoutError(UpstreamError):
    http_status = 504
    default_message = "Upstream MCP server timed out"


class TaskLimitError(ProxyError):
    """A limit of the proxy (`tasks.max_running`, `tasks.max_records`, `inputs.max_parked`, `inputs.max_waiting`,
    listen streams, the descriptor budget) is reached: refused before anything is stored or sent upstream.

    -32603 with `data.limit` naming the limit; HTTP 503 with `Retry-After` (RFC 9110 §10.2.3) because the
    condition is temporary: the client, or a balancer, may send the request again then (or elsewhere)."""

    code = jsonrpc.INTERNAL_ERROR
    http_status = 503
    default_message = "Task limit reached"

    def __init__(
        self, limit: str, maximum: int, *, request_id: RequestId | None = None, retry_after_seconds: int = 1
    ) -> None:
        super().__init__(
            f"Limit reached: {limit} = {maximum}; try again later",
            data={"limit": limit, "max": maximum},
            request_id=request_id,
        )
        self.retry_after_seconds = retry_after_seconds

    def response_headers(self) -> Mapping[str, str]:
        return {"Retry-After": str(self.retry_after_seconds)}


class CallerLimitError(TaskLimitError):
    """One caller's share of a limit is used up (`limits.*_per_principal`): HTTP 429, the others go on."""

    http_status = 429


def http_status(error: ProxyError | Mapping[str, Any] | None) -> int:
    """The one rule for the HTTP status of a modern answer. A result (no error) is 200. A ProxyError has its
    class's status: 400 for a bad request, 404 for an unknown method, 502/504 as a gateway, 503 at a limit. A
    JSON-RPC error relayed from the upstream is 200 (the request was served; the error is its answer), except
    -32601: a method the upstream does not implement, the proxy does not either, and unknown methods are 404."""
    if error is None:
        return 200
    if isinstance(error, ProxyError):
        return error.status
    return MethodNotFoundError.http_status if error.get("code") == MethodNotFoundError.code else 200


class UpstreamLimitError(ProxyError):
    """Every upstream session the configuration allows is busy (`upstream.max_processes` stdio server processes,
    `upstream.max_open_sessions` HTTP sessions) and none came free in time, or none is free for a new call.
    -32603 with `data.limit`, HTTP 503 with `Retry-After`: the condition is temporary."""

    code = jsonrpc.INTERNAL_ERROR
    http_status = 503
    default_message = "Upstream limit reached"

    def __init__(self, limit: str, maximum: int, waited_seconds: float) -> None:
        what = f"all busy for {waited_seconds:g} s" if waited_seconds else "all in use"
        super().__init__(
            f"Limit reached: {limit} = {maximum}, {what}; try again later",
            data={"limit": limit.rpartition(".")[2], "max": maximum},
        )

    def response_headers(self) -> Mapping[str, str]:
        return {"Retry-After": "1"}


class DrainingError(ProxyError):
    """A new call reached a replica that drains after SIGTERM (a balancer's endpoint list is a moment behind):
    -32603 with `data.reason: draining`, HTTP 503 and `Retry-After`, so the client or the balancer sends it to
    another replica. Nothing was started or stored."""

    code = jsonrpc.INTERNAL_ERROR
    http_status = 503
    default_message = "This proxy replica is shutting down; send the request again (another replica serves it)"
    headers: ClassVar[Mapping[str, str]] = {"Retry-After": "1"}

    def __init__(self, *, request_id: RequestId | None = None) -> None:
        super().__init__(data={"reason": "draining"}, request_id=request_id)


class QueueTimeoutError(UpstreamLimitError):
    """A synchronous call waited its whole `upstream.max_queue_wait_ms` for an upstream slot
    (`upstream.max_concurrent_calls`) and never reached the upstream: -32603 with `data.limit`, HTTP 503 with
    `Retry-After` (RFC 9110 §10.2.3) and `data.retryAfterMs`: the upstream is busy, which is temporary."""

    def __init__(
        self, maximum: int, waited_ms: int, retry_after_seconds: int, limit: str = "upstream.max_concurrent_calls"
    ) -> None:
        super().__init__(limit, maximum, waited_ms / 1000)
        self.data = {**self.data, "retryAfterMs": retry_after_seconds * 1000}
        self.retry_after_seconds = retry_after_seconds

    def response_headers(self) -> Mapping[str, str]:
        return {"Retry-After": str(self.retry_after_seconds)}


class RateLimitedError(CallerLimitError):
    """A caller used up its calls of the current window (`limits.calls_per_minute_per_principal`, or a tool's
    `tasks.tools.<key>.calls_per_minute_per_principal`): HTTP 429 with `Retry-After` (RFC 9110 §10.2.3) and the
    `RateLimit-Policy` / `RateLimit` fields of draft-ietf-httpapi-ratelimit-headers, one item per quota that
    applies to the call (the global one, named `calls`; a tool's, named `tool:<key>`), each with what is left of
    it; the JSON-RPC error carries `data.retryAfterMs` as the draft SEP "Standardize Rate-Limiting Errors"
    proposes, with the code of every other limit (-32603): the -32020…-32099 range is the specification's, and
    it defines no rate-limit code yet."""

    POLICY: ClassVar[str] = "calls"  # the global quota's name in both fields

    def __init__(
        self,
        limit: str,
        maximum: int,
        window_seconds: int,
        retry_after_seconds: int,
        policies: Sequence[RatePolicy] | None = None,
    ) -> None:
        super().__init__(limit, maximum)
        self.data = {"limit": limit, "max": maximum, "retryAfterMs": retry_after_seconds * 1000}
        self.window_seconds = window_seconds
        self.retry_after_seconds = retry_after_seconds
        self.policies = tuple(policies) if policies is not None else (RatePolicy(self.POLICY, maximum, 0),)

    def response_headers(self) -> Mapping[str, str]:
        window, reset = self.window_seconds, self.retry_after_seconds
        headers = {
            "Retry-After": str(reset),
            "RateLimit-Policy": ", ".join(f"{_sf_string(p.name)};q={p.quota};w={window}" for p in self.policies),
            "RateLimit": ", ".join(f"{_sf_string(p.name)};r={p.remaining};t={reset}" for p in self.policies),
        }
        check_fields(headers.items())
        return headers


@dataclass(frozen=True, slots=True)
class RatePolicy:
    """One quota that applies to a call, as the RateLimit fields name it: its quota and what is left of it."""

    name: str
    quota: int
    remaining: int


_SF_STRING_UNSAFE: Final = re.compile(r"[^\x20-\x7e]")


def _sf_string(name: str) -> str:
    """A policy name as an RFC 8941 String: printable ASCII, `\\` and `"` escaped; any other character (a tool
    name may be any text) becomes `?`, so the field stays well formed."""
    printable = _SF_STRING_UNSAFE.sub("?", name)
    return '"' + printable.replace("\\", "\\\\").replace('"', '\\"') + '"'


class TaskStoreUnavailableError(ProxyError):
    """The task store cannot be reached or cannot commit right now (PostgreSQL down, frozen or failing over;
    SQLite's disk full, its file system read-only, an I/O error): a request that needs the store is refused before
    anything reaches the upstream. -32603 with `data.store` naming the backend and `data.reason` the backend's
    word for it, HTTP 503 with `Retry-After` (RFC 9110 §15.6.4, §10.2.3), since the condition is temporary and
    the request may be sent again as it was.

    503 rather than 507 Insufficient Storage (RFC 4918 §11.5) also for a full disk: 507 says the request itself
    needs more room than there is, and clients and load balancers retry 503 alone."""

    code = jsonrpc.INTERNAL_ERROR
    http_status = 503
    default_message = "Internal error: the task store is unavailable; try again later"
    # A restart or a failover takes seconds to minutes: a client retrying every 2 s is served soon after the
    # store is back without flooding it meanwhile.
    headers: ClassVar[Mapping[str, str]] = {"Retry-After": "2"}

    def __init__(
        self, store: str, reason: str, *, detail: str | None = None, request_id: RequestId | None = None
    ) -> None:
        super().__init__(
            f"Internal error: the task store is unavailable ({reason}); try again later",
            data={"store": store, "reason": reason},
            detail=detail,
            request_id=request_id,
        )
