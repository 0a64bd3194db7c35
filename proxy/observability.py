"""Logging setup: structlog, JSON lines by default, console format for humans.

Log events are snake_case facts with key/value context; tokens and argument values are never logged.
Imports only the config.
"""

from __future__ import annotations

import logging
import sys

import structlog

from proxy.config import LoggingConfig


def configure_logging(config: LoggingConfig) -> None:
    level = logging.getLevelNamesMapping()[config.level.upper()]
    renderer: structlog.types.Processor = (
        structlog.processors.JSONRenderer()
        if config.format == "json"
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # aiohttp's own access log repeats what the request log line says.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
