"""Background work has one owner: `proxy/background.py` starts every task (named, referenced until done,
cancelled when its owner closes). ruff bans `asyncio.create_task` and `asyncio.ensure_future` by name; a
method called on an object (`loop.create_task`, `asyncio.get_running_loop().create_task`) is invisible to it,
so this walks proxy/'s syntax trees for any call of either name outside the owner."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import structlog.testing

from proxy.background import Background

PROXY = Path(__file__).resolve().parent.parent / "proxy"
OWNERS = {Path("background.py")}  # relative to proxy/
STARTERS = {"create_task", "ensure_future"}


def task_starts(source: str, filename: str = "<source>") -> list[int]:
    """The lines of `source` that call a function or method named create_task or ensure_future."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Call):
            called = node.func
            name = (
                called.attr
                if isinstance(called, ast.Attribute)
                else called.id
                if isinstance(called, ast.Name)
                else None
            )
            if name in STARTERS:
                lines.append(node.lineno)
    return sorted(lines)


def test_no_module_of_the_proxy_but_the_owner_starts_a_task() -> None:
    modules = sorted(PROXY.rglob("*.py"))
    assert len(modules) > 100  # the glob found the package
    offenders = {
        str(path.relative_to(PROXY)): lines
        for path in modules
        if path.relative_to(PROXY) not in OWNERS and (lines := task_starts(path.read_text(encoding="utf-8"), str(path)))
    }
    assert offenders == {}


def test_the_walk_sees_each_way_of_starting_a_task() -> None:
    source = (
        "import asyncio\n"
        "from asyncio import ensure_future\n"
        "loop = asyncio.get_running_loop()\n"
        "loop.create_task(work())\n"
        "asyncio.get_running_loop().create_task(work(), name='x')\n"
        "asyncio.create_task(work())\n"
        "ensure_future(work())\n"
        "spawn(work(), 'named')\n"
    )
    assert task_starts(source) == [4, 5, 6, 7]


async def test_closing_the_owner_cancels_what_still_runs_and_waits_for_it() -> None:
    background = Background()
    ended = asyncio.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            ended.set()

    task = background.spawn(forever(), "forever")
    await asyncio.sleep(0)
    assert task.get_name() == "forever"
    await background.close()
    assert task.cancelled()
    assert ended.is_set()


async def test_a_task_that_crashed_is_logged_by_name_and_let_go() -> None:
    background = Background("sample_task_failed")

    async def crash() -> None:
        raise RuntimeError("boom")

    with structlog.testing.capture_logs() as events:
        task = background.spawn(crash(), "crasher")
        await asyncio.wait([task])
        await asyncio.sleep(0)  # the done callback runs
    assert [(event["event"], event["task"]) for event in events] == [("sample_task_failed", "crasher")]
    await background.close(grace_seconds=0.1)  # nothing is left to cancel or wait for
