"""Loading the configuration: one YAML file, then the MCP_TASKS_PROXY_* environment, then explicit overrides
(command-line flags), merged and validated against the schema (`schema.py`); every problem reported with its
field path (`ConfigError`); what `check-config --print` writes (`redacted`). Imports the schema and
`keyfiles` (the files a config names are read apart from the schema).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml
from pydantic import BaseModel, ValidationError

from proxy.config import keyfiles
from proxy.config.schema import _UPSTREAM_KINDS, Config

ENV_PREFIX = "MCP_TASKS_PROXY_"
REDACTED: Final = "<redacted>"
# Any key named like a credential (e.g. in a job's tool arguments) is redacted, besides the values of a field
# marked SECRET_VALUES; `*_file` keys hold paths, never contents, and are printed.
_SECRET_NAME: Final = re.compile(
    r"token|passw|secret|credential|api[-_]?key|private[-_]?key|authorization|cookie", re.I
)


class ConfigError(Exception):
    """The configuration is unusable; `problems` lists every error with its field path."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: " + "; ".join(problems))


def _env_overrides(environ: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """MCP_TASKS_PROXY_<SECTION>__<FIELD>=value → {section: {field: parsed value}}.

    Values are parsed as YAML scalars/flow collections, so `8081`, `true`, `[a, b]` and `{k: v}` work.
    """
    overrides: dict[str, dict[str, Any]] = {}
    for key, raw in environ.items():
        if not key.startswith(ENV_PREFIX):
            continue
        section, sep, field = key[len(ENV_PREFIX) :].lower().partition("__")
        if not sep or not section or not field:
            raise ConfigError(key, [f"{key}: expected {ENV_PREFIX}<SECTION>__<FIELD>"])
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as exc:
            raise ConfigError(key, [f"{key}: not a YAML value: {exc}"]) from None
        overrides.setdefault(section, {})[field] = value
    return overrides


def _merge(base: dict[str, Any], overrides: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    merged = dict(base)
    for section, fields in overrides.items():
        current = merged.get(section)
        merged[section] = {**(current if isinstance(current, dict) else {}), **fields}
    return merged


def _format_errors(exc: ValidationError) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = error["loc"]
        if loc[:1] == ("upstream",) and len(loc) > 1 and loc[1] in _UPSTREAM_KINDS:
            loc = loc[:1] + loc[2:]  # the kind is not a level of the file
        path = ".".join(str(part) for part in loc) or "(top level)"
        problems.append(f"{path}: {error['msg']}")
    return problems


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    absent: list[str] | None = None,
) -> Config:
    """Read the YAML file (optional), apply env overrides, then explicit overrides (CLI flags).

    Raises ConfigError with every problem found, each prefixed by its field path. With `absent` (check-config
    on another machine than the pod), key files that do not exist here are notes appended to it, not problems.
    """
    text: str | None = None
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(str(path), [f"cannot read: {exc.strerror}"]) from None
        except UnicodeDecodeError:
            raise ConfigError(str(path), ["cannot read: not UTF-8 text"]) from None
    return parse_config(text, str(path) if path is not None else "<defaults>", environ, overrides, absent)


def _store_path_from(data: dict[str, Any], directory: Path) -> dict[str, Any]:
    """A relative `store.path` written in a file is taken from the file's directory (so the database sits where
    the file says, whatever directory the proxy is started from); an absolute one is kept."""
    store = data.get("store")
    path = store.get("path") if isinstance(store, dict) else None
    if not isinstance(path, str) or not path or Path(path).is_absolute():
        return data
    assert isinstance(store, dict)
    return {**data, "store": {**store, "path": str(directory / path)}}


def parse_config(
    text: str | None,
    source: str,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    absent: list[str] | None = None,
) -> Config:
    """`load_config` for a file's text already read (None: no file), e.g. by a reload that hashed it.

    `store.path` ends up absolute: a relative one from the file is taken from the file's directory (`source`),
    one from the environment, a flag or the default from the working directory."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    if text is not None:
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(source, ["(top level): expected a mapping of sections"])
        data = _store_path_from(loaded, Path(source).resolve().parent)
    data = _merge(data, _env_overrides(environ))
    if overrides:
        data = _merge(data, overrides)
    config: Config | None = None
    problems: list[str] = []
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems = _format_errors(exc)
    problems += keyfiles.problems(data, absent)  # the files it names, read apart from the schema
    if config is not None and not Path(config.store.path).is_absolute():
        store = config.store.model_copy(update={"path": os.path.abspath(config.store.path)})
        config = config.model_copy(update={"store": store})
    if config is None or problems:
        raise ConfigError(source, problems)
    return config


def redacted(config: BaseModel) -> dict[str, Any]:
    """The configuration as plain data (what `check-config --print` writes as YAML): every value of a
    SECRET_VALUES field, and every string under a key named like a credential, is REDACTED; file paths stay."""
    found: dict[str, Any] = {}
    for name, field in type(config).model_fields.items():
        extra = field.json_schema_extra
        secret = isinstance(extra, dict) and extra.get("secret") is True
        found[name] = _redacted_value(getattr(config, name), name, secret)
    return found


def _redacted_value(value: Any, name: str, secret: bool) -> Any:
    if isinstance(value, BaseModel):
        return redacted(value)
    if isinstance(value, dict):
        return {key: REDACTED if secret else _redacted_value(item, str(key), False) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_redacted_value(item, name, secret) for item in value]
    if secret or (isinstance(value, str) and _SECRET_NAME.search(name) and not name.endswith("_file")):
        return REDACTED
    return value
