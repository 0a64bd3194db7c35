"""What `tools`, `call` and `follow` do (`command_line.py` parses them): the tool list; a call whose arguments are
typed by its tool's inputSchema, answered questions retried with the answers (MRTR), and a task followed by
polling `tasks/get` at its `pollIntervalMs` until it ends, its progress shown and its questions asked; Ctrl-C
cancels the request, or during a task asks whether to cancel it or leave it running. Imports the client's other
modules and `proxy.background`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Coroutine, Mapping
from typing import Any, Final, TypeVar

from proxy.background import Background
from proxy.client import terminal
from proxy.client.arguments import UsageError, parse
from proxy.client.connection import Connection, RpcError, UnreachableError, param_header_values
from proxy.client.terminal import Display
from proxy.config.suggest import did_you_mean

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1  # a tool error, a JSON-RPC error, a failed or cancelled task
EXIT_USAGE: Final = 2
EXIT_UNREACHABLE: Final = 3
EXIT_INTERRUPTED: Final = 130  # the shell's code for Ctrl-C: the task was left running
_TERMINAL: Final = frozenset({"completed", "failed", "cancelled"})
_T = TypeVar("_T")


class _Run:
    """One command's connection, display and Ctrl-C."""

    def __init__(self, connection: Connection, display: Display, json_output: bool, interactive: bool) -> None:
        self.connection = connection
        self.display = display
        self.json_output = json_output
        self.interactive = interactive
        self.interrupted = asyncio.Event()
        self.background = Background("client_request_failed")

    async def unless_interrupted(self, work: Coroutine[Any, Any, _T]) -> _T | None:
        """`work`'s outcome, or None once Ctrl-C came first (the work is then cancelled: its request closed)."""
        job = self.background.spawn(_outcome(work), "client-request")
        stop = self.background.spawn(self.interrupted.wait(), "client-interrupt")
        try:
            await asyncio.wait({job, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        if not job.done():
            job.cancel()
            return None
        value, failure = job.result()
        if failure is not None:
            raise failure
        return value


async def _outcome(work: Coroutine[Any, Any, _T]) -> tuple[_T | None, Exception | None]:
    """What `work` gave, or the client's own failure it met (the endpoint unreachable, a JSON-RPC error)."""
    try:
        return await work, None
    except (RpcError, UnreachableError) as exc:
        return None, exc


async def run(args: argparse.Namespace, url: str, headers: dict[str, str]) -> int:
    """Run the command `args` name against `url`; its exit code."""
    interactive = sys.stdin.isatty() and sys.stderr.isatty() and not args.no_input
    version = _version()
    async with Connection(url, headers, elicitation=interactive, version=version) as connection:
        label = {"tools": "tools/list", "call": getattr(args, "tool", ""), "follow": getattr(args, "task_id", "")}
        display = (
            terminal.Quiet()
            if args.command == "tools"
            else terminal.display(label[args.command], json_output=args.json)
        )
        run = _Run(connection, display, args.json, interactive)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, run.interrupted.set)
        try:
            if args.command == "tools":
                return await _tools(run)
            if args.command == "call":
                return await _call(run, args.tool, args.arguments)
            return await _follow(run, args.task_id, None)
        finally:
            display.stop()
            loop.remove_signal_handler(signal.SIGINT)
            await run.background.close()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mcp-tasks-proxy")
    except PackageNotFoundError:  # pragma: no cover - a source tree without metadata
        return "0.0.0"


async def _tool_list(connection: Connection) -> dict[str, dict[str, Any]]:
    """Every tool, by name (all pages)."""
    tools: dict[str, dict[str, Any]] = {}
    cursor: str | None = None
    for _ in range(100):
        page = await connection.request("tools/list", {"cursor": cursor} if cursor else None)
        for tool in page.get("tools") or []:
            if isinstance(tool, dict) and isinstance(tool.get("name"), str):
                tools[tool["name"]] = tool
        cursor = page.get("nextCursor") if isinstance(page.get("nextCursor"), str) else None
        if cursor is None:
            break
    return tools


async def _tools(run: _Run) -> int:
    tools = await _tool_list(run.connection)
    if run.json_output:
        print(json.dumps({"tools": list(tools.values())}, indent=2, ensure_ascii=False))
        return EXIT_OK
    width = max((len(name) for name in tools), default=0)
    for name, tool in tools.items():
        description = str(tool.get("description") or tool.get("title") or "").strip().splitlines()
        print(f"{name.ljust(width)}  {description[0] if description else ''}".rstrip())
    return EXIT_OK


async def _call(run: _Run, name: str, words: list[str]) -> int:
    tools = await _tool_list(run.connection)
    tool = tools.get(name)
    if tool is None:
        raise UsageError(f"the proxy serves no tool {name!r}{did_you_mean(name, tools)} (mcp-tasks-proxy tools)")
    schema = tool.get("inputSchema")
    arguments = parse(words, schema)
    headers = param_header_values(schema, arguments)
    params: dict[str, Any] = {"name": name, "arguments": arguments}

    def progress(update: dict[str, Any]) -> None:
        shown, total = update.get("progress"), update.get("total")
        run.display.update(
            str(update.get("message") or "working"),
            float(shown) if isinstance(shown, int | float) else None,
            float(total) if isinstance(total, int | float) else None,
        )

    while True:
        result = await run.unless_interrupted(
            run.connection.request("tools/call", params, name=name, headers=headers, progress=progress)
        )
        if result is None:
            run.display.stop()
            terminal.say("mcp-tasks-proxy: interrupted; the call was cancelled (its request closed)")
            return EXIT_INTERRUPTED
        kind = result.get("resultType", "complete")
        if kind == "task" and isinstance(result.get("taskId"), str):
            return await _follow(run, result["taskId"], result)
        if kind == "input_required":  # answered here, then the same call again with the answers (MRTR)
            retry: dict[str, Any] = {"name": name, "arguments": arguments}
            requests = result.get("inputRequests")
            if isinstance(requests, dict) and requests:
                with run.display.paused():
                    retry["inputResponses"] = await asyncio.to_thread(_answers, run, requests)
            if "requestState" in result:
                retry["requestState"] = result["requestState"]
            params = retry
            continue
        run.display.stop()
        terminal.print_result(result, json_output=run.json_output)
        return EXIT_FAILED if result.get("isError") else EXIT_OK


def _answers(run: _Run, requests: Mapping[str, Any]) -> dict[str, Any]:
    """The person's answers to the upstream's requests that this client can answer (an elicitation)."""
    answers = {}
    for key, request in requests.items():
        if not run.interactive or not isinstance(request, dict):
            continue
        answered = terminal.answer(request)
        if answered is not None:
            answers[key] = answered
    return answers


async def _follow(run: _Run, task_id: str, created: Mapping[str, Any] | None) -> int:
    """Poll the task until it ends, showing its status and asking its questions; Ctrl-C asks what to do."""
    connection = run.connection
    interval = _interval(created)
    said_waiting = False
    if created is not None:
        run.display.note(f"task {task_id}")
    while True:
        task = await run.unless_interrupted(connection.request("tasks/get", {"taskId": task_id}, name=task_id))
        if task is None:
            return await _interrupted(run, task_id)
        interval = _interval(task) or interval
        status = str(task.get("status"))
        shown, total, text = terminal.parse_status(task.get("statusMessage"))
        run.display.update(text or status.replace("_", " "), shown, total)
        if status in _TERMINAL:
            run.display.stop()
            if status == "completed" and isinstance(task.get("result"), dict):
                terminal.print_result(task["result"], json_output=run.json_output)
                return EXIT_FAILED if task["result"].get("isError") else EXIT_OK
            if run.json_output:
                print(json.dumps({key: value for key, value in task.items() if key != "resultType"}, indent=2))
            error = task.get("error") if isinstance(task.get("error"), dict) else {}
            assert isinstance(error, dict)
            terminal.say(f"task {task_id} {status}" + (f": {error.get('message')}" if error.get("message") else ""))
            return EXIT_FAILED
        requests = task.get("inputRequests")
        if status == "input_required" and isinstance(requests, dict) and requests:
            if run.interactive:
                with run.display.paused():
                    answers = await asyncio.to_thread(_answers, run, requests)
                if answers:
                    await connection.request(
                        "tasks/update", {"taskId": task_id, "inputResponses": answers}, name=task_id
                    )
                    continue
            elif not said_waiting:
                run.display.note(f"task {task_id} waits for an answer; follow it on a terminal to give one")
                said_waiting = True
        try:
            await asyncio.wait_for(run.interrupted.wait(), interval)
        except TimeoutError:
            continue
        return await _interrupted(run, task_id)


def _interval(task: Mapping[str, Any] | None) -> float:
    """The task's suggested poll interval in seconds (none: 0, the caller keeps its own; at least 0.1 s)."""
    milliseconds = task.get("pollIntervalMs") if task is not None else None
    return max(0.1, milliseconds / 1000) if isinstance(milliseconds, int | float) and milliseconds > 0 else 1.0


async def _interrupted(run: _Run, task_id: str) -> int:
    """Ctrl-C during a task: cancel it (when the person says so) or leave it running and say how to follow it."""
    run.display.stop()
    run.interrupted.clear()
    cancel = run.interactive and await asyncio.to_thread(terminal.confirm, f"\nCancel task {task_id}?")
    if cancel:
        await run.connection.request("tasks/cancel", {"taskId": task_id}, name=task_id)
        terminal.say(f"task {task_id} cancelled")
        return EXIT_FAILED
    terminal.say(f"task {task_id} keeps running; follow it with: mcp-tasks-proxy follow {task_id}")
    return EXIT_INTERRUPTED
