"""errors.py and the error edge: the contract of the JSON-RPC error shape, pinned for every ProxyError class."""

from __future__ import annotations

import json

import pytest

from proxy.edge._error_edge import error_response
from proxy.errors import (
    ForbiddenError,
    HeaderMismatchError,
    InvalidParamsError,
    InvalidRequestError,
    MethodNotAllowedError,
    MethodNotFoundError,
    MissingCapabilityError,
    ParseError,
    PayloadTooLargeError,
    ProxyError,
    UnsupportedVersionError,
    UpstreamError,
    UpstreamTimeoutError,
)
from tests.support.schemas import ModernSchema

CASES: list[tuple[ProxyError, int, int]] = [
    (ParseError(), -32700, 400),
    (InvalidRequestError(request_id=1), -32600, 400),
    (MethodNotFoundError(request_id="a"), -32601, 404),
    (InvalidParamsError(request_id=2), -32602, 400),
    (HeaderMismatchError(request_id=3), -32020, 400),
    (MissingCapabilityError({"sampling": {}}, request_id=4), -32021, 400),
    (UnsupportedVersionError("v9", ["2026-07-28"], request_id=5), -32022, 400),
    (ForbiddenError(), -32600, 403),
    (MethodNotAllowedError(), -32600, 405),
    (PayloadTooLargeError(), -32600, 413),
    (UpstreamError(request_id=6), -32603, 502),
    (UpstreamTimeoutError(request_id=7), -32603, 504),
]


@pytest.mark.parametrize(("error", "code", "status"), CASES)
def test_error_body_and_status(error: ProxyError, code: int, status: int, modern_schema: ModernSchema) -> None:
    response = error_response(error)
    assert response.status == status
    assert response.body is not None
    body = response.body if isinstance(response.body, bytes) else b""
    message = json.loads(body)
    modern_schema.validate(message, "JSONRPCErrorResponse")
    assert message["error"]["code"] == code
    assert message["error"]["message"]
    if error.request_id is None:
        assert "id" not in message
    else:
        assert message["id"] == error.request_id


def test_missing_capability_data_is_a_client_capabilities_object() -> None:
    """`data.requiredCapabilities` is keyed by capability, not a list."""
    error = MissingCapabilityError({"extensions": {"io.modelcontextprotocol/tasks": {}}})
    assert error.error_object()["data"] == {
        "requiredCapabilities": {"extensions": {"io.modelcontextprotocol/tasks": {}}}
    }


def test_unsupported_version_data() -> None:
    assert UnsupportedVersionError("x", ["2026-07-28"]).data == {"supported": ["2026-07-28"], "requested": "x"}
