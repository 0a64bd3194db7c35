"""Logging: structlog, JSON lines by default (console format for humans), with the active span's
`trace_id`/`span_id` when tracing is on. Events are snake_case facts with key/value context; tokens and
argument values are never logged. Imports the config's logging section and `tracing`."""

from __future__ import annotations

import itertools
import json
import logging
import secrets
import sys
import time
from collections.abc import MutableMapping
from contextvars import ContextVar, Token
from typing import Any, Final

import orjson
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


class _Lines:
    """The logger of the line every request writes: the configured processors run in order and the line handed to
    the configured output, as a structlog logger does, without binding a logger anew on every call (a lazy one
    does, so that a reload reaches it; `configure_logging` makes this one again instead)."""

    __slots__ = ("_output", "_processors")

    def __init__(self, processors: list[structlog.types.Processor], output: structlog.WriteLogger) -> None:
        self._processors = tuple(processors)
        self._output = output

    def info(self, event: str, **fields: Any) -> None:
        self._write("info", event, fields)

    def debug(self, event: str, **fields: Any) -> None:
        self._write("debug", event, fields)

    def _write(self, method_name: str, event: str, fields: dict[str, Any]) -> None:
        fields["event"] = event
        line: Any = fields
        try:
            for processor in self._processors:
                line = processor(self._output, method_name, line)
        except structlog.DropEvent:
            return
        self._output.msg(line)


_request_log: Any = structlog.get_logger("proxy.edge")  # until `configure_logging`: structlog's configuration


def request_log() -> Any:
    return _request_log


def json_line(event: Any, **kwargs: Any) -> str:
    """A line's JSON as `json.dumps(event, **kwargs)` writes it (ASCII, non-ASCII text escaped), written by orjson
    when that gives the same values: ASCII output of plain values. Anything else (non-ASCII text, an integer past
    64 bits, a null that may have been a NaN) by the standard library; a value only the fallback handler can write
    is written by it either way."""
    try:
        line = orjson.dumps(event, default=kwargs.get("default"))
    except (TypeError, orjson.JSONEncodeError):
        return json.dumps(event, **kwargs)
    if not line.isascii() or b"null" in line:  # (orjson writes NaN as null: such a line is written the slow way)
        return json.dumps(event, **kwargs)
    return line.decode()


def iso_utc(ns: int) -> str:
    """`ns` (epoch nanoseconds) as structlog's `TimeStamper(fmt="iso", utc=True)` writes it: ISO 8601 in UTC with
    `Z`, microseconds (truncated) unless they are zero. The seconds' text is made once a second."""
    global _second
    seconds, micros = divmod(ns // 1000, 1_000_000)
    second, text = _second
    if seconds != second:
        text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        _second = (seconds, text)
    return f"{text}.{micros:06d}Z" if micros else f"{text}Z"


_second: tuple[int, str] = (-1, "")


def _timestamp(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    event_dict["timestamp"] = iso_utc(time.time_ns())
    return event_dict


def configure_logging(config: LoggingConfig) -> None:
    global _min_level, _request_log
    level = logging.getLevelNamesMapping()[config.level.upper()]
    console = config.format == "console" or (config.format == "auto" and sys.stderr.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
        if console
        else structlog.processors.JSONRenderer(serializer=json_line)
    )
    output = structlog.WriteLogger(sys.stderr)
    processors: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_request_id,
        tracing.add_trace_ids,
        structlog.processors.add_log_level,
        _timestamp,
        structlog.processors.format_exc_info,
        renderer,
    ]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(level),
        # One writer for every line (structlog would make one per call otherwise, loggers not being cached).
        logger_factory=lambda *_: output,
        cache_logger_on_first_use=False,  # a live reload may change the level: loggers must see the new one
    )
    _min_level = level
    _request_log = _Lines(processors, output)
    # aiohttp's own access log repeats what the request log line says.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
