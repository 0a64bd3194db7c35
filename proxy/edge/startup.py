"""What a start says and checks: the start line, the warnings, the files and the stdio server's program checked
before anything is created, the first stdio server process waited for, and a failed start as one log line with
an exit code of its own (`EXIT_*`, listed below)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict
from yarl import URL

from proxy.config.schema import Config, HttpUpstreamConfig, StdioUpstreamConfig
from proxy.config.warnings import Warning
from proxy.edge._relay import relayed_shown
from proxy.errors import ProxyError, UpstreamTimeoutError
from proxy.upstream.pool import SessionPool
from proxy.upstream.stdio.process import child_environment

# Exit codes (`mcp-tasks-proxy serve`): 0 a stop after a drain; 1 an unexpected error; 2 invalid configuration, or a
# file it names that cannot be used (a directory that cannot be written, an `upstream.cwd` that is not there); 3 a
# listen address cannot be bound (port in use, address not on this machine, no permission); 4 the SQLite task database
# is in use by another proxy process; 5 the task store cannot be reached or opened (PostgreSQL down or refusing, a
# SQLite file that cannot be created); 6 the stdio server cannot be started (its program is not found, or it exits or
# fails before answering `initialize`). An HTTP upstream is not waited for at start: one that is down or refuses is a
# warning and an unready `/readyz`, never a failed start.

log = structlog.get_logger(__name__)

EXIT_CONFIG_ERROR: Final = 2
EXIT_CANNOT_LISTEN: Final = 3
EXIT_STORE_LOCKED: Final = 4
EXIT_STORE_UNAVAILABLE: Final = 5
EXIT_UPSTREAM_COMMAND: Final = 6


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

    relayed = relayed_shown(config.relay, has_origin=isinstance(config.upstream, HttpUpstreamConfig))
    return {
        "version": PROXY_VERSION,
        "config": str(Path(path).resolve()) if path is not None else "defaults",
        "upstream": upstream_shown(config),
        "store": store_shown(config),
        "relayed": relayed or "nothing",
    }


def warn(warnings: list[Warning]) -> None:
    """Log each warning of the start (`check-config` prints the same ones)."""
    for event, fields in warnings:
        log.warning(event, **fields)


# --- checked before anything is created or contacted ---------------------------------------------------------


def check_files(config: Config, environ: Mapping[str, str] = os.environ) -> None:
    """What the start will create or run, checked before the store is opened or the upstream contacted, so that
    a start that cannot go on leaves nothing behind: the SQLite database's directory can be written (or made),
    the audit file's too, a stdio server's working directory exists and its program is found. A StartFailure
    names the key to fix."""
    if config.store.url is None:
        problem = _unwritable(Path(config.store.path))
        if problem is not None:
            raise StartFailure(
                EXIT_STORE_UNAVAILABLE, "store_unavailable", f"cannot create the task database: {problem} (store.path)"
            )
    audit = config.audit.path
    if audit is not None and audit != "-":
        problem = _unwritable(Path(audit))
        if problem is not None:
            raise StartFailure(
                EXIT_CONFIG_ERROR, "audit_unwritable", f"cannot write the audit log: {problem} (audit.path)"
            )
    upstream = config.upstream
    if isinstance(upstream, StdioUpstreamConfig):
        if upstream.cwd is not None and not Path(upstream.cwd).is_dir():
            raise StartFailure(
                EXIT_CONFIG_ERROR, "upstream_cwd_missing", f"upstream.cwd {upstream.cwd} is not a directory"
            )
        program = upstream.command[0]
        if find_program(program, child_environment(upstream.env, environ), upstream.cwd) is None:
            raise StartFailure(
                EXIT_UPSTREAM_COMMAND,
                "upstream_command_not_found",
                f"the stdio server's program {program} is not found"
                + ("" if "/" in program else " on PATH")
                + " (upstream.command: install it, or give its absolute path)",
            )


def find_program(program: str, env: Mapping[str, str], cwd: str | None) -> str | None:
    """Where `program` is, found as a shell (and the server's start) finds it: a name with a `/` from the
    server's working directory, a bare name on the server's PATH. None when it is not there or not executable."""
    if "/" in program:
        path = Path(cwd or ".") / program
        return str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return shutil.which(program, path=env.get("PATH", os.defpath))


def _unwritable(path: Path) -> str | None:
    """Why a file at `path` cannot be created or written (None: it can): the nearest directory of it that exists
    must be one this process may write, and an existing file must be writable."""
    if path.exists():
        return None if os.access(path, os.W_OK) else f"{path} is not writable"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    return None


async def first_stdio_process(pool: SessionPool, upstream: StdioUpstreamConfig) -> None:
    """A stdio server's first process, started before the store is opened and waited for until it answers
    `initialize` (within `upstream.start_timeout_seconds`): one that exits or fails first is a start failure
    naming the program; one still starting then is a warning, and the proxy starts (requests wait for it)."""
    program = Path(upstream.command[0]).name
    try:
        await pool.session(None).ensure_initialized()
    except UpstreamTimeoutError as exc:
        log.warning("upstream_session_warm_up_failed", error=exc.message, detail=exc.detail)
    except ProxyError as exc:
        raise StartFailure(
            EXIT_UPSTREAM_COMMAND,
            "upstream_failed_to_start",
            f"the stdio server {program} did not start: {exc.message} (upstream.command)",
        ) from None
