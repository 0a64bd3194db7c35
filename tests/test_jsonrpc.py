"""wire/jsonrpc.py: classification of incoming messages and the shape of bodies the proxy builds."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.errors import InvalidRequestError, ParseError
from proxy.wire.jsonrpc import Notification, Request, Response, classify, error_message, parse


def test_request_notification_and_response_are_told_apart() -> None:
    request = classify({"jsonrpc": "2.0", "id": 7, "method": "tools/list", "params": {}})
    assert isinstance(request, Request)
    assert (request.id, request.method, request.params) == (7, "tools/list", {})
    notification = classify({"jsonrpc": "2.0", "method": "notifications/initialized"})
    assert isinstance(notification, Notification)
    response = classify({"jsonrpc": "2.0", "id": "a", "result": {"x": 1}})
    assert isinstance(response, Response)
    assert response.result == {"x": 1}
    assert response.error is None


def test_string_ids_survive() -> None:
    request = classify({"jsonrpc": "2.0", "id": "req-1", "method": "m"})
    assert isinstance(request, Request)
    assert request.id == "req-1"


@pytest.mark.parametrize(
    "body",
    [
        [],
        [{"jsonrpc": "2.0", "id": 1, "method": "tools/list"}],
        "text",
        42,
        {"id": 1, "method": "tools/list"},
        {"jsonrpc": "1.0", "id": 1, "method": "tools/list"},
        {"jsonrpc": "2.0", "id": 1, "method": 5},
        {"jsonrpc": "2.0", "id": 1, "method": ""},
        {"jsonrpc": "2.0", "id": 1.5, "method": "m"},
        {"jsonrpc": "2.0", "id": True, "method": "m"},
        {"jsonrpc": "2.0", "id": None, "method": "m"},
        {"jsonrpc": "2.0", "id": 1, "method": "m", "params": [1, 2]},
        {"jsonrpc": "2.0", "id": 1},
        {"jsonrpc": "2.0", "id": 1, "result": {}, "error": {"code": 1, "message": "x"}},
        {"jsonrpc": "2.0", "id": 1, "result": "scalar"},
    ],
)
def test_invalid_messages_raise_invalid_request(body: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        classify(body)
    assert caught.value.code == -32600
    assert caught.value.status == 400


def test_invalid_request_keeps_a_usable_id() -> None:
    with pytest.raises(InvalidRequestError) as caught:
        classify({"jsonrpc": "2.0", "id": 9, "method": "m", "params": "x"})
    assert caught.value.request_id == 9


@pytest.mark.parametrize("body", [b"{", b"\xff\xfe", b"", b"{'single': 1}"])
def test_bad_json_is_a_parse_error(body: bytes) -> None:
    with pytest.raises(ParseError) as caught:
        parse(body)
    assert caught.value.code == -32700


def test_error_message_leaves_out_an_unknown_id() -> None:
    assert "id" not in error_message(None, {"code": -32700, "message": "x"})
    assert error_message(0, {"code": -32700, "message": "x"})["id"] == 0
