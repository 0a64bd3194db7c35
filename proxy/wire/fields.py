"""What may be written onto an HTTP/1.1 wire: header field names and values, and a request target (RFC 9110
§5.1 and §5.5, RFC 9112 §3.2). Every writer of the proxy checks what it writes with these, where it writes it,
whatever the value's source. Sans-IO: imports nothing of the proxy.

The checks are as strict as h11's writer: a name is a `token`; a value holds no CR, LF, NUL or other control
character but horizontal tab, and neither starts nor ends with whitespace; a request target is a non-empty run
of visible characters. Each check is one compiled regular expression, so it runs at C speed on the hot path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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
    if _VALUE.fullmatch(value) is None:
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
    return _VALUE.fullmatch(value) is not None


# Every field of a header block at once, each as name NUL value, one a line (a name or value with a NUL or LF
# in it is invalid, and the separators' count tells such a one from a separator): one pass at C speed for a
# writer that checks many fields per request.
_FIELDS: Final = re.compile(rf"(?:{_TOKEN.pattern}\x00{_VALUE.pattern}(?:\n(?!\Z)|\Z))*")


def check_fields(fields: Iterable[tuple[str, str]]) -> None:
    """`check_field` for each (name, value) of `fields`; raises FieldError naming the first that fails."""
    items = fields if isinstance(fields, list | tuple) else list(fields)
    block = "\n".join(map("\x00".join, items))
    # A NUL or LF inside a name or value would pass for a separator: the counts say there is none.
    if (
        _FIELDS.fullmatch(block) is not None
        and block.count("\x00") == len(items)
        and block.count("\n") == max(len(items) - 1, 0)
    ):
        return
    for name, value in items:
        check_field(name, value)
    raise FieldError("not a valid header block")  # not reached: the block fails only where a field does
