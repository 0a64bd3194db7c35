"""Which fields of one config object are read while a block runs: each field a reload compares (a section's field,
or a top-level field that is no section) is recorded by its dotted path when it, or anything inside it, is read,
through whatever reference to its models the reader holds."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel


def _models(value: Any, path: str, found: dict[int, tuple[str, BaseModel]]) -> None:
    """Every model inside `value`, by id, with its dotted path (a map's or a list's items share the map's)."""
    if isinstance(value, BaseModel):
        found[id(value)] = (path, value)
        for name in type(value).model_fields:
            _models(getattr(value, name), f"{path}.{name}" if path else name, found)
    elif isinstance(value, dict):
        for item in value.values():
            _models(item, path, found)
    elif isinstance(value, list | tuple):
        for item in value:
            _models(item, path, found)


def _unit(path: str, units: Collection[str]) -> str | None:
    parts = path.split(".")
    for length in range(len(parts), 0, -1):
        if (prefix := ".".join(parts[:length])) in units:
            return prefix
    return None  # a section read as a whole, to read its fields next


@contextmanager
def reads_of(config: BaseModel, units: Collection[str]) -> Iterator[set[str]]:
    """The `units` (dotted field paths) of `config` read inside the block."""
    found: dict[int, tuple[str, BaseModel]] = {}
    _models(config, "", found)
    reads: set[str] = set()

    def recording(self: BaseModel, name: str) -> Any:
        value = object.__getattribute__(self, name)
        entry = found.get(id(self))
        if entry is not None and entry[1] is self and name in type(self).model_fields:
            unit = _unit(f"{entry[0]}.{name}" if entry[0] else name, units)
            if unit is not None:
                reads.add(unit)
        return value

    classes = {type(model) for _, model in found.values()}
    saved = {cls: cls.__dict__.get("__getattribute__") for cls in classes}
    for cls in classes:
        cls.__getattribute__ = recording  # type: ignore[method-assign,assignment]
    try:
        yield reads
    finally:
        for cls, before in saved.items():
            if before is None:
                del cls.__getattribute__
            else:
                cls.__getattribute__ = before  # type: ignore[method-assign]
