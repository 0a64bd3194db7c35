"""JSON-RPC 2.0 framing: parse one incoming message, build result and error bodies.

SANS-IO: no aiohttp, no asyncio. Messages are kept as plain dicts (a proxy relays fields it does not know);
the envelope types and codes come from `mcp_types.jsonrpc`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.errors import InvalidRequestError, ParseError, RequestId

JSON = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Request:
    id: RequestId
    method: str
    params: JSON | None
    raw: JSON


@dataclass(frozen=True, slots=True)
class Notification:
    method: str
    params: JSON | None
    raw: JSON


@dataclass(frozen=True, slots=True)
class Response:
    """A JSON-RPC response: exactly one of `result` / `error` is set."""

    id: RequestId | None
    result: JSON | None
    error: JSON | None
    raw: JSON


Message = Request | Notification | Response


def loads(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (UnicodeDecodeError, ValueError):
        raise ParseError() from None


def dumps(message: JSON) -> bytes:
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()


def _valid_id(value: Any) -> bool:
    # JSON-RPC allows numbers with fractions; MCP narrows ids to strings and integers (never bool).
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def classify(obj: Any) -> Message:
    """Turn one decoded JSON value into a Request, Notification or Response, or raise InvalidRequestError."""
    if isinstance(obj, list):
        raise InvalidRequestError("Invalid Request: JSON-RPC batches are not supported")
    if not isinstance(obj, dict):
        raise InvalidRequestError("Invalid Request: expected a JSON object")
    raw_id = obj.get("id")
    request_id = raw_id if _valid_id(raw_id) else None
    if obj.get("jsonrpc") != "2.0":
        raise InvalidRequestError('Invalid Request: "jsonrpc" must be "2.0"', request_id=request_id)
    params = obj.get("params")
    if "method" in obj:
        method = obj["method"]
        if not isinstance(method, str) or not method:
            raise InvalidRequestError('Invalid Request: "method" must be a string', request_id=request_id)
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError('Invalid Request: "params" must be an object', request_id=request_id)
        if "id" not in obj:
            return Notification(method, params, obj)
        if request_id is None:
            raise InvalidRequestError('Invalid Request: "id" must be a string or an integer')
        return Request(request_id, method, params, obj)
    if "result" in obj or "error" in obj:
        result, error = obj.get("result"), obj.get("error")
        if ("result" in obj) == ("error" in obj):
            raise InvalidRequestError("Invalid Request: a response has exactly one of result and error")
        if result is not None and not isinstance(result, dict):
            raise InvalidRequestError('Invalid Request: "result" must be an object', request_id=request_id)
        if error is not None and not isinstance(error, dict):
            raise InvalidRequestError('Invalid Request: "error" must be an object', request_id=request_id)
        return Response(request_id, result, error, obj)
    raise InvalidRequestError("Invalid Request: neither a request, a notification nor a response")


def parse(body: bytes) -> Message:
    return classify(loads(body))


def result_message(request_id: RequestId, result: JSON) -> JSON:
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def error_message(request_id: RequestId | None, error: JSON) -> JSON:
    """An error response; `id` is left out (not null) when the request id is unknown, as the schema wants."""
    message: JSON = {"jsonrpc": "2.0", "error": error}
    if request_id is not None:
        message["id"] = request_id
    return message


def request_message(request_id: RequestId, method: str, params: JSON | None = None) -> JSON:
    message: JSON = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return message


def notification_message(method: str, params: JSON | None = None) -> JSON:
    message: JSON = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    return message
