"""`upstream.credentials: secrets`: the per-caller map from a mounted file or directory, each entry checked for what
it becomes (request headers, or a stdio server's environment), read again when its files change (`SecretsMap`).
Imports the config and YAML; no aiohttp, no session.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final, Literal

import structlog
import yaml

from proxy.config.credentials import check_header_value

log = structlog.get_logger(__name__)

Kind = Literal["headers", "environment"]
_ENV_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
MAX_FILE_BYTES: Final = 1 << 20  # one map file; a Kubernetes Secret holds at most 1 MiB anyway
MAX_ENTRIES: Final = 100_000
WATCH_SECONDS: Final = 2.0  # as the config file is watched
Fingerprint = tuple[tuple[str, int, int, int], ...]


class SecretsError(ValueError):
    """The map cannot be used: the message names the file, the entry's key and field, never a value."""


def check_environment_value(name: str, value: str) -> None:
    """An environment variable a secrets entry sets, checked where it is read and again where a process starts:
    a POSIX name, and no NUL (which would cut the value short in the process's environment block)."""
    if not _ENV_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not an environment variable name (letters, digits and _, not first a digit)")
    if "\0" in value:
        raise ValueError(f"the value of {name} holds a NUL character")


def _entry(key: str, value: object, kind: Kind, where: str) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise SecretsError(f"{where}: the entry {key!r} is not a mapping of names to values")
    entry: dict[str, str] = {}
    for name, item in value.items():
        if not isinstance(name, str) or not isinstance(item, str | int) or isinstance(item, bool):
            raise SecretsError(f"{where}: the entry {key!r} has a name or value that is not text")
        try:
            (check_header_value if kind == "headers" else check_environment_value)(name, str(item))
        except ValueError as exc:
            raise SecretsError(f"{where}: the entry {key!r}: {exc}") from None
        entry[name] = str(item)
    return entry


def _read_mapping(path: Path) -> object:
    data = path.read_bytes()
    if len(data) > MAX_FILE_BYTES:
        raise SecretsError(f"{path}: larger than {MAX_FILE_BYTES} bytes")
    try:
        return yaml.safe_load(data.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError):
        raise SecretsError(f"{path}: not YAML or JSON text") from None


def read_map(path: str, kind: Kind) -> dict[str, dict[str, str]]:
    """The map at `path` (a file of entries, or a directory of one entry per file named by its key; names
    starting with `.` are Kubernetes' own and skipped); SecretsError when it cannot be used."""
    root = Path(path)
    entries: dict[str, dict[str, str]] = {}
    try:
        if root.is_dir():
            for child in sorted(root.iterdir()):
                if child.name.startswith(".") or not child.is_file():
                    continue
                entries[child.name] = _entry(child.name, _read_mapping(child), kind, str(child))
        else:
            document = _read_mapping(root)
            if document is None:
                document = {}
            if not isinstance(document, Mapping):
                raise SecretsError(f"{path}: not a mapping of claim values to entries")
            for key, value in document.items():
                entries[str(key)] = _entry(str(key), value, kind, path)
    except OSError as exc:
        raise SecretsError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if len(entries) > MAX_ENTRIES:
        raise SecretsError(f"{path}: more than {MAX_ENTRIES} entries")
    return entries


def fingerprint(path: str) -> Fingerprint:
    """What changes when the map does: each file's resolved path, inode, mtime and size."""
    root = Path(path)
    try:
        files = [root] if not root.is_dir() else [child for child in sorted(root.iterdir()) if child.is_file()]
        found = []
        for file in files:
            stat = file.stat()
            found.append((os.path.realpath(file), stat.st_ino, stat.st_mtime_ns, stat.st_size))
        return tuple(found)
    except OSError:
        return ()


class SecretsMap:
    """The map in force (`entry`), read again when its files change (`watch`) or on SIGHUP (`reload`); the files
    are read in a thread, the map swapped on the loop. `on_change` hears each swap (e.g. to retire processes
    started with an older entry).

    A change is seen as the config file's is: a file's resolved path, inode, mtime or size (a Kubernetes Secret's
    update swaps a symlink). A map with a bad entry is refused whole: the one in force stays, and the error names
    the entry's key and field, never a value."""

    def __init__(self, path: str, kind: Kind, on_change: Callable[[], None] | None = None) -> None:
        self.path = path
        self.kind = kind
        self._seen = fingerprint(path)
        self.entries = read_map(path, kind)  # at start: a map that cannot be used stops the start
        self.version = 0
        self._on_change = on_change
        log.info("credential_secrets_loaded", entries=len(self.entries))

    def entry(self, key: str) -> Mapping[str, str] | None:
        return self.entries.get(key)

    async def reload(self, trigger: str) -> bool:
        """Read the map again; swap it in when it can be used (else the one in force stays, logged)."""
        self._seen = await asyncio.to_thread(fingerprint, self.path)
        try:
            entries = await asyncio.to_thread(read_map, self.path, self.kind)
        except SecretsError as exc:
            log.error("credential_secrets_reload_refused", trigger=trigger, problem=str(exc))
            return False
        if entries == self.entries:
            return False
        self.entries = entries
        self.version += 1
        log.info("credential_secrets_reloaded", trigger=trigger, entries=len(entries))
        if self._on_change is not None:
            self._on_change()
        return True

    async def watch(self, interval_seconds: float = WATCH_SECONDS) -> None:
        """Reload whenever the files change; runs until cancelled."""
        while True:
            await asyncio.sleep(interval_seconds)
            if await asyncio.to_thread(fingerprint, self.path) != self._seen:
                await self.reload("file")
