"""The W3C trace-context parser: `traceparent`/`tracestate` by W3C Trace Context Level 1
(https://www.w3.org/TR/trace-context/), `baggage` by W3C Baggage (https://www.w3.org/TR/baggage/), and the
property that matters most: whatever goes in, what comes out is safe to write as an HTTP header value.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire import trace_context
from proxy.wire.fields import is_safe_value
from proxy.wire.trace_context import (
    MAX_BAGGAGE_BYTES,
    MAX_BAGGAGE_MEMBERS,
    MAX_TRACESTATE_CHARS,
    MAX_TRACESTATE_MEMBERS,
    parse_baggage,
    parse_traceparent,
    parse_tracestate,
    parsed,
)

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"  # Trace Context §3.2.2 example
SMUGGLED = "\r\n\r\nPOST /mcp HTTP/1.1\r\nHost: upstream\r\nContent-Length: 2\r\n\r\n{}"
CONTROL_SUFFIXES = ("\r\nX-Injected: yes", "\nX-Injected: yes", "\rX-Injected: yes", "\x00", SMUGGLED)

lower_hex = st.text(alphabet="0123456789abcdef", min_size=1, max_size=1)


def hex_digits(count: int) -> st.SearchStrategy[str]:
    return st.text(alphabet="0123456789abcdef", min_size=count, max_size=count)


traceparents = st.builds(
    lambda trace_id, parent_id, flags: f"00-{trace_id}-{parent_id}-{flags}",
    hex_digits(32).filter(lambda value: value != "0" * 32),
    hex_digits(16).filter(lambda value: value != "0" * 16),
    hex_digits(2),
)

# Trace Context §3.3.1.3: simple keys, and tenant@system keys
_KEY_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_-*/"
simple_keys = st.builds(
    lambda first, rest: first + rest,
    st.sampled_from("abcdefghijklmnopqrstuvwxyz"),
    st.text(alphabet=_KEY_CHARS, max_size=20),
)
tenant_keys = st.builds(
    lambda tenant, system: f"{tenant}@{system}",
    st.text(alphabet=_KEY_CHARS, min_size=1, max_size=10).filter(lambda tenant: tenant[0] not in "_-*/"),
    st.builds(
        lambda first, rest: first + rest,
        st.sampled_from("abcdefghijklmnopqrstuvwxyz"),
        st.text(_KEY_CHARS, max_size=13),
    ),
)
_NBLK = "".join(chr(code) for code in range(0x21, 0x7F) if chr(code) not in ",=")
tracestate_values = st.builds(
    lambda body, last: body + last, st.text(alphabet=_NBLK + " ", max_size=30), st.sampled_from(_NBLK)
)

# W3C Baggage §3.2.1
_TCHAR = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_BAGGAGE_OCTETS = "".join(chr(code) for code in range(0x21, 0x7F) if chr(code) not in '",;\\')
baggage_members = st.builds(
    lambda key, value, properties: f"{key}={value}" + "".join(f";{prop}" for prop in properties),
    st.text(alphabet=_TCHAR, min_size=1, max_size=12),
    st.text(alphabet=_BAGGAGE_OCTETS, max_size=20),
    st.lists(st.text(alphabet=_TCHAR, min_size=1, max_size=8), max_size=2),
)


# --- traceparent (Trace Context §3.2) ---------------------------------------------------------------------


def test_a_version_00_traceparent_is_kept_as_it_is() -> None:
    assert parse_traceparent(VALID) == VALID
    assert parse_traceparent(VALID[:-2] + "00") == VALID[:-2] + "00"  # not sampled
    assert parse_traceparent(VALID[:-2] + "ff") == VALID[:-2] + "ff"  # unknown flags are kept (§3.2.2.5)


@pytest.mark.parametrize(
    "value",
    [
        "",
        VALID.upper(),  # §3.2.2: HEXDIGLC, lowercase only
        VALID.replace("4bf9", "4BF9"),
        "ff" + VALID[2:],  # §3.2.2.1: version ff is invalid
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # §3.2.2.3: all-zero trace-id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # §3.2.2.4: all-zero parent-id
        VALID + "-extra",  # version 00 is exactly 55 characters
        VALID[:-1],
        " " + VALID,
        VALID + " ",
        VALID.replace("-", "_"),
        "00-4bf92f3577b34da6a3ce929d0e0e473-600f067aa0ba902b7-01",  # the dashes in the wrong places
        "0g" + VALID[2:],
    ],
)
def test_a_traceparent_out_of_the_grammar_is_dropped(value: str) -> None:
    assert parse_traceparent(value) is None


@pytest.mark.parametrize("suffix", CONTROL_SUFFIXES)
def test_a_traceparent_with_a_line_break_or_a_second_request_after_it_is_dropped(suffix: str) -> None:
    assert parse_traceparent(VALID + suffix) is None


def test_a_higher_version_is_read_by_the_fields_of_version_00_and_what_follows_is_not_forwarded() -> None:
    """Trace Context §3.2.4: parse trace-id, parent-id and flags of a higher version; what follows them must
    start with a dash."""
    future = "cc" + VALID[2:]
    assert parse_traceparent(future) == future
    assert parse_traceparent(future + "-what-comes-next") == future
    assert parse_traceparent(future + "-\r\nX-Injected: yes") == future
    assert parse_traceparent(future + "x") is None
    assert parse_traceparent(future[:54]) is None  # shorter than 55 characters


@given(traceparents)
def test_every_traceparent_of_the_grammar_is_kept(value: str) -> None:
    assert parse_traceparent(value) == value


@given(traceparents, st.text(min_size=1))
def test_nothing_can_follow_a_version_00_traceparent(value: str, suffix: str) -> None:
    assert parse_traceparent(value + suffix) is None


# --- tracestate (Trace Context §3.3) ------------------------------------------------------------------------


def test_a_tracestate_is_kept_without_its_optional_whitespace_and_empty_members() -> None:
    assert parse_tracestate("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE") == "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
    assert parse_tracestate(" rojo=1 ,\tcongo=2 ,, ") == "rojo=1,congo=2"  # §3.3.1.1: OWS, empty members
    assert parse_tracestate("rojo=trailing ") == "rojo=trailing"  # a trailing space is OWS, not the value's
    assert parse_tracestate("fw529a3039@dt=a b") == "fw529a3039@dt=a b"  # a tenant key; a space inside a value


@pytest.mark.parametrize(
    "value",
    [
        "",
        " , ",
        "Rojo=1",  # keys are lowercase
        "1abc=1",  # a simple key starts with a letter
        "rojo",  # no value
        "rojo=",  # a value has at least one character
        "rojo=a,b",  # `,` ends a member: `b` is not one
        "rojo=a=b",  # `=` is not a value character
        "rojo=1,rojo=2",  # keys are unique
        "rojo=\x7f",
        "t@" + "s" * 15 + "=1",  # a system id has at most 14 characters
        "a" * 257 + "=1",  # a simple key has at most 256 characters
        "rojo=" + "v" * 257,  # a value has at most 256 characters
        ",".join(f"k{index}=v" for index in range(MAX_TRACESTATE_MEMBERS + 1)),  # at most 32 members
    ],
)
def test_a_tracestate_out_of_the_grammar_is_dropped_whole(value: str) -> None:
    assert parse_tracestate(value) is None


@pytest.mark.parametrize("suffix", CONTROL_SUFFIXES)
def test_a_tracestate_with_a_line_break_or_a_second_request_in_it_is_dropped(suffix: str) -> None:
    assert parse_tracestate("rojo=00f067aa0ba902b7" + suffix) is None


def test_a_long_tracestate_loses_its_long_members_first_then_members_from_its_end() -> None:
    """Trace Context §3.3.1.5: at most 512 characters are propagated; entries over 128 characters go first."""
    long_member = "long=" + "x" * 200
    short = [f"k{index:02}=" + "v" * 40 for index in range(12)]  # 44 characters each: 12 * 44 + 11 commas = 539
    kept = parse_tracestate(",".join([short[0], long_member, *short[1:]]))
    assert kept is not None
    assert "long=" not in kept
    assert len(kept) <= MAX_TRACESTATE_CHARS
    assert kept.split(",") == short[: len(kept.split(","))]  # cut from the end, order kept
    assert len(kept.split(",")) == 11


@given(st.lists(st.tuples(st.one_of(simple_keys, tenant_keys), tracestate_values), min_size=1, max_size=32))
def test_every_tracestate_of_the_grammar_is_kept_within_the_limit(members: list[tuple[str, str]]) -> None:
    unique = dict(members)
    value = ",".join(f"{key}={member_value}" for key, member_value in unique.items())
    kept = parse_tracestate(value)
    assert kept is not None
    assert len(kept) <= MAX_TRACESTATE_CHARS
    if len(value) <= MAX_TRACESTATE_CHARS:
        assert kept == value


# --- baggage (W3C Baggage §3) ---------------------------------------------------------------------------------


def test_a_baggage_header_is_kept_as_it_came() -> None:
    value = "userId=alice,serverNode=DF%2028,isProduction=false;ttl=60;secret"
    assert parse_baggage(value) == value
    assert parse_baggage(" key1 = value1 ; prop , key2=") == "key1 = value1 ; prop , key2="  # OWS, empty value


@pytest.mark.parametrize(
    "value",
    [
        "",
        "novalue",
        "=value",
        "a b=c",  # a key is a token
        'key="quoted"',  # DQUOTE is not a baggage-octet
        "key=a\\b",  # nor is a backslash
        "key=a b",  # nor whitespace inside a value
        "a=1,,b=2",  # an empty list member
        "key=é",
        ",".join(f"k{index}=v" for index in range(MAX_BAGGAGE_MEMBERS + 1)),  # at most 180 members
        "key=" + "v" * MAX_BAGGAGE_BYTES,  # at most 8192 bytes
    ],
)
def test_a_baggage_header_out_of_the_grammar_or_past_the_limits_is_dropped(value: str) -> None:
    assert parse_baggage(value) is None


@pytest.mark.parametrize("suffix", CONTROL_SUFFIXES)
def test_a_baggage_header_with_a_line_break_or_a_second_request_in_it_is_dropped(suffix: str) -> None:
    assert parse_baggage("userId=alice" + suffix) is None


@given(st.lists(baggage_members, min_size=1, max_size=MAX_BAGGAGE_MEMBERS))
def test_every_baggage_header_of_the_grammar_within_the_limits_is_kept(members: list[str]) -> None:
    value = ",".join(members)
    assert parse_baggage(value) == (value if len(value) <= MAX_BAGGAGE_BYTES else None)


# --- what any of them lets through ----------------------------------------------------------------------------


@settings(max_examples=300)
@given(st.sampled_from(trace_context.TRACE_KEYS), st.one_of(st.text(), traceparents.map(lambda tp: tp + "\r\nX: y")))
def test_whatever_goes_in_what_comes_out_is_a_safe_header_value(key: str, value: str) -> None:
    kept = parsed({"traceparent": VALID, key: value}).get(key)
    if kept is not None:
        assert is_safe_value(kept)
        assert not set(kept) & {"\r", "\n", "\x00"}


def test_a_tracestate_goes_only_with_a_valid_traceparent() -> None:
    """Trace Context §3.3: a vendor that could not parse traceparent MUST NOT parse tracestate."""
    assert parsed({"traceparent": VALID, "tracestate": "rojo=1"}) == {"traceparent": VALID, "tracestate": "rojo=1"}
    assert parsed({"traceparent": VALID + "\r\nX: y", "tracestate": "rojo=1", "baggage": "a=1"}) == {"baggage": "a=1"}
    assert parsed({"tracestate": "rojo=1"}) == {}


def test_values_that_are_not_strings_are_dropped() -> None:
    assert parsed({"traceparent": 5, "tracestate": ["rojo=1"], "baggage": None}) == {}
