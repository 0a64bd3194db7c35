"""observe/logs.py: the JSON of a log line and its timestamp, written faster than structlog's own processors but
the same: the same values in the JSON, the same timestamp text."""

from __future__ import annotations

import io
import json
import logging
import math
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st
from structlog.processors import _json_fallback_handler

from proxy.config.schema import LoggingConfig
from proxy.observe import logs
from proxy.observe.logs import configure_logging, iso_utc, json_line

FIELD_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


def _same(first: Any, second: Any) -> bool:
    """Equal values, NaN equal to NaN (JSON written by the standard library keeps it as NaN)."""
    if isinstance(first, float) and isinstance(second, float) and math.isnan(first) and math.isnan(second):
        return True
    if isinstance(first, dict) and isinstance(second, dict):
        return first.keys() == second.keys() and all(_same(first[key], second[key]) for key in first)
    if isinstance(first, list) and isinstance(second, list):
        return len(first) == len(second) and all(_same(a, b) for a, b in zip(first, second, strict=True))
    return bool(first == second)


@given(st.dictionaries(st.text(max_size=8), FIELD_VALUES, max_size=6))
def test_a_line_holds_what_the_standard_librarys_json_holds(event: dict[str, Any]) -> None:
    """ASCII, one line, and read back the same values as `json.dumps` writes (non-ASCII text escaped, integers
    of any size, NaN kept as the standard library keeps it)."""
    line = json_line(event, default=_json_fallback_handler)
    assert line.isascii()
    assert "\n" not in line
    assert _same(json.loads(line), json.loads(json.dumps(event, default=_json_fallback_handler)))


@pytest.mark.parametrize("nan", [math.nan, [1.0, math.nan], {"deep": [math.nan]}])
def test_a_nan_anywhere_is_written_as_the_standard_library_writes_it(nan: Any) -> None:
    line = json_line({"event": "x", "value": nan}, default=_json_fallback_handler)
    assert line == json.dumps({"event": "x", "value": nan}, default=_json_fallback_handler)


def test_a_value_json_cannot_write_is_written_by_the_fallback_handler() -> None:
    line = json_line({"event": "x", "thing": object()}, default=_json_fallback_handler)
    assert json.loads(line)["thing"].startswith("<object object at")


@pytest.mark.parametrize(
    "ns",
    [0, 1_733_400_955_192_992_123, 1_733_400_955_000_000_000, 1_733_400_955_000_001_999, 4_102_444_799_999_999_999],
)
def test_the_timestamp_is_structlogs_iso_utc_text(ns: int) -> None:
    """What `TimeStamper(fmt="iso", utc=True)` writes: microseconds truncated, left out when zero, `Z` for UTC."""
    expected = datetime.fromtimestamp(ns // 1000 / 1_000_000, tz=UTC).isoformat().replace("+00:00", "Z")
    assert iso_utc(ns) == expected
    assert iso_utc(ns + 1000) != expected  # a microsecond later: another text, from the same second's prefix


@pytest.fixture
def restored_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    saved = structlog.get_config()
    monkeypatch.setattr(logs, "_min_level", logs._min_level)
    monkeypatch.setattr(logs, "_request_log", logs._request_log)
    yield
    structlog.configure(**saved)


@pytest.mark.usefixtures("restored_logging")
@pytest.mark.parametrize("format_", ["json", "console"])
def test_the_request_line_is_what_a_structlog_logger_writes(monkeypatch: pytest.MonkeyPatch, format_: str) -> None:
    """`request_log()` runs the configured processors itself: the same line as a logger of the configuration
    writes, the timestamp aside; nothing below the level."""
    stderr_lines = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr_lines)  # what configure_logging writes to
    configure_logging(LoggingConfig(level="info", format=format_))
    fields = {"http_method": "POST", "path": "/mcp", "status": 200, "duration_ms": 0.25}
    token = logs.begin_request()
    structlog.contextvars.bind_contextvars(idempotency="replayed")  # as a keyed call's answer binds it
    try:
        logs.request_log().info("request", **dict(fields))
        structlog.get_logger("elsewhere").info("request", **dict(fields))
    finally:
        structlog.contextvars.unbind_contextvars("idempotency")
        logs.end_request(token)
    ours, theirs = stderr_lines.getvalue().splitlines()
    if format_ == "json":
        mine, reference = json.loads(ours), json.loads(theirs)
        assert mine.pop("timestamp").endswith("Z")
        reference.pop("timestamp")
        assert mine == reference
        assert mine["request_id"].startswith(logs.REQUEST_ID_PREFIX)
        assert mine["idempotency"] == "replayed"
    else:
        assert ours.split(" ", 1)[1] == theirs.split(" ", 1)[1]  # past the timestamp
    configure_logging(LoggingConfig(level="warning", format=format_))
    assert not logs.logs_at(logging.INFO)  # the edge asks this before it writes a request line
