"""The W3C trace context a request may carry, parsed, never copied: `traceparent` and `tracestate` (W3C Trace
Context Level 1, https://www.w3.org/TR/trace-context/ §3.2, §3.3) and `baggage` (W3C Propagation format for
distributed context: Baggage, https://www.w3.org/TR/baggage/ §3). A value that does not parse is dropped (the
trace restarts, protocol.md §3.14); what is kept is safe to write as an HTTP header value. The same rules for
HTTP headers and `params._meta`, tracing on or off. Sans-IO: imports nothing of the proxy, nor OpenTelemetry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

TRACE_KEYS: Final = ("traceparent", "tracestate", "baggage")  # W3C keys, in HTTP headers and in `_meta`

# Trace Context §3.2.2: version "-" trace-id "-" parent-id "-" trace-flags, lowercase hex (HEXDIGLC). Version
# 00 is exactly these 55 characters; a higher version (§3.2.4 Versioning of traceparent) is parsed by the same
# fields and may go on after them only with a "-".
_TRACEPARENT: Final = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?", re.DOTALL)
_ZERO_TRACE_ID: Final = "0" * 32  # §3.2.2.3: all zeros is an invalid trace-id
_ZERO_PARENT_ID: Final = "0" * 16  # §3.2.2.4: all zeros is an invalid parent-id
_TRACEPARENT_LENGTH: Final = 55

# Trace Context §3.3.1.3 (tracestate list members):
#   key = simple-key / multi-tenant-key
#   simple-key = lcalpha 0*255( lcalpha / DIGIT / "_" / "-"/ "*" / "/" )
#   multi-tenant-key = tenant-id "@" system-id
#   tenant-id = ( lcalpha / DIGIT ) 0*240( lcalpha / DIGIT / "_" / "-"/ "*" / "/" )
#   system-id = lcalpha 0*13( lcalpha / DIGIT / "_" / "-"/ "*" / "/" )
#   value = 0*255(chr) nblk-chr;  nblk-chr = %x21-2B / %x2D-3C / %x3E-7E;  chr = %x20 / nblk-chr
_TRACESTATE_MEMBER: Final = re.compile(
    r"(?:[a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
MAX_TRACESTATE_MEMBERS: Final = 32  # §3.3.1.1: "There can be a maximum of 32 list-members in a list"
# §3.3.1.5 Tracestate Limits: a vendor SHOULD propagate at least 512 characters of the combined header (commas
# included, optional whitespace not); when it must cut, members over 128 characters go first, then members
# from the end of the list.
MAX_TRACESTATE_CHARS: Final = 512
LONG_TRACESTATE_MEMBER_CHARS: Final = 128

# Baggage §3.2.1: list-member = key OWS "=" OWS value *( OWS ";" OWS property ); key = token (RFC 9110
# §5.6.2); value = *baggage-octet; baggage-octet = %x21 / %x23-2B / %x2D-3A / %x3C-5B / %x5D-7E (no control
# character, whitespace, DQUOTE, comma, semicolon or backslash); property = key OWS "=" OWS value / key OWS.
_OWS: Final = r"[ \t]*"
_TOKEN: Final = r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
_BAGGAGE_VALUE: Final = r"[\x21\x23-\x2b\x2d-\x3a\x3c-\x5b\x5d-\x7e]*"
_BAGGAGE_PROPERTY: Final = rf"{_TOKEN}(?:{_OWS}={_OWS}{_BAGGAGE_VALUE})?"
_BAGGAGE_MEMBER: Final = re.compile(
    rf"{_OWS}{_TOKEN}{_OWS}={_OWS}{_BAGGAGE_VALUE}(?:{_OWS};{_OWS}{_BAGGAGE_PROPERTY})*{_OWS}"
)
# Baggage §3.3 Limits: the grammar allows at most 180 list-members (1 + 0*179); a platform must propagate at
# least 64 members and 8192 bytes, and never part of a member. Past either limit the whole value is dropped.
MAX_BAGGAGE_MEMBERS: Final = 180
MAX_BAGGAGE_BYTES: Final = 8192


def parse_traceparent(value: str) -> str | None:
    """`value` as a traceparent to propagate, or None when it is not one (Trace Context §3.2). A version-00
    value is kept as it is; a higher version's is cut to the four fields this version knows (§3.2.4: parse
    the fields of version 00 from a higher version, ignore what follows)."""
    found = _TRACEPARENT.fullmatch(value)
    if found is None:
        return None
    version, trace_id, parent_id, _flags, rest = found.groups()
    if version == "ff" or trace_id == _ZERO_TRACE_ID or parent_id == _ZERO_PARENT_ID:
        return None  # §3.2.2.1: version ff is invalid; §3.2.2.3, §3.2.2.4: all-zero ids are invalid
    if rest is not None:
        if version == "00":
            return None  # version 00 is exactly 55 characters long
        return value[:_TRACEPARENT_LENGTH]
    return value


def parse_tracestate(value: str) -> str | None:
    """`value` as a tracestate to propagate, or None when nothing of it may go on (Trace Context §3.3).

    Empty list members and optional whitespace around commas are dropped (§3.3.1.1); a member that does not
    parse, a duplicate key (§3.3.1.1: keys are unique) or more than 32 members invalidates the whole header
    (§3.3.1.1: "the vendor MAY discard the whole tracestate"). Over 512 characters it is cut as §3.3.1.5 says."""
    members: list[str] = []
    keys: set[str] = set()
    for part in value.split(","):
        member = part.strip(" \t")
        if not member:
            continue
        if _TRACESTATE_MEMBER.fullmatch(member) is None:
            return None
        key = member.partition("=")[0]
        if key in keys:
            return None
        keys.add(key)
        members.append(member)
        if len(members) > MAX_TRACESTATE_MEMBERS:
            return None
    if not members:
        return None
    return ",".join(_within_tracestate_limit(members)) or None


def _within_tracestate_limit(members: list[str]) -> list[str]:
    """Trace Context §3.3.1.5: members over 128 characters are removed first, then members from the end,
    until the combined header (commas included) is at most 512 characters."""

    def length(kept: list[str]) -> int:
        return sum(len(member) for member in kept) + max(len(kept) - 1, 0)

    if length(members) <= MAX_TRACESTATE_CHARS:
        return members
    kept = [member for member in members if len(member) <= LONG_TRACESTATE_MEMBER_CHARS]
    while kept and length(kept) > MAX_TRACESTATE_CHARS:
        kept.pop()
    return kept


def parse_baggage(value: str) -> str | None:
    """`value` as a baggage header to propagate, or None when it does not parse or is past the limits (W3C
    Baggage §3.2 grammar, §3.3 limits). Kept as it came (its values stay percent-encoded, never decoded)."""
    if len(value) > MAX_BAGGAGE_BYTES:  # the grammar is ASCII: as many bytes as characters
        return None
    members = value.split(",")
    if len(members) > MAX_BAGGAGE_MEMBERS:
        return None
    for member in members:
        if _BAGGAGE_MEMBER.fullmatch(member) is None:
            return None
    stripped = value.strip(" \t")
    return stripped or None


_PARSERS: Final = {"traceparent": parse_traceparent, "tracestate": parse_tracestate, "baggage": parse_baggage}


def parsed(carrier: Mapping[str, Any]) -> dict[str, str]:
    """The trace keys of `carrier` (HTTP headers, matched whatever their case when `carrier` is a case-insensitive
    mapping, or `_meta`) that parse, each as it may be propagated. A tracestate goes only with a valid
    traceparent (Trace Context §3.3: a vendor that could not parse traceparent MUST NOT parse tracestate)."""
    found: dict[str, str] = {}
    for key in TRACE_KEYS:
        value = carrier.get(key)
        if isinstance(value, str) and (kept := _PARSERS[key](value)) is not None:
            found[key] = kept
    if "tracestate" in found and "traceparent" not in found:
        del found["tracestate"]
    return found


def has_trace_key(carrier: Mapping[str, Any]) -> bool:
    """Whether `carrier` names any trace key (the cheap test before `parsed`, on every request's path)."""
    return "traceparent" in carrier or "tracestate" in carrier or "baggage" in carrier
