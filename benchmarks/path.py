"""The path of one `tools/call` that becomes a task, as the proxy's own code runs it: which proxy modules it
crosses, in the order it first enters each, and how many module-to-module steps (distinct caller module ->
callee module pairs) it takes.

    python -m benchmarks.path [--json]

The lean upstream, then a proxy in this process (the defaults, `logging.level: warning`, metrics off, a
SQLite store) with the upstream's `sleep` tool `required`: a declaring client's call of it is a task at once.
One call warms everything up (imports, the first session, the store's statements); the next is profiled
with `sys.setprofile` on the event loop's thread, in two parts: the request (its arrival to the
`CreateTaskResult`) and the task (from then until the upstream's result is committed and the task reads
`completed`; the one `tasks/get` that confirms it is left out). What the store's threads run is not counted.
Run it on two trees (`PYTHONPATH=<tree> python -m benchmarks.path`) to compare a change's path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from benchmarks.harness import ModernClient, free_port, start_upstream

SLEEP_SECONDS = 0.05


@dataclass
class CallPath:
    """What one part of the call ran: modules in first-entry order, the functions of each, the steps."""

    modules: dict[str, set[str]] = field(default_factory=dict)
    steps: set[tuple[str, str]] = field(default_factory=set)

    def as_json(self) -> dict[str, Any]:
        return {
            "modules": list(self.modules),
            "functions": sum(len(functions) for functions in self.modules.values()),
            "steps": len(self.steps),
        }


def _module_of(code: types.CodeType, root: str) -> str | None:
    filename = code.co_filename
    if not filename.startswith(root):
        return None
    return filename[len(root) - len("proxy/") :].removesuffix(".py").removesuffix("/__init__").replace("/", ".")


class Recorder:
    def __init__(self) -> None:
        import proxy

        self.root = str(Path(proxy.__file__).parent) + "/"
        self.part: CallPath | None = None

    def profile(self, frame: types.FrameType, event: str, arg: object) -> None:
        if event != "call" or self.part is None:
            return
        module = _module_of(frame.f_code, self.root)
        if module is None:
            return
        name = frame.f_code.co_qualname
        if name.endswith("<lambda>"):
            name = f"{name}:{frame.f_code.co_firstlineno}"  # the lambdas of one function apart
        self.part.modules.setdefault(module, set()).add(name)
        caller = frame.f_back
        while caller is not None and _module_of(caller.f_code, self.root) is None:
            caller = caller.f_back  # through the event loop and aiohttp to the proxy code that scheduled it
        origin = _module_of(caller.f_code, self.root) if caller is not None else "(event loop)"
        if origin != module:
            self.part.steps.add((origin or "(event loop)", module))


async def _settled(client: ModernClient, task_id: str) -> None:
    """Polls the warm-up task until it is no longer working (a client has nothing else to wait on)."""
    for _ in range(500):
        if (await client.get(task_id))["status"] != "working":
            return
        await asyncio.sleep(0.01)
    raise RuntimeError("the warm-up task did not settle in 5 s")


async def call_path() -> dict[str, CallPath]:
    """The two parts of one task-making call's path (`request`, `task`), measured as the module says."""
    from proxy.config.loader import load_config
    from proxy.edge.app import create_app

    upstream = await start_upstream()
    try:
        with tempfile.TemporaryDirectory() as workdir:
            config = load_config(
                None,
                environ={},
                overrides={
                    "upstream": {"url": upstream.url},
                    "store": {"path": str(Path(workdir) / "tasks.db")},
                    "logging": {"level": "warning"},
                    "observability": {"metrics": False},
                    "tasks": {"tools": {"sleep": {"mode": "required"}}},
                },
            )
            runner = web.AppRunner(create_app(config))
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            client = ModernClient(f"http://127.0.0.1:{port}/mcp", declares_tasks=True)
            try:
                await _settled(client, (await client.create(SLEEP_SECONDS))["taskId"])
                recorder = Recorder()
                parts = {"request": CallPath(), "task": CallPath()}
                sys.setprofile(recorder.profile)
                try:
                    recorder.part = parts["request"]
                    created = await client.create(SLEEP_SECONDS)
                    recorder.part = parts["task"]
                    await asyncio.sleep(SLEEP_SECONDS * 6)
                    recorder.part = None
                finally:
                    sys.setprofile(None)
                task = await client.get(created["taskId"])
                if task["status"] != "completed":
                    raise RuntimeError(f"the task did not complete in {SLEEP_SECONDS * 6} s: {task}")
                return parts
            finally:
                client.close()
                await runner.cleanup()
    finally:
        upstream.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--functions", action="store_true", help="name the functions run in each module")
    arguments = parser.parse_args()
    from proxy.config.schema import LoggingConfig
    from proxy.observe.logs import configure_logging

    configure_logging(LoggingConfig(level="warning"))  # the process's logging: here, not in `call_path` (a test's)
    parts = asyncio.run(call_path())
    if arguments.json:
        print(json.dumps({name: part.as_json() for name, part in parts.items()}, indent=2))
        return
    every: set[str] = set()
    for name, part in parts.items():
        every |= set(part.modules)
        figures = part.as_json()
        print(f"{name}: {len(part.modules)} modules, {figures['functions']} functions, {figures['steps']} steps")
        for number, module in enumerate(part.modules, 1):
            functions = part.modules[module]
            named = f": {', '.join(sorted(functions))}" if arguments.functions else ""
            print(f"  {number:2}. {module} ({len(functions)}){named}")
    print(f"both parts: {len(every)} modules")


if __name__ == "__main__":
    main()
