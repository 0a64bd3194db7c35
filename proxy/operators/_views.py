"""What operators see of tasks, for the CLI (`tasks_cli.py`) and the admin listener (`admin.py`) alike: the
filters of a listing as a `TaskQuery`, a record as a listing shows it (never its request or result), ages as
people read them (`12m05s`), and durations such as `15m`. Imports only the standard library at module level
(the CLI builds its parser from here); the store's and the wire's types when called.
"""

from __future__ import annotations

import argparse
import itertools
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from proxy.tasks.store import TaskQuery
    from proxy.wire.tasks import TaskRecord

OPERATOR_CANCEL_MESSAGE: Final = "cancelled by an operator"
STATUSES: Final = ("working", "input_required", "completed", "failed", "cancelled")
_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_AGE_UNITS: Final = (("d", 86400), ("h", 3600), ("m", 60), ("s", 1))
_DURATION: Final = re.compile(r"(\d+(?:\.\d+)?)([smhdw]?)")


def age_text(seconds: int) -> str:
    """`45s`, `12m05s`, `3h07m`, `2d04h`: the two largest units, as people read an age."""
    for (unit, size), (small, small_size) in itertools.pairwise(_AGE_UNITS):
        if seconds >= size:
            return f"{seconds // size}{unit}{(seconds % size) // small_size:02d}{small}"
    return f"{max(0, seconds)}s"


def duration_seconds(text: str) -> float:
    """`90`, `90s`, `15m`, `2h`, `7d`, `1w`, or several at once (`1h30m`) → seconds; ValueError otherwise."""
    parts = _DURATION.findall(text)
    if not text or "".join(number + unit for number, unit in parts) != text:
        raise ValueError(f"not a duration (like 90s, 15m, 2h, 7d): {text!r}")
    return sum(float(number) * _UNITS[unit or "s"] for number, unit in parts)


def duration_argument(text: str) -> float:
    """`duration_seconds` as an argparse type."""
    try:
        return duration_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def query(
    now_ms: int,
    *,
    statuses: Iterable[str] = (),
    tool: str | None = None,
    principal: str | None = None,
    older_than_seconds: float | None = None,
    younger_than_seconds: float | None = None,
    limit: int = 50,
    after: str | None = None,
) -> TaskQuery:
    """The listing these filters ask for (ValueError for a status, page key or limit that is not one)."""
    from proxy.tasks.store import TaskQuery, parse_page_key
    from proxy.wire.tasks import TaskStatus

    return TaskQuery(
        statuses=frozenset(TaskStatus(status) for status in statuses),
        tool=tool,
        principal=principal,
        created_before_ms=None if older_than_seconds is None else now_ms - int(older_than_seconds * 1000),
        created_after_ms=None if younger_than_seconds is None else now_ms - int(younger_than_seconds * 1000),
        after=None if after is None else parse_page_key(after),
        limit=limit,
    )


def page(records: list[TaskRecord], asked: TaskQuery, now_ms: int) -> dict[str, Any]:
    """A listing's page: its records as `summary` shows them, and the key of the next page when it is full."""
    from proxy.tasks.store import page_key

    full = len(records) == asked.limit
    return {"tasks": [summary(record, now_ms) for record in records], "next": page_key(records[-1]) if full else None}


def summary(record: TaskRecord, now_ms: int) -> dict[str, Any]:
    """A record as a listing shows it: never its request (the arguments) or its result."""
    from proxy.wire.tasks import iso_timestamp

    return {
        "taskId": record.task_id,
        "status": record.status.value,
        "tool": record.tool,
        "principalHash": record.principal,
        "owner": record.owner,
        "createdAt": iso_timestamp(record.created_at_ms),
        "lastUpdatedAt": iso_timestamp(record.updated_at_ms),
        "ageSeconds": max(0, now_ms - record.created_at_ms) // 1000,
        "ttlMs": record.ttl_ms,
        "statusMessage": record.status_message,
    }
