"""What may be written as an HTTP header name, value or request target (RFC 9110 §5.1, §5.5; RFC 9112 §3.2)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire import fields
from proxy.wire.fields import (
    FieldError,
    check_field,
    check_fields,
    check_name,
    check_target,
    check_value,
    is_safe_value,
)


@pytest.mark.parametrize("name", ["Authorization", "x-request-id", "Mcp-Session-Id", "a!#$%&'*+-.^_`|~1"])
def test_a_token_is_a_valid_header_name(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["", "X Injected", "X:Y", "X\r\nY", "X\nY", "X\0", "Ärger", "(x)", "x/y"])
def test_a_name_that_is_not_a_token_is_refused(name: str) -> None:
    with pytest.raises(FieldError):
        check_name(name)


@pytest.mark.parametrize("value", ["", "x", "Bearer abc.def", "a\tb", "a  b", "caf\u00e9", "\u4e2d\u6587", "!~"])
def test_visible_characters_spaces_and_tabs_inside_are_a_valid_value(value: str) -> None:
    assert check_value("X", value) == value
    assert is_safe_value(value)


@pytest.mark.parametrize(
    "value",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nX-Injected: yes",
        "a\nb",
        "a\rb",
        "a\0b",
        "a\x01b",
        "a\x7fb",
        "a\x1bb",
        " leading",
        "trailing ",
        "\ttab-first",
        "x\r\n\r\nPOST /mcp HTTP/1.1\r\nHost: upstream",
    ],
)
def test_control_characters_and_surrounding_whitespace_are_refused(value: str) -> None:
    with pytest.raises(FieldError) as raised:
        check_value("traceparent", value)
    assert "traceparent" in str(raised.value)
    assert value.strip() not in str(raised.value)  # the message never carries the value (it may be a secret)
    assert not is_safe_value(value)


def test_check_field_checks_both_halves() -> None:
    check_field("X-Ok", "fine")
    with pytest.raises(FieldError):
        check_field("X Bad", "fine")
    with pytest.raises(FieldError):
        check_field("X-Ok", "bad\n")


@pytest.mark.parametrize("target", ["/", "/mcp", "/mcp?x=1&y=%20", "/a/b;c"])
def test_an_origin_form_target_is_valid(target: str) -> None:
    assert check_target(target) == target


@pytest.mark.parametrize("target", ["", "mcp", "/mcp HTTP/1.1", "/m\r\ncp", "/\x00", "/caf\u00e9", "http://x/"])
def test_a_target_with_spaces_controls_or_no_leading_slash_is_refused(target: str) -> None:
    with pytest.raises(FieldError):
        check_target(target)


@settings(max_examples=2000)
@given(st.text() | st.text(st.characters(max_codepoint=0xFF)))
def test_the_fast_path_and_the_expression_agree_on_every_value(value: str) -> None:
    """`is_safe_value` takes a shortcut for printable text; it must accept exactly what the expression accepts."""
    assert is_safe_value(value) is (fields._VALUE.fullmatch(value) is not None)


_PIECES = st.text(alphabet=st.sampled_from(["a", "B", "-", ":", " ", "\t", "\n", "\r", "\x00", "\x01", "é", "\x7f"]))


def _valid(name: str, value: str) -> bool:
    try:
        check_field(name, value)
    except FieldError:
        return False
    return True


@given(st.lists(st.tuples(_PIECES, _PIECES), max_size=6))
def test_check_fields_refuses_a_block_exactly_when_one_of_its_fields_is_refused(fields: list[tuple[str, str]]) -> None:
    """The one-pass check of a whole block says what each field's own check says, even for values holding the
    block's separators (NUL, LF)."""
    if all(_valid(name, value) for name, value in fields):
        check_fields(fields)
    else:
        with pytest.raises(FieldError):
            check_fields(fields)


def test_a_value_holding_what_looks_like_a_second_field_is_refused() -> None:
    check_fields([("Accept", "application/json"), ("X-Key", "a\tb")])
    with pytest.raises(FieldError, match="X-Key"):
        check_fields([("Accept", "application/json"), ("X-Key", "b\nc\x00d")])
