"""What a legacy server says to the proxy, as plain data: the event types (notification, question, result, error),
their one decoder, and the one rule for answering a question no client will see. Sans-IO."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from mcp_types import jsonrpc as codes

from proxy.errors import InvalidRequestError, RequestId, UpstreamError
from proxy.wire.jsonrpc import JSON, Notification, Request, Response, classify, read
from proxy.wire.translate import INPUT_METHODS


@dataclass(frozen=True, slots=True)
class UpstreamNotification:
    message: JSON

    @property
    def method(self) -> str:
        method = self.message.get("method")
        return method if isinstance(method, str) else ""


@dataclass(frozen=True, slots=True)
class UpstreamServerRequest:
    """A server→client request: the upstream waits for the JSON-RPC response with this `id`."""

    id: RequestId
    method: str
    params: JSON | None


@dataclass(frozen=True, slots=True)
class UpstreamResult:
    result: JSON


@dataclass(frozen=True, slots=True)
class UpstreamErrorResponse:
    error: JSON


UpstreamFinal = UpstreamResult | UpstreamErrorResponse
UpstreamEvent = UpstreamNotification | UpstreamServerRequest | UpstreamResult | UpstreamErrorResponse

# An elicitation the proxy cannot relay is declined: a normal answer the tool can act on.
DECLINE: Final[JSON] = {"action": "decline"}


def decode(data: str | bytes, request_id: RequestId | None, during: str) -> UpstreamEvent | None:
    """One JSON-RPC message from an upstream stream as an event. A response is the final event only when it
    answers `request_id` (None: a standalone stream, where no response is expected); other responses, and
    messages that are none of the three kinds, are None. A malformed message is an UpstreamError naming
    `during` (what the proxy was doing)."""
    try:
        message = classify(read(data))
    except ValueError:
        raise UpstreamError(f"Upstream sent a malformed message during {during}") from None
    except InvalidRequestError as exc:
        raise UpstreamError(f"Upstream sent an invalid JSON-RPC message during {during}: {exc}") from None
    if isinstance(message, Request):
        return UpstreamServerRequest(message.id, message.method, message.params)
    if isinstance(message, Notification):
        return UpstreamNotification(message.raw)
    if isinstance(message, Response) and request_id is not None and message.id == request_id:
        if message.error is not None:
            return UpstreamErrorResponse(message.error)
        return UpstreamResult(message.result or {})
    return None


def refusal(method: str, reason: str = "The client cannot answer this request") -> tuple[JSON | None, JSON | None]:
    """How to answer a server→client request that no client will see, so the upstream never waits on it:
    `(result, error)`, exactly one set. An elicitation is declined; sampling and roots get an invalid-request
    error saying why; anything else (a method the proxy does not know) is method-not-found."""
    if method == "elicitation/create":
        return DECLINE, None
    if method in INPUT_METHODS:
        return None, {"code": codes.INVALID_REQUEST, "message": reason}
    return None, {"code": codes.METHOD_NOT_FOUND, "message": f"Method not found: {method}"}
