"""Admission: what a request must be before it is classified or read (every header UTF-8, a Host and an Origin
that are allowed), and the body limits it is read within (`security.max_body_bytes`, the read timeout)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Final

from aiohttp import web
from yarl import URL

from proxy.config.schema import SecurityConfig
from proxy.errors import BodyTimeoutError, ForbiddenError, InvalidRequestError, PayloadTooLargeError, ProxyError


def _host_name(host: str) -> str:
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    name, _, _ = host.partition(":")
    return name


def _name_allowed(name: str, allowed_hosts: list[str]) -> bool:
    """`name` (lower case, no port) is one of the allowed hosts, where a `*` label stands for one label."""
    labels: list[str] | None = None
    for pattern in allowed_hosts:
        pattern = pattern.lower()
        if "*" not in pattern:
            if name == pattern:
                return True
            continue
        labels = labels if labels is not None else name.split(".")
        wanted = pattern.split(".")
        if len(labels) == len(wanted) and all(
            label == want or (want == "*" and label != "") for label, want in zip(labels, wanted, strict=True)
        ):
            return True
    return False


def host_allowed(host: str | None, allowed_hosts: list[str]) -> bool:
    return host is not None and _name_allowed(_host_name(host), allowed_hosts)


def origin_allowed(origin: str, allowed_hosts: list[str], allowed_origins: list[str]) -> bool:
    if origin in allowed_origins:
        return True
    url = URL(origin)
    if url.scheme not in ("http", "https") or url.raw_host is None:
        return False
    host = url.raw_host.lower()
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    return _name_allowed(host, allowed_hosts)


def not_utf8_header(headers: Mapping[str, str]) -> str | None:
    """The name of a header whose value is not UTF-8, if any. HTTP allows any byte from 0x80 up in a value, and
    aiohttp keeps such bytes as surrogate escapes; neither the upstream request nor a hash of the principal can
    carry them unchanged, so the request is refused rather than passed on altered."""
    for name, value in headers.items():
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                return name
    return None


SHOWN_HOST_CHARS: Final = 253  # of a refused Host header in the 403's message (the longest DNS name)


def host_refusal(host: str | None) -> str:
    """The 403's message for a Host not allowed: the Host it got (printable ASCII only, at most SHOWN_HOST_CHARS;
    anything else is replaced by `?`, so the message is always a plain JSON string) and the key that allows it."""
    if host is None:
        return "Forbidden: the request has no Host header (security.allowed_hosts lists the Host values served)"
    shown = "".join(char if " " <= char <= "~" else "?" for char in host[:SHOWN_HOST_CHARS])
    more = "…" if len(host) > SHOWN_HOST_CHARS else ""
    return f"Forbidden: Host header not allowed: {shown!r}{more}; add its name to security.allowed_hosts to serve it"


def refusal(request: web.Request, security: SecurityConfig) -> ProxyError | None:
    """Why the request is refused before it is read (a header that is not UTF-8, a Host or Origin not allowed),
    by the security section in force when it arrived."""
    if (name := not_utf8_header(request.headers)) is not None:
        return InvalidRequestError(f"Invalid Request: the value of the {name} header is not UTF-8")
    host = request.headers.get("Host")
    if not host_allowed(host, security.allowed_hosts):
        return ForbiddenError(host_refusal(host))
    origin = request.headers.get("Origin")
    if origin is not None and not origin_allowed(origin, security.allowed_hosts, security.allowed_origins):
        return ForbiddenError("Forbidden: Origin not allowed")
    return None


async def read_body(request: web.Request, security: SecurityConfig) -> bytes:
    """The whole body, within `security.body_read_timeout_seconds` (both eras: legacy bodies are read before they
    are relayed) and `security.max_body_bytes`."""
    try:
        if request.content.is_eof():  # all of it came with the headers (most bodies): nothing to wait for
            return await request.read()
        async with asyncio.timeout(security.body_read_timeout_seconds):
            return await request.read()
    except TimeoutError:
        raise BodyTimeoutError(f"Request body not received within {security.body_read_timeout_seconds:g} s") from None
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLargeError(f"Request body too large (limit {security.max_body_bytes} bytes)") from None
