"""Each end of a live call has one writer: the client side is changed only by `effects/client.py`, the upstream
side only by `effects/pump.py`, the record side only by `effects/records.py` (and each end's own methods, in
`live_call.py`). Read from the source: an assignment to `<call>.<end>.<field>`, or a call of a client end's
queueing methods, anywhere else fails."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWNERS = {
    "client": "proxy/tasks/effects/client.py",
    "upstream": "proxy/tasks/effects/pump.py",
    "stored": "proxy/tasks/effects/records.py",
}
CLIENT_WRITES = frozenset({"queue", "replace_progress", "next", "drop_notes"})


def writes(source: str) -> list[tuple[str, int]]:
    """(end, line) of each write to a live call's end in `source`."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in CLIENT_WRITES
            and isinstance(node.func.value, ast.Attribute)
            and node.func.value.attr == "client"
        ):
            found.append(("client", node.lineno))
        for target in targets:
            end = target.value if isinstance(target, ast.Attribute) else None
            if isinstance(end, ast.Attribute) and end.attr in OWNERS:
                found.append((end.attr, target.lineno))
    return sorted(found, key=lambda write: write[1])


def test_each_end_of_a_live_call_is_written_by_its_one_owner() -> None:
    strangers = []
    for path in sorted((ROOT / "proxy").rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == "proxy/tasks/live_call.py":
            continue  # where the ends are defined (and `new_call` builds them)
        for end, line in writes(path.read_text(encoding="utf-8")):
            if OWNERS[end] != relative:
                strangers.append(f"{relative}:{line} writes the {end} end")
    assert strangers == []
    assert any(end == "upstream" for end, _ in writes((ROOT / OWNERS["upstream"]).read_text()))  # it sees them


def test_the_check_sees_each_form_of_write() -> None:
    source = (
        "call.client.reply = future\n"
        "call.upstream.pump: Task = task\n"
        "self.call.stored.fence = fence\n"
        "call.client.queue(message)\n"
        "call.client.dropped += 1\n"
        "call.client.channel.write(data)\n"  # a write through the end, not to it: not counted
        "other.session = None\n"
    )
    assert writes(source) == [("client", 1), ("upstream", 2), ("stored", 3), ("client", 4), ("client", 5)]
