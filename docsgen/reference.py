"""Reference pages written from the code, so that they cannot drift from it.

- `config_reference`: every key of the config models (`proxy/config/schema.py`) with its type, default and the
  `Field(description=...)`; nested sections get tables of their own. A key without a description is an error.
- `cli_reference`: every command and flag of the argparse parser (`proxy/cli.py`) with its help.
- `metrics_reference`: every metric of the Prometheus registry a proxy app builds (name, type, labels, help).

Each returns Markdown that the mkdocs hook puts where a page says `<!-- reference: NAME -->`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import NoneType, UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

# Sections keyed by a name the user picks: the placeholder their entries' keys are listed under.
PLACEHOLDERS = {"jobs": "<start_tool>", "tasks.tools": "<tool>", "upstream.credentials.exchange.tools": "<tool>"}


class MissingDescription(ValueError):
    """A config key (or section) has no `Field(description=...)`, so the reference would not explain it."""


# --- configuration --------------------------------------------------------------------------------------


def _strip(annotation: Any) -> Any:
    while get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return annotation


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The section models behind a type: the model itself, or each kind of a union (`upstream`)."""
    annotation = _strip(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if get_origin(annotation) in (Union, UnionType):
        return [model for member in get_args(annotation) for model in _models(member)]
    return []


def _entry_model(annotation: Any) -> type[BaseModel] | None:
    """The model of each entry of a `dict[str, Model]` field (`jobs`, `tasks.tools`), else None."""
    annotation = _strip(annotation)
    if get_origin(annotation) is dict:
        models = _models(get_args(annotation)[1])
        return models[0] if len(models) == 1 else None
    return None


def type_name(annotation: Any) -> str:
    """A config type in words: `int`, `list of str`, one of `a`, `b`, `float or null`."""
    annotation = _strip(annotation)
    origin = get_origin(annotation)
    if origin is Literal:
        return "one of " + ", ".join(f"`{value}`" for value in get_args(annotation))
    if origin in (Union, UnionType):
        members = [member for member in get_args(annotation) if member is not NoneType]
        named = " or ".join(type_name(member) for member in members)
        return f"{named} or null" if len(members) < len(get_args(annotation)) else named
    if origin is list:
        return f"list of {type_name(get_args(annotation)[0])}"
    if origin is dict:
        key, value = get_args(annotation)
        return f"map of {type_name(key)} to {type_name(value)}"
    if annotation is Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _yaml(value: Any) -> str:
    text: str = yaml.safe_dump(value, default_flow_style=True, width=10_000, sort_keys=False).strip()
    return text.removesuffix("\n...").strip()


def default_text(field: FieldInfo) -> str:
    if field.is_required():
        return "(required)"
    value = field.get_default(call_default_factory=True, validated_data={})
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{_yaml(value)}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _description(path: str, field: FieldInfo) -> str:
    if not field.description:
        raise MissingDescription(f"{path} has no description: give it Field(description=...) in proxy/config/schema.py")
    return _cell(field.description)


KIND_NAMES = {"HttpUpstreamConfig": "with `url`", "StdioUpstreamConfig": "with `command`"}


def _reload(field: FieldInfo, inherited: str) -> str:
    """Whether a reload changes the key (`live`) or only a restart does (`restart`): its own mark, else that of
    the key it is part of."""
    extra = field.json_schema_extra
    mark = extra.get("reload") if isinstance(extra, dict) else None
    return mark if isinstance(mark, str) else inherited


def _section(
    path: str, models: list[type[BaseModel]], level: int, out: list[str], about: str = "", reload: str = ""
) -> None:
    """A heading and one table for the section at `path` (the fields of all its kinds), then each nested one."""
    rows: dict[str, tuple[FieldInfo, list[str]]] = {}
    for model in models:
        for name, field in model.model_fields.items():
            rows.setdefault(name, (field, []))[1].append(KIND_NAMES.get(model.__name__, model.__name__))
    kinds = len(models) > 1
    nested: list[tuple[str, list[type[BaseModel]], str, str]] = []
    table = ["| key | type | default | reload | description |", "| --- | --- | --- | --- | --- |"]
    for name, (field, owners) in rows.items():
        key = f"{path}.{name}"
        description = _description(key, field)
        mark = _reload(field, reload)
        entry = _entry_model(field.annotation)
        section_models = _models(field.annotation)
        if section_models:
            nested.append((key, section_models, description, mark))
            type_cell, default = f"section ([below](#{_slug(key)}))", "(section)"
        elif entry is not None:
            placeholder = PLACEHOLDERS.get(key, "<name>")
            nested.append((f"{key}.{placeholder}", [entry], description, mark))
            type_cell = f"map of name to section ([`{placeholder}`](#{_slug(key + '.' + placeholder)}))"
            default = default_text(field)
        else:
            type_cell, default = type_name(field.annotation), default_text(field)
        if kinds and len(owners) < len(models) and field.is_required():
            default = "(none: setting it picks this kind)"
        says_kind = description.lower().startswith(tuple(owners))  # "With `url`: …" already says it
        if kinds and len(owners) < len(models) and not says_kind:
            description = f"*{', '.join(owners).capitalize()} only.* {description}"
        table.append(f"| `{key}` | {type_cell} | {default} | {mark or '-'} | {description} |")
    out.extend([f"{'#' * level} `{path}`", ""])
    if about:
        out.extend([about, ""])
    out.extend([*table, ""])
    for key, section_models, description, mark in nested:
        _section(key, section_models, min(level + 1, 6), out, description, mark)


def _slug(path: str) -> str:
    """The anchor mkdocs gives a heading that is just this key in backticks."""
    return "".join(ch for ch in path.lower() if ch.isalnum() or ch in "_-")


def config_reference(root: type[BaseModel] | None = None, level: int = 2) -> str:
    """Every key of the config, one table per section, in the order of the models."""
    if root is None:
        from proxy.config.schema import Config

        root = Config
    out: list[str] = []
    for name, field in root.model_fields.items():
        description = _description(name, field)
        entry = _entry_model(field.annotation)
        if entry is not None:
            _section(f"{name}.{PLACEHOLDERS.get(name, '<name>')}", [entry], level, out, description, _reload(field, ""))
            continue
        models = _models(field.annotation)
        if not models:
            raise MissingDescription(f"{name}: a top-level key must be a section")
        _section(name, models, level, out, description)
    return "\n".join(out)


def config_keys(root: type[BaseModel]) -> list[str]:
    """The dotted path of every leaf key the reference lists (entries of keyed sections under a placeholder)."""
    found: list[str] = []

    def walk(path: str, models: list[type[BaseModel]]) -> None:
        for model in models:
            for name, field in model.model_fields.items():
                key = f"{path}.{name}" if path else name
                entry = _entry_model(field.annotation)
                if _models(field.annotation):
                    walk(key, _models(field.annotation))
                    continue
                if key not in found:
                    found.append(key)
                if entry is not None:
                    walk(f"{key}.{PLACEHOLDERS.get(key, '<name>')}", [entry])

    walk("", [root])
    return found


# --- command line ---------------------------------------------------------------------------------------


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = argparse.HelpFormatter(parser.prog, width=100)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _help(action: argparse.Action, prog: str) -> str:
    text = action.help or ""
    if "%(" in text:
        text = text % {**vars(action), "prog": prog}
    return _cell(text)


def _commands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, help, parser) of each subcommand, in the order they were added."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            for name, sub in action.choices.items():
                found.append((name, helps.get(name, ""), sub))
    return found


