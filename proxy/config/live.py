"""Live configuration: the config in force (`LiveConfig.current`), swapped whole on SIGHUP or a change of its
file when it loads and changes no field marked `restart` (the marks are the schema's; a refused reload changes
nothing). Consumers read it through a getter where they use it. Imports only the config schema and loader."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Final, Union, get_args, get_origin

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge
from pydantic import BaseModel

from proxy.config.loader import ConfigError, parse_config
from proxy.config.schema import Config

log = structlog.get_logger(__name__)

WATCH_SECONDS: Final = 2.0  # how often the file is looked at (a ConfigMap update takes a minute to arrive anyway)


def _sections(annotation: Any) -> list[type[BaseModel]]:
    """The models a field's type is made of (one section, or the kinds of a union), else none."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, UnionType, Annotated):
        return [model for arg in get_args(annotation) for model in _sections(arg)]
    return []


def reload_marks(model: type[BaseModel] = Config) -> dict[str, str | None]:
    """Every field a reload compares (a section's field, or a top-level field that is no section) with its
    `reload` mark from the schema (`live` or `restart`; None where a field lacks one)."""
    marks: dict[str, str | None] = {}
    for name, field in model.model_fields.items():
        sections = _sections(field.annotation)
        fields = [(f"{name}.{inner}", info) for section in sections for inner, info in section.model_fields.items()]
        for path, info in fields or [(name, field)]:
            extra = info.json_schema_extra
            mark = extra.get("reload") if isinstance(extra, dict) else None
            marks[path] = mark if isinstance(mark, str) else None
    return marks


# Bound when the process starts (sockets, sessions, the store, keys, routes, listeners, files, sizes handed to
# long-lived objects): a reload that changes one of these is refused, and says that it needs a restart.
RESTART_FIELDS: Final = frozenset(path for path, mark in reload_marks().items() if mark != "live")

APPLIED: Final = "applied"
SIGHUP_TRIGGER: Final = "sighup"  # the `trigger` of a reload that SIGHUP asked for
UNCHANGED: Final = "unchanged"
INVALID: Final = "invalid"  # not readable, not YAML, empty, or not a valid config
FIXED_KEY: Final = "fixed_key"


