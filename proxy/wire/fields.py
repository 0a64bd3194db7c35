"""What may be written onto an HTTP/1.1 wire (RFC 9110 §5.1, §5.5; RFC 9112 §3.2): header names and values and
request targets, checked as strictly as h11's writer by every writer of the proxy, where it writes. Sans-IO."""

from __future__ import annotations

import re
from collections.abc import Iterable
from operator import itemgetter
from typing import Final

# RFC 9110 §5.6.2: token = 1*tchar
_TOKEN: Final = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# RFC 9110 §5.5: field-value = *field-content; field-content = field-vchar [1*(SP / HTAB / field-vchar)
# field-vchar]; field-vchar = VCHAR / obs-text. Characters past U+00FF are let through as obs-text, since the
# writers encode them as UTF-8 bytes, which are all obs-text.
_VALUE: Final = re.compile(r"(?:[^\x00-\x20\x7f](?:[^\x00-\x08\x0a-\x1f\x7f]*[^\x00-\x20\x7f])?)?")
# RFC 9112 §3.2: origin-form = absolute-path [ "?" query ]: visible ASCII only (anything else is
# percent-encoded before it gets here).
_TARGET: Final = re.compile(r"/[\x21-\x7e]*")


class FieldError(ValueError):
    """A header name or value, or a request target, that must not be written: writing it could split a header
    line or a request (CR, LF, NUL) or would be malformed. Nothing has been written when it is raised."""


def check_name(name: str) -> str:
    """`name` if it is an HTTP token; raises FieldError otherwise."""
    if _TOKEN.fullmatch(name) is None:
        raise FieldError(f"not a valid header name: {name[:64]!r}")
    return name


def check_value(name: str, value: str) -> str:
    """`value` if it may be written as the value of header `name`; raises FieldError otherwise (the message
    names the header, never the value, which may be a credential)."""
    if not is_safe_value(value):
        raise FieldError(f"the value of header {name[:64]!r} holds a control character or surrounding whitespace")
    return value


def check_field(name: str, value: str) -> None:
    check_name(name)
    check_value(name, value)


def check_target(target: str) -> str:
    """`target` if it is an origin-form request target (a path and query of visible ASCII); raises FieldError."""
    if _TARGET.fullmatch(target) is None:
        raise FieldError(f"not a valid request target: {target[:64]!r}")
    return target


def is_safe_value(value: str) -> bool:
    """Whether `value` may be written as a header value (`check_value` without the error)."""
    # The common case first, in C and about three times as fast as the expression: printable text (no control
    # character at all, not even tab) that neither starts nor ends with a space is a valid value (the only
    # printable character `strip` removes is the space). Anything else (a tab, a control character, a character
    # Python does not call printable) is decided by the expression.
    if value.isprintable() and value.strip() == value:
        return True
    return _VALUE.fullmatch(value) is not None


# A whole header block at once, by C loops rather than a regular expression a field (which costs some 30
# instructions a character): the names joined and the values joined are each mapped byte for byte through a
# table (allowed -> "a", anything else -> NUL; RFC 9110 §5.6.2 tchar for names, §5.5 field-vchar, SP and HTAB
# for values) and searched for a NUL; `strip` hands back every value itself when none has whitespace around
# it. Text past U+00FF (it cannot be one byte) takes the per-field path, as does a block that fails, so that
# the error names the field.
def _table(allowed: bytes) -> bytes:
    return bytes(0x61 if byte in allowed else 0 for byte in range(256))


_NAME_TABLE: Final = _table(b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
_VALUE_TABLE: Final = _table(b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100)))
_NAME_OF: Final = itemgetter(0)
_VALUE_OF: Final = itemgetter(1)


def check_fields(fields: Iterable[tuple[str, str]]) -> None:
    """`check_field` for each (name, value) of `fields`; raises FieldError naming the first that fails."""
    items = fields if isinstance(fields, list | tuple) else list(fields)
    if _valid_block(items):
        return
    for name, value in items:
        check_field(name, value)


def _valid_block(items: list[tuple[str, str]] | tuple[tuple[str, str], ...]) -> bool:
    names = tuple(map(_NAME_OF, items))
    values = tuple(map(_VALUE_OF, items))
    try:
        joined_names = "".join(names).encode("latin1")
        joined_values = "".join(values).encode("latin1")
    except UnicodeEncodeError:
        return False
    return (
        0 not in joined_names.translate(_NAME_TABLE)  # an int: a bytes needle would first fail as an index
        and 0 not in joined_values.translate(_VALUE_TABLE)
        and all(names)
        and tuple(map(str.strip, values)) == values
    )
