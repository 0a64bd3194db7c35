"""The anchor of the task rows: FastMCP with fastmcp-tasks, tasks in memory (no durability), serving the same
`echo {text}` and `sleep {seconds}` tools natively as an MCP 2026-07-28 server with the Tasks extension. The
proxy's task rows are ratios against it: what a server that runs tasks itself, in one process, costs.

FastMCP needs the mcp 2.x SDK and the fixture servers the 1.x one, so it runs from a virtual environment of its
own (`make bench` makes `.venv-anchor`); `run.py` starts it there and skips the anchored rows without it.

    .venv-anchor/bin/python -m benchmarks.anchor --port N
"""

from __future__ import annotations

import argparse
import asyncio

from fastmcp import FastMCP
from fastmcp.utilities.tasks import TaskConfig
from fastmcp_tasks import TasksExtension

mcp = FastMCP("bench-anchor")
mcp.add_extension(TasksExtension(url="memory://", concurrency=20_000))


@mcp.tool
async def echo(text: str) -> str:
    """Returns `text`."""
    return text


@mcp.tool(task=TaskConfig(mode="required"))
async def sleep(seconds: float) -> str:
    """Sleeps `seconds`, then returns."""
    await asyncio.sleep(seconds)
    return f"slept {seconds:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    mcp.run(transport="http", host="127.0.0.1", port=args.port, path="/mcp", show_banner=False, log_level="warning")


if __name__ == "__main__":
    main()
