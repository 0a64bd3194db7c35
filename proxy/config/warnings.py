"""What a configuration warns about at start, though it is valid: a listener beyond loopback, anonymous callers
there, tasks bound to raw tokens of an upstream that requires credentials. `serve` logs them (`edge/startup.py`),
`check-config` prints them. Pure: imports only the schema."""

from __future__ import annotations

import ipaddress
from typing import Any

from proxy.config.schema import Config


def is_loopback(host: str) -> bool:
    """Is the listen address reachable only from this machine (or pod)?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


Warning = tuple[str, dict[str, Any]]  # a warning of the start: its event and its fields (a `hint` among them)


def start_warnings(config: Config) -> list[Warning]:
    """What a start with `config` warns about (`serve` logs them, `check-config` prints them): a bind beyond
    loopback (only the names in `security.allowed_hosts` are served: DNS-rebinding protection); anonymous callers
    allowed there; tasks bound to raw tokens of an upstream said to require credentials."""
    found: list[Warning] = []
    host = config.listen.host
    if not is_loopback(host):
        found.append(
            (
                "listening_beyond_loopback",
                {
                    "host": host,
                    "allowed_hosts": list(config.security.allowed_hosts),
                    "hint": "requests whose Host header is not in security.allowed_hosts are refused with 403; add "
                    "the names clients use to reach this proxy (e.g. its service name) to security.allowed_hosts",
                },
            )
        )
        if config.security.anonymous == "allow":
            found.append(
                (
                    "anonymous_callers_allowed",
                    {
                        "host": host,
                        "principal_header": config.security.principal_header,
                        "hint": "requests without the principal header share one anonymous identity; set "
                        "security.anonymous: refuse unless a trusted hop always sets the header",
                    },
                )
            )
    if config.security.upstream_auth == "required":
        binding = raw_token_binding(config)
        if binding is not None:
            found.append(binding)
    return found


def raw_token_binding(config: Config) -> Warning | None:
    """When the upstream requires credentials and the caller is the raw value of the Authorization header (no
    `security.jwt`): a client that refreshes its token becomes another caller and loses its tasks."""
    security = config.security
    if security.jwt is not None or security.principal_header.lower() != "authorization":
        return None
    return (
        "tasks_bound_to_raw_tokens",
        {
            "principal_header": security.principal_header,
            "hint": "the upstream requires credentials and each task belongs to the exact token that created it: a "
            "client that refreshes its token loses its tasks; set security.jwt (the issuer and a claim own them), "
            "or have a trusted hop set an identity header and name it in security.principal_header",
        },
    )
