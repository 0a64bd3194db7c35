"""Logging: structlog, JSON lines by default (console format for humans), with the active span's
`trace_id`/`span_id` when tracing is on. Events are snake_case facts with key/value context; tokens and
argument values are never logged. Imports the config's logging section and `tracing`."""

from __future__ import annotations

import logging
import sys

import structlog

from proxy.config.schema import LoggingConfig
from proxy.observe import tracing

# The least level a line needs to be written: NOTSET (every line, structlog's own default) until
# `configure_logging` sets it, and again on every live reload.
_min_level = logging.NOTSET


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
