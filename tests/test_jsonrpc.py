"""wire/jsonrpc.py: classification of incoming messages and the shape of bodies the proxy builds."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.errors import InvalidRequestError, ParseError
from proxy.wire.jsonrpc import (
    MAX_DEPTH,
    Notification,
    RawJSON,
    Request,
    Response,
    classify,
    dumps,
    error_message,
    loads,
    parse,
    read,
)


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


@pytest.mark.parametrize(
    "body",
    [
        b'"\\ud800"',
        b'"\\udfff"',
        b'{"\\udc00": 1}',
        b'["ok", {"a": ["x\\ud83d"]}]',  # a high surrogate whose low half never comes
        b'"\\ude00\\ud83d"',  # both halves, in the wrong order
        b"NaN",
        b"[-Infinity]",
        b"1e999",
        b"[" * 100_000,
        b"\xef\xbb\xbf\xef\xbb\xbf{}",  # one BOM is ignored, not two
        '{"a": 1}'.encode("utf-16"),  # JSON between systems is UTF-8 (RFC 8259 section 8.1)
    ],
)
def test_bodies_that_cannot_be_relayed_as_json_are_a_parse_error(body: bytes) -> None:
    with pytest.raises(ParseError) as caught:
        loads(body)
    assert (caught.value.code, caught.value.status) == (-32700, 400)


@pytest.mark.parametrize(
    ("body", "value"),
    [
        (b'"\\ud83d\\ude00"', "\U0001f600"),  # a surrogate pair is one character
        (b'"\\\\ud800"', "\\ud800"),  # an escaped backslash, then plain text
        (b"10" + b"0" * 400, 10**401),  # big integers are exact
        (b"-0", 0),
        (b"1e308", 1e308),
        (b"\xef\xbb\xbf[]", []),
        # RTL mark, NUL (escaped: raw control characters are not JSON), a noncharacter, an emoji, a combining mark
        ('"\u200f\\u0000\ufffe\U0001f600e\u0301"'.encode(), "\u200f\u0000\ufffe\U0001f600e\u0301"),
    ],
)
def test_sound_bodies_decode(body: bytes, value: object) -> None:
    assert loads(body) == value


def test_nesting_is_refused_one_level_past_the_limit() -> None:
    assert loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH) is not None
    assert loads(b'{"a":' * MAX_DEPTH + b"0" + b"}" * MAX_DEPTH) is not None
    with pytest.raises(ParseError):
        loads(b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1))
    with pytest.raises(ParseError):
        loads(b'{"a":' * (MAX_DEPTH + 1) + b"0" + b"}" * (MAX_DEPTH + 1))


def test_dumps_escapes_a_lone_surrogate_instead_of_failing() -> None:
    assert dumps({"text": "a\ud800\u00e9"}) == b'{"text":"a\\ud800\\u00e9"}'
    assert dumps({"text": "\u00e9"}) == '{"text":"\u00e9"}'.encode()


def test_dumps_splices_raw_json_text_as_it_is() -> None:
    """A stored result is sent as the text it was stored as (here with a form re-encoding would change)."""
    first, second = RawJSON('{"n":1e2,"s":"\\u00e9"}'), RawJSON("{}")
    message = {"id": 1, "result": {"a": first, "b": [second, first], "c": "\u00e9"}}
    assert (
        dumps(message)
        == '{"id":1,"result":{"a":{"n":1e2,"s":"\\u00e9"},"b":[{},{"n":1e2,"s":"\\u00e9"}],"c":"\u00e9"}}'.encode()
    )
    assert json.loads(dumps(message))["result"]["b"][1] == first.value() == {"n": 100.0, "s": "\u00e9"}


def test_dumps_leaves_strings_that_look_like_its_marks_alone() -> None:
    """What a client sends can never be taken for a place where raw text goes."""
    lookalikes = ["\x00raw-json:0", "\x00raw-json::0", "raw-json", '"\\u0000raw-json:"']
    message = {"echo": lookalikes, "raw": RawJSON('{"x":1}')}
    assert json.loads(dumps(message)) == {"echo": lookalikes, "raw": {"x": 1}}


def test_dumps_with_raw_json_and_a_lone_surrogate() -> None:
    assert dumps({"t": "\ud800", "r": RawJSON('{"y":2}')}) == b'{"t":"\\ud800","r":{"y":2}}'


def test_dumps_still_refuses_what_is_not_json() -> None:
    with pytest.raises(TypeError):
        dumps({"x": object()})


@pytest.mark.parametrize("number", [2**63, 2**64, 2**70, -(2**63) - 1, -(2**80), 10**30])
def test_integers_past_64_bits_are_read_and_written_whole(number: int) -> None:
    """Ids and values of any size keep every digit both ways, from a client and from an upstream (a fast JSON
    library reads some of them as floats: those take the standard library's path)."""
    text = f'{{"jsonrpc":"2.0","id":1,"result":{{"n":{number}}}}}'.encode()
    assert loads(text)["result"]["n"] == number
    assert read(text)["result"]["n"] == number
    assert dumps({"n": number, "s": "é"}) == f'{{"n":{number},"s":"é"}}'.encode()


def test_what_an_upstream_sends_is_read_as_the_standard_library_reads_it() -> None:
    """An upstream's text with a NaN or a lone surrogate is still read (relayed as it is, not refused); a NaN is
    written back as null, which JSON has, and a lone surrogate as its escape."""
    assert read('{"a":"\\ud800","b":[1,2.5,"é"]}') == {"a": "\ud800", "b": [1, 2.5, "é"]}
    value = read(b'{"x":NaN}')["x"]
    assert value != value  # NaN
    assert dumps({"x": value}) == b'{"x":null}'
    with pytest.raises(json.JSONDecodeError, match="Expecting value"):
        read(b'{"a":')


def test_dumps_refuses_what_is_not_json() -> None:
    """A value that is not JSON (a bug) fails loudly, as with the standard library, instead of being written in
    some form of a library's choosing."""
    import dataclasses
    import datetime

    @dataclasses.dataclass
    class Point:
        x: int

    for value in (Point(1), datetime.datetime(2026, 1, 1), {1, 2}):
        with pytest.raises(TypeError):
            dumps({"v": value})
