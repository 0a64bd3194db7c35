"""What may be written onto an HTTP/1.1 wire: header field names and values, and a request target (RFC 9110
§5.1 and §5.5, RFC 9112 §3.2). Every writer of the proxy checks what it writes with these, where it writes it,
whatever the value's source. Sans-IO: imports nothing of the proxy.

The checks are as strict as h11's writer: a name is a `token`; a value holds no CR, LF, NUL or other control
character but horizontal tab, and neither starts nor ends with whitespace; a request target is a non-empty run
of visible characters. Each check is one compiled regular expression, so it runs at C speed on the hot path.
"""

from __future__ import annotations

import re
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
    # character at all, not even tab) that neither starts nor ends with a space is a valid value. Anything else
    # (a tab, a control character, a character Python does not call printable) is decided by the expression.
    if value.isprintable() and (not value or (value[0] != " " and value[-1] != " ")):
        return True
    return _VALUE.fullmatch(value) is not None
