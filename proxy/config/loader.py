"""Loading the configuration: one YAML file, then the MCP_TASKS_PROXY_* environment, then explicit overrides
(command-line flags), merged and validated against the schema (`schema.py`); every problem reported with its
field path (`ConfigError`); what `check-config --print` writes (`redacted`). Imports the schema and
`keyfiles` (the files a config names are read apart from the schema).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Collection, Mapping
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Final, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from proxy.config import keyfiles
from proxy.config.schema import _UPSTREAM_KINDS, Config
from proxy.config.suggest import did_you_mean

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


# --- what the schema says about a place of the file ----------------------------------------------------------


def _models_in(annotation: Any) -> list[Any]:
    """What a value of `annotation` may be, unwrapped from Optional, unions and Annotated: models and containers."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _models_in(get_args(annotation)[0])
    if origin in (Union, UnionType):
        return [found for arg in get_args(annotation) for found in _models_in(arg)]
    return [annotation]


def _types_at(loc: tuple[str | int, ...]) -> list[Any]:
    """The types the schema allows at `loc` (a path of keys, as in the file; the upstream's kinds both count)."""
    types: list[Any] = [Config]
    for part in loc:
        found: list[Any] = []
        for kind in types:
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                field = kind.model_fields.get(str(part))
                if field is not None:
                    found += _models_in(field.annotation)
            elif get_origin(kind) in (dict, list):
                found += _models_in(get_args(kind)[-1])
        types = found
    return types


def _keys_at(loc: tuple[str | int, ...]) -> set[str]:
    """The keys a mapping at `loc` may hold (the fields of the models there)."""
    return {
        name
        for kind in _types_at(loc)
        if isinstance(kind, type) and issubclass(kind, BaseModel)
        for name in kind.model_fields
    }


def _path_fields(model: type[BaseModel], at: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Where the schema holds a file path (fields marked `A_PATH`), as key paths of the file."""
    found = []
    for name, field in model.model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and extra.get("path") is True:
            found.append((*at, name))
        for kind in _models_in(field.annotation):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                found += [path for path in _path_fields(kind, (*at, name)) if path not in found]
    return found


PATH_FIELDS: Final = tuple(_path_fields(Config))
_STDOUT: Final = "-"  # audit.path: stdout, not a file


def _paths_from(data: dict[str, Any], directory: Path) -> dict[str, Any]:
    """Each relative file path written in the file (`PATH_FIELDS`) taken from the file's directory, so that a
    config file means the same files whatever directory the proxy is started from; absolute ones are kept."""
    resolved = copy.deepcopy(data)
    for path in PATH_FIELDS:
        holder: Any = resolved
        for key in path[:-1]:
            holder = holder.get(key) if isinstance(holder, dict) else None
        value = holder.get(path[-1]) if isinstance(holder, dict) else None
        if isinstance(value, str) and value and value != _STDOUT and not Path(value).is_absolute():
            holder[path[-1]] = str(directory / value)
    return resolved


# --- where a value came from, and its problems said there ------------------------------------------------------


def _lines(text: str) -> dict[tuple[str | int, ...], int]:
    """The line (1-based) of each key and list item of a YAML document, by its path."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError:
        return {}
    lines: dict[tuple[str | int, ...], int] = {}

    def walk(node: yaml.Node | None, at: tuple[str | int, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                path = (*at, str(key.value))
                lines[path] = key.start_mark.line + 1
                walk(value, path)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                lines[(*at, index)] = item.start_mark.line + 1
                walk(item, (*at, index))

    walk(root, ())
    return lines


class _Sources:
    """Where each value of the merged configuration came from: a line of the file, an environment variable, or a
    command-line flag; what a problem is prefixed with."""

    def __init__(
        self,
        source: str,
        text: str | None,
        env: Mapping[str, Mapping[str, Any]],
        flags: Mapping[str, Mapping[str, Any]],
    ) -> None:
        self.source = source
        self.lines = _lines(text) if text is not None else {}
        self.env = env
        self.flags = flags

    def where(self, loc: tuple[str | int, ...]) -> str:
        if len(loc) >= 2:
            section, field = str(loc[0]), str(loc[1])
            if field in self.flags.get(section, {}):
                return "command line: "
            if field in self.env.get(section, {}):
                return f"{ENV_PREFIX}{section.upper()}__{field.upper()}: "
        for end in range(len(loc), 0, -1):  # the line of the value, else of the nearest key that holds it
            line = self.lines.get(loc[:end])
            if line is not None:
                return f"{self.source}:{line}: "
        return ""


def _format_errors(exc: ValidationError, sources: _Sources) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = error["loc"]
        if loc[:1] == ("upstream",) and len(loc) > 1 and loc[1] in _UPSTREAM_KINDS:
            loc = loc[:1] + loc[2:]  # the kind is not a level of the file
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = f"unknown key{did_you_mean(str(loc[-1]), _keys_at(loc[:-1]))}"
        elif error["type"] in ("literal_error", "enum") and isinstance(error.get("input"), str):
            allowed = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
            message += did_you_mean(error["input"], allowed)
        where = loc
        keys = error.get("ctx", {}).get("keys") if error["type"] == "upstream_kind" else None
        if isinstance(keys, list) and keys:
            where = (*loc, keys[0])  # the misspelt key's line
        path = ".".join(str(part) for part in loc) or "(top level)"
        problems.append(f"{sources.where(where)}{path}: {message}")
    return problems


def load_config(
    path: str | Path | None = None,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    absent: list[str] | None = None,
    files: Collection[str] | None = None,
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
    return parse_config(text, str(path) if path is not None else "<defaults>", environ, overrides, absent, files)


def parse_config(
    text: str | None,
    source: str,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    absent: list[str] | None = None,
    files: Collection[str] | None = None,
) -> Config:
    """`load_config` for a file's text already read (None: no file), e.g. by a reload that hashed it.

    Every relative file path written in the file (`PATH_FIELDS`: key files, the store, the audit log, the key set,
    a stdio server's working directory) is taken from the file's directory (`source`); one from the environment
    or a flag from the working directory. `store.path` ends up absolute. `files` names the key files to check
    (`section.field`, see `keyfiles.FILES`); None: all of them. Each problem says where its value came from: the
    file and line, the environment variable, or the command line."""
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
        data = _paths_from(loaded, Path(source).resolve().parent)
    env = _env_overrides(environ)
    data = _merge(data, env)
    if overrides:
        data = _merge(data, overrides)
    sources = _Sources(source, text, env, overrides or {})
    config: Config | None = None
    problems: list[str] = []
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        problems = _format_errors(exc, sources)
    problems += keyfiles.problems(data, absent, files)  # the files it names, read apart from the schema
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
