"""A tool's arguments from the command line, typed by its inputSchema: `key=value` takes the property's type
(string, integer, number, boolean, an enum's value), `key:=JSON` any JSON value, as httpie has it. Every
problem is a UsageError naming the argument and, for an unknown one, its near match. Pure: imports the config's
near-match helper only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from proxy.config.suggest import did_you_mean

_TRUE: Final = frozenset({"true", "yes", "on", "1"})
_FALSE: Final = frozenset({"false", "no", "off", "0"})


class UsageError(Exception):
    """The command line is wrong (exit code 2); the message says how to fix it."""


def properties(schema: object) -> dict[str, dict[str, Any]]:
    """The properties an inputSchema declares at its top level."""
    declared = schema.get("properties") if isinstance(schema, dict) else None
    return {name: prop for name, prop in (declared or {}).items() if isinstance(prop, dict)}


def kind_of(prop: Mapping[str, Any]) -> str | None:
    """The JSON type a property takes (the first that is not null of a list), or None when it says none."""
    declared = prop.get("type")
    if isinstance(declared, list):
        declared = next((kind for kind in declared if kind != "null"), None)
    if declared is None and isinstance(prop.get("enum"), list) and prop["enum"]:
        declared = {str: "string", bool: "boolean", int: "integer", float: "number"}.get(type(prop["enum"][0]))
    return declared if isinstance(declared, str) else None


def typed(name: str, text: str, prop: Mapping[str, Any]) -> Any:
    """`text` as the value property `name` takes; UsageError when it is not one."""
    kind = kind_of(prop)
    value: Any
    if kind == "integer":
        try:
            value = int(text)
        except ValueError:
            raise UsageError(f"argument {name!r} is an integer, not {text!r}") from None
    elif kind == "number":
        try:
            number = float(text)
        except ValueError:
            raise UsageError(f"argument {name!r} is a number, not {text!r}") from None
        value = int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
    elif kind == "boolean":
        if text.lower() not in _TRUE | _FALSE:
            raise UsageError(f"argument {name!r} is true or false, not {text!r}")
        value = text.lower() in _TRUE
    elif kind in ("array", "object"):
        raise UsageError(f"argument {name!r} is an {kind}: give it as JSON, {name}:='…'")
    else:
        value = text
    allowed = prop.get("enum")
    if isinstance(allowed, list) and allowed and value not in allowed:
        shown = ", ".join(json.dumps(item) for item in allowed)
        hint = did_you_mean(text, [str(item) for item in allowed])
        raise UsageError(f"argument {name!r} is one of {shown}, not {text!r}{hint}")
    return value


def parse(words: Sequence[str], schema: object) -> dict[str, Any]:
    """`key=value` and `key:=JSON` words as the arguments of a tool whose inputSchema is `schema`."""
    declared = properties(schema)
    closed = isinstance(schema, dict) and schema.get("additionalProperties") is False
    arguments: dict[str, Any] = {}
    for word in words:
        raw_json = ":=" in word and word.index(":=") + 1 == word.index("=")  # the first `=` is that of `:=`
        name, separator, text = word.partition(":=" if raw_json else "=")
        if not separator or not name:
            raise UsageError(f"{word!r} is not key=value or key:=JSON")
        if declared and name not in declared and closed:
            raise UsageError(f"the tool takes no argument {name!r}{did_you_mean(name, declared)}")
        if name in arguments:
            raise UsageError(f"argument {name!r} is given twice")
        if raw_json:
            try:
                arguments[name] = json.loads(text)
            except ValueError as exc:
                raise UsageError(f"argument {name!r}: {text!r} is not JSON ({exc})") from None
        else:
            prop = declared.get(name)
            if prop is None and declared:
                hint = did_you_mean(name, declared)
                if hint:  # an open schema takes it, but a typo is likelier than an extra argument
                    raise UsageError(f"the tool declares no argument {name!r}{hint}")
            arguments[name] = typed(name, text, prop or {})
    required = schema.get("required") if isinstance(schema, dict) else None
    missing = [name for name in required or [] if isinstance(name, str) and name not in arguments]
    if missing:
        shown = ", ".join(f"{name} ({kind_of(declared.get(name, {})) or 'any'})" for name in missing)
        raise UsageError(f"missing required argument{'s' if len(missing) > 1 else ''}: {shown}")
    return arguments
