"""What a person at the terminal sees and answers: a live progress bar and status line on stderr (with `rich`,
only when stderr is a terminal and the output is not `--json`), the upstream's questions asked field by field,
the Ctrl-C question, and the result on stdout. Prompts go to stderr, so stdout holds the result alone.
Imports `arguments.py` (fields are typed as arguments are) and, when it shows progress, `rich`.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Final, Protocol, TextIO

from proxy.client.arguments import UsageError, kind_of, properties, typed

# The proxy's statusMessage for upstream progress: `50/100 — indexing` (proxy/wire/tasks.py).
_PROGRESS_MESSAGE: Final = re.compile(r"^(\d+(?:\.\d+)?)(?:/(\d+(?:\.\d+)?))?(?: — (.*))?$", re.DOTALL)


def parse_status(message: str | None) -> tuple[float | None, float | None, str]:
    """(progress, total, text) of a statusMessage; a message in another form is all text."""
    if not message:
        return None, None, ""
    found = _PROGRESS_MESSAGE.match(message)
    if found is None:
        return None, None, message
    total = float(found.group(2)) if found.group(2) else None
    return float(found.group(1)), total, found.group(3) or ""


class Display(Protocol):
    def update(self, status: str, progress: float | None = None, total: float | None = None) -> None: ...

    def note(self, text: str) -> None: ...

    def paused(self) -> Any: ...

    def stop(self) -> None: ...


class Quiet:
    """No live display: stderr is not a terminal, or the output is JSON."""

    def update(self, status: str, progress: float | None = None, total: float | None = None) -> None:
        return None

    def note(self, text: str) -> None:
        say(text)

    @contextmanager
    def paused(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        return None


class Live:
    """A rich progress bar with the elapsed time and a status line, on stderr; indeterminate until the upstream
    says how far it is."""

    def __init__(self, label: str) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=Console(stderr=True),
            transient=True,
        )
        self._bar = self._progress.add_task(label, total=None, status="starting")
        self._progress.start()

    def update(self, status: str, progress: float | None = None, total: float | None = None) -> None:
        if progress is not None and total:
            self._progress.update(self._bar, completed=progress, total=total, status=status)
        else:
            self._progress.update(self._bar, status=status)

    def note(self, text: str) -> None:
        self._progress.console.print(text, highlight=False)

    @contextmanager
    def paused(self) -> Iterator[None]:
        self._progress.stop()
        try:
            yield
        finally:
            self._progress.start()

    def stop(self) -> None:
        self._progress.stop()


def display(label: str, *, json_output: bool, stream: TextIO = sys.stderr) -> Display:
    """A live display on a terminal, else none."""
    return Live(label) if stream.isatty() and not json_output else Quiet()


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def read_line(prompt: str) -> str | None:
    """One line typed at the terminal after `prompt` (on stderr); None at end of input."""
    sys.stderr.write(prompt)
    sys.stderr.flush()
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def confirm(question: str) -> bool:
    answer = read_line(f"{question} [y/N] ")
    return answer is not None and answer.strip().lower() in ("y", "yes")


# --- the upstream's questions ------------------------------------------------------------------------------


def answer(request: Mapping[str, Any]) -> dict[str, Any] | None:
    """The response to one of the upstream's requests: an elicitation is asked field by field (accept, decline
    or cancel); None for a kind this client did not declare (it is left unanswered)."""
    if request.get("method") != "elicitation/create":
        return None
    params = request.get("params") if isinstance(request.get("params"), dict) else {}
    assert isinstance(params, dict)
    say(f"\nThe server asks: {params.get('message', '(no message)')}")
    choice = read_line("Answer (a), decline (d) or cancel (c)? [a] ")
    if choice is None or choice.strip().lower() in ("c", "cancel"):
        return {"action": "cancel"}
    if choice.strip().lower() in ("d", "decline"):
        return {"action": "decline"}
    schema = params.get("requestedSchema")
    required = set(schema.get("required") or []) if isinstance(schema, dict) else set()
    content: dict[str, Any] = {}
    for name, prop in properties(schema).items():
        value = _field(name, prop, name in required)
        if value is not None:
            content[name] = value
    return {"action": "accept", "content": content}


def _field(name: str, prop: Mapping[str, Any], required: bool) -> Any:
    """One field asked until it is valid (or left empty when optional)."""
    kind = kind_of(prop) or "string"
    choices = prop.get("enum")
    shown = f"one of {', '.join(map(str, choices))}" if isinstance(choices, list) else kind
    title = prop.get("title") or name
    description = f" — {prop['description']}" if isinstance(prop.get("description"), str) else ""
    while True:
        line = read_line(f"  {title}{description} ({shown}{', required' if required else ''}): ")
        if line is None or (line == "" and not required):
            return prop.get("default") if line == "" else None
        if line == "":
            say("    an answer is required")
            continue
        try:
            return typed(name, line, prop)
        except UsageError as exc:
            say(f"    {exc}")


# --- results --------------------------------------------------------------------------------------------------


def print_result(result: Mapping[str, Any], *, json_output: bool) -> None:
    """A CallToolResult on stdout: as one JSON document, or its content as text (other blocks described)."""
    if json_output:
        print(json.dumps(result, indent=2, ensure_ascii=False))
        return
    blocks = result.get("content") if isinstance(result.get("content"), list) else []
    assert isinstance(blocks, list)
    shown = False
    for block in blocks:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            print(block.get("text", ""))
        elif kind == "resource" and isinstance(block.get("resource"), dict):
            resource = block["resource"]
            print(resource.get("text", f"[resource {resource.get('uri', '')}]"))
        else:
            size = len(str(block.get("data", "")))
            print(f"[{kind}: {block.get('mimeType', 'unknown type')}, {size} characters of base64]")
        shown = True
    structured = result.get("structuredContent")
    if structured is not None and not shown:
        print(json.dumps(structured, indent=2, ensure_ascii=False))
