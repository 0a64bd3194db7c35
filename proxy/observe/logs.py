"""Logging: structlog, JSON lines by default (console format for humans), with the active span's
`trace_id`/`span_id` when tracing is on. Events are snake_case facts with key/value context; tokens and
argument values are never logged. Imports the config's logging section and `tracing`."""

from __future__ import annotations

import itertools
import logging
import secrets
import sys
from collections.abc import MutableMapping
from contextvars import ContextVar, Token
from typing import Any, Final

import structlog

from proxy.config.schema import LoggingConfig
from proxy.observe import tracing

# The least level a line needs to be written: NOTSET (every line, structlog's own default) until
# `configure_logging` sets it, and again on every live reload.
_min_level = logging.NOTSET


# The `request_id` of a request's log lines: unique per process (counter) and across processes (random prefix).
# The number is set for the request (its task and what it spawns inherit it) and written out only on a line.
REQUEST_ID_PREFIX: Final = secrets.token_hex(4) + "-"
_request_numbers = itertools.count(1)
_request: ContextVar[int | None] = ContextVar("mcp_tasks_proxy_request", default=None)


def begin_request() -> Token[int | None]:
    """A new request: the lines logged while it is served (and by what it spawns) carry its `request_id`."""
    return _request.set(next(_request_numbers))


def end_request(token: Token[int | None]) -> None:
    _request.reset(token)


def request_id() -> str | None:
    """The current request's `request_id` (None outside a request)."""
    number = _request.get()
    return None if number is None else f"{REQUEST_ID_PREFIX}{number:x}"


def _add_request_id(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if "request_id" not in event_dict and (number := _request.get()) is not None:
        event_dict["request_id"] = f"{REQUEST_ID_PREFIX}{number:x}"
    return event_dict


def logs_at(level: int) -> bool:
    """Whether a line of `level` is written. Lines written for every request ask first, so one whose level is
    off costs this comparison: its fields are not gathered and structlog is not called."""
    return level >= _min_level


def configure_logging(config: LoggingConfig) -> None:
    global _min_level
    level = logging.getLevelNamesMapping()[config.level.upper()]
    console = config.format == "console" or (config.format == "auto" and sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty()) if console else structlog.processors.JSONRenderer()
    )
    output = structlog.WriteLogger(sys.stderr)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_request_id,
            tracing.add_trace_ids,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One writer for every line (structlog would make one per call otherwise, loggers not being cached).
        logger_factory=lambda *_: output,
        cache_logger_on_first_use=False,  # a live reload may change the level: loggers must see the new one
    )
    _min_level = level
    # aiohttp's own access log repeats what the request log line says.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