def config_hash(config: Config) -> str:
    """A short digest of the config in force (the same config gives the same digest on every replica)."""
    canonical = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def changed_fields(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted paths of what differs; a section is compared field by field, a field (a list, a tool map) whole."""
    paths: list[str] = []
    for key in sorted(old.keys() | new.keys()):
        path = f"{prefix}{key}"
        before, after = old.get(key), new.get(key)
        if before == after:
            continue
        if not prefix and isinstance(before, dict) and isinstance(after, dict):
            paths.extend(changed_fields(before, after, f"{path}."))
        else:
            paths.append(path)
    return paths


def is_fixed(path: str) -> bool:
    """A field only a restart changes (`changed_fields` names a section's fields one by one)."""
    return path in RESTART_FIELDS


def _fingerprint(path: str) -> tuple[str, int, int, int] | None:
    """What changes when the file does, a ConfigMap's `..data` symlink swap included (stat follows links)."""
    try:
        stat = os.stat(path)
        return (os.path.realpath(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)
    except OSError:
        return None


class LiveConfig:
    """The config in force, and how it is reloaded from the file it came from (with the same environment
        overrides and command-line flags).

    `LiveConfig.current` is the immutable config in force; a reload validates the new one and swaps it, and that is
    all it changes: the edge reads `current` per request, and the components that decide new calls hold a getter of
    it (`live.config`) and read their section through it, so no field of theirs is rewritten by a reload. A
    subscriber is for an effect a swap must have (the log level set, the waiting calls admitted by new caps). A call
    captures its policy (its Decision) when it starts, so a swap never changes a call in flight. A reload that
    changes a fixed key (what was bound at start: listen address, upstream, store, ...) or that does not load is
    refused as a whole, logged, and the running config stays. Imports only the config schema and its loader."""

    def __init__(
        self,
        config: Config,
        path: str | None = None,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._current = config
        self.path = path
        self.overrides = overrides
        self.environ = environ
        self._subscribers: list[Callable[[Config], None]] = []
        self._on_sighup: list[Callable[[], None]] = []
        self._seen = _fingerprint(path) if path is not None else None
        self.last_good = time.time()
        self._reloads: Counter | None = None
        self._info: Gauge | None = None

    @property
    def current(self) -> Config:
        return self._current

    def config(self) -> Config:
        """`current` as the getter a consumer holds (`live.config`, one call shorter than a lambda around it)."""
        return self._current

    def subscribe(self, apply: Callable[[Config], None]) -> None:
        """`apply(new)` runs at each swap, right after `current` changed: for an effect the swap must have, not for
        copying values (a consumer reads `current` when it needs it)."""
        self._subscribers.append(apply)

    def on_sighup(self, reopen: Callable[[], None]) -> None:
        """`reopen()` runs at each SIGHUP, whether the config changed or not (a log file rotated away)."""
        self._on_sighup.append(reopen)

    def register_metrics(self, registry: CollectorRegistry) -> None:
        self._reloads = Counter(
            "mcp_tasks_proxy_config_reloads_total",
            "Config reloads (SIGHUP or a change of the file) by result: applied, unchanged, invalid (unreadable, "
            "empty, not YAML or not valid) or fixed_key (changes what only a restart changes)",
            ["result"],
            registry=registry,
        )
        for result in (APPLIED, UNCHANGED, INVALID, FIXED_KEY):
            self._reloads.labels(result)
        Gauge(
            "mcp_tasks_proxy_config_last_reload_success_timestamp_seconds",
            "When the config in force was loaded (at start, or by the last applied reload), Unix time",
            registry=registry,
        ).set_function(lambda: self.last_good)
        self._info = Gauge(
            "mcp_tasks_proxy_config_info",
            "1, labelled with a digest of the config in force",
            ["hash"],
            registry=registry,
        )
        self._info.labels(config_hash(self._current)).set(1)

    # --- reloading ---------------------------------------------------------------------------------------

    def reload(self, trigger: str) -> str:
        """Load the file again and swap it in if it may be; returns the result (also counted and logged)."""
        result = self._reload(trigger)
        if trigger == SIGHUP_TRIGGER:
            for reopen in self._on_sighup:
                reopen()
        if self._reloads is not None:
            self._reloads.labels(result).inc()
        return result

    def _read(self) -> str | None:
        if self.path is None:
            return None
        try:
            text = Path(self.path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(self.path, [f"cannot read: {exc.strerror or exc}"]) from None
        except UnicodeDecodeError:
            raise ConfigError(self.path, ["cannot read: not UTF-8 text"]) from None
        if not text.strip():
            raise ConfigError(self.path, ["the file is empty (truncated?)"])
        return text

    def _reload(self, trigger: str) -> str:
        if self.path is not None:
            self._seen = _fingerprint(self.path)
        try:
            new = parse_config(self._read(), self.path or "<defaults>", self.environ, self.overrides)
        except ConfigError as error:
            log.error("config_reload_refused", trigger=trigger, result=INVALID, problems=error.problems)
            return INVALID
        changed = changed_fields(self._current.model_dump(mode="json"), new.model_dump(mode="json"))
        fixed = [path for path in changed if is_fixed(path)]
        if fixed:
            log.error(
                "config_reload_refused",
                trigger=trigger,
                result=FIXED_KEY,
                field=fixed[0],
                fields=fixed,
                detail=f"{fixed[0]} needs a restart to change; nothing of this reload was applied",
            )
            return FIXED_KEY
        if not changed:
            log.info("config_reload_unchanged", trigger=trigger)
            return UNCHANGED
        old_hash = config_hash(self._current)
        self._current = new
        self.last_good = time.time()
        for apply in self._subscribers:
            apply(new)
        if self._info is not None:
            self._info.remove(old_hash)
            self._info.labels(config_hash(new)).set(1)
        log.info("config_reloaded", trigger=trigger, changed=changed, hash=config_hash(new))
        return APPLIED

    async def watch(self, interval: float = WATCH_SECONDS) -> None:
        """Reload when the file changes: its resolved path, inode, mtime or size (a ConfigMap update swaps the
        `..data` symlink to a new directory; an editor may rewrite in place or rename over). Runs until
        cancelled; a file that disappears is reported once, by the refused reload."""
        if self.path is None:
            return
        while True:
            await asyncio.sleep(interval)
            seen = _fingerprint(self.path)
            if seen != self._seen:
                self.reload("file")