def _options_table(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        if action.option_strings:
            metavar = action.metavar or (action.dest.upper() if action.nargs != 0 else None)
            flag = ", ".join(f"`{option}`" for option in action.option_strings)
            if metavar is not None:
                flag += f" `{metavar}`"
        else:
            flag = f"`{action.metavar or action.dest}`"
        details = _help(action, parser.prog)
        if action.choices is not None:
            details += " (one of " + ", ".join(f"`{choice}`" for choice in action.choices) + ")"
        if action.required and action.option_strings:
            details += " (required)"
        rows.append(f"| {flag} | {details or '—'} |")
    if not rows:
        return []
    return ["| argument | meaning |", "| --- | --- |", *rows, ""]


def cli_reference(parser: argparse.ArgumentParser | None = None, level: int = 3) -> str:
    """Every command (depth first) with its usage, description and a table of its arguments."""
    if parser is None:
        from proxy.cli import _parser

        parser = _parser()
    out: list[str] = []

    def command(title: str, help_text: str, sub: argparse.ArgumentParser, depth: int) -> None:
        out.extend([f"{'#' * depth} `{title}`", ""])
        if help_text:
            out.extend([_cell(help_text[0].upper() + help_text[1:]) + ".", ""])
        if sub.description:
            out.extend([_cell(sub.description), ""])
        out.extend(["```", _usage(sub), "```", ""])
        out.extend(_options_table(sub))
        for name, child_help, child in _commands(sub):
            command(f"{title} {name}", child_help, child, min(depth + 1, 6))

    command(parser.prog, "", parser, level)
    return "\n".join(out)


def cli_entries(parser: argparse.ArgumentParser) -> list[tuple[str, list[str]]]:
    """(command path, its option strings and positional names) for the parser and every subcommand."""
    found: list[tuple[str, list[str]]] = []

    def walk(title: str, sub: argparse.ArgumentParser) -> None:
        names: list[str] = []
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
                continue
            names.extend(action.option_strings or [str(action.metavar or action.dest)])
        found.append((title, names))
        for name, _, child in _commands(sub):
            walk(f"{title} {name}", child)

    walk(parser.prog, parser)
    return found


# --- metrics --------------------------------------------------------------------------------------------


def metric_rows() -> list[tuple[str, str, list[str], str]]:
    """(exposed name, type, labels, help) of every metric a proxy app registers, sorted by name."""
    from proxy.config.schema import Config
    from proxy.edge._error_edge import METRICS
    from proxy.edge.app import create_app

    app = create_app(Config.model_validate({"upstream": {"url": "http://127.0.0.1:9/mcp"}}))
    registry = app[METRICS].registry
    collectors = registry._names_to_collectors
    rows = []
    for family in registry.collect():
        collector = collectors.get(family.name) or collectors.get(f"{family.name}_total")
        labels = [str(label) for label in getattr(collector, "_labelnames", ())]
        name = f"{family.name}_total" if family.type == "counter" else family.name
        rows.append((name, family.type, labels, family.documentation))
    return sorted(rows)


def metrics_reference() -> str:
    out = ["| metric | type | labels | help |", "| --- | --- | --- | --- |"]
    for name, kind, labels, documentation in metric_rows():
        shown = f"`{name}`"
        if kind == "histogram":
            shown += " (`_bucket`, `_sum`, `_count`)"
        label_cell = ", ".join(f"`{label}`" for label in labels) or "—"
        out.append(f"| {shown} | {kind} | {label_cell} | {_cell(documentation)} |")
    return "\n".join(out) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "configuration": config_reference,
    "cli": cli_reference,
    "metrics": metrics_reference,
}
