"""What a start says: the start line, the warning for an address beyond loopback, and a failed start as one
log line with an exit code of its own (`EXIT_*`, listed below)."""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import Any, Final

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict
from yarl import URL

from proxy.config.schema import Config, HttpUpstreamConfig
from proxy.edge import _descriptors as descriptors

# Exit codes (`mcp-tasks-proxy serve`): 0 a stop after a drain; 1 an unexpected error; 2 invalid configuration; 3 the
# listen address cannot be bound (port in use, address not on this machine, no permission); 4 the SQLite task database
# is in use by another proxy process; 5 the task store cannot be reached or opened (PostgreSQL down or refusing, a
# SQLite file that cannot be created). The upstream is not waited for at start: one that is down or refuses is a
# warning and an unready `/readyz`, never a failed start.

log = structlog.get_logger(__name__)

EXIT_CANNOT_LISTEN: Final = 3
EXIT_STORE_LOCKED: Final = 4
EXIT_STORE_UNAVAILABLE: Final = 5


class StartFailure(Exception):
    """A start that cannot go on: `reason` names the cause for the log line, `message` says it in plain words."""

    def __init__(self, exit_code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.reason = reason
        self.message = message


def report(failure: StartFailure) -> int:
    """One error line in the log; one plain sentence on stderr as well when a person watches it (a terminal)."""
    log.error("start_failed", reason=failure.reason, error=failure.message, exit_code=failure.exit_code)
    if sys.stderr.isatty():
        print(f"mcp-tasks-proxy: cannot start: {failure.message}", file=sys.stderr, flush=True)
    return failure.exit_code


def shown_url(url: str) -> str:
    """A URL as a log may show it: without user, password, query or fragment (they may carry credentials)."""
    parsed = URL(url)
    if not parsed.absolute:
        return "(not an absolute URL)"
    shown = str(parsed.with_user(None).with_query(None).with_fragment(None))
    return shown + ("?(query not shown)" if parsed.raw_query_string else "")


def upstream_shown(config: Config) -> str:
    """The upstream's URL, or a stdio server's program and how many arguments it gets (their values may be
    secrets, so they are never shown)."""
    upstream = config.upstream
    if isinstance(upstream, HttpUpstreamConfig):
        return shown_url(upstream.url)
    program, *arguments = upstream.command
    return f"stdio: {Path(program).name} ({len(arguments)} argument{'' if len(arguments) == 1 else 's'})"


def store_shown(config: Config) -> str:
    """The SQLite file's absolute path, or PostgreSQL's host, port and database (never a user or password)."""
    store = config.store
    if store.url is None:
        return f"sqlite: {Path(store.path).resolve()}"
    # libpq's own parser: a URL may name several hosts (`host=a,b` for a failover), and key=value strings too.
    try:
        settings = conninfo_to_dict(store.url)
    except psycopg.ProgrammingError:
        return "postgresql: (unreadable URL)"
    hosts = str(settings.get("host") or "(local socket)").split(",")
    ports = str(settings.get("port") or "").split(",")
    if len(ports) == 1:
        ports = ports * len(hosts)  # one port for every host, as libpq reads it
    shown = ",".join(f"{host}:{port}" if port else host for host, port in zip(hosts, ports, strict=False))
    database = settings.get("dbname") or "(default database)"
    return f"postgresql: {shown}/{database}"


def start_fields(config: Config, path: str | None) -> dict[str, Any]:
    """The start line's fields but the endpoint (known once the listener is bound)."""
    from proxy.upstream.session import PROXY_VERSION

    return {
        "version": PROXY_VERSION,
        "config": str(Path(path).resolve()) if path is not None else "defaults",
        "upstream": upstream_shown(config),
        "store": store_shown(config),
    }


def is_loopback(host: str) -> bool:
    """Is the listen address reachable only from this machine (or pod)?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_beyond_loopback(config: Config) -> None:
    """A bind beyond loopback (0.0.0.0, ::, a public address): requests from elsewhere name this machine in
    their Host header, and only the names in `security.allowed_hosts` are served (DNS-rebinding protection)."""
    host = config.listen.host
    if is_loopback(host):
        return
    log.warning(
        "listening_beyond_loopback",
        host=host,
        allowed_hosts=list(config.security.allowed_hosts),
        hint="requests whose Host header is not in security.allowed_hosts are refused with 403; add the names "
        "clients use to reach this proxy (e.g. its service name) to security.allowed_hosts",
    )


def descriptor_budget(config: Config) -> None:
    """The soft descriptor limit raised to the hard one (logged when it moved), and a warning naming what the
    configured limits could need and the limit when it does not fit: past it, new work is refused with 503
    (`data.limit: descriptors`) before the process could run out."""
    limit = descriptors.raise_soft_limit()
    if limit.soft != limit.soft_before:
        log.info("descriptor_limit_raised", soft_before=limit.soft_before, soft=limit.soft, hard=limit.hard)
    parts = descriptors.need(config, limit.soft)
    need = sum(parts.values())
    if need > limit.soft:
        log.warning(
            "descriptor_budget_short",
            need=need,
            limit=limit.soft,
            hard_limit=limit.hard,
            parts=parts,
            hint="raise the container's nofile limit (the hard one: the proxy raises its soft limit to it), or "
            "lower tasks.max_running, inputs.max_waiting, upstream.max_open_sessions or limits.max_listen_streams; "
            "past the limit new work is refused with 503 (data.limit: descriptors)",
        )
