"""The mcp 2.x Python SDK's client, driven by the tests one JSON line at a time: a 2026-07-28 client that does
not declare the Tasks extension, every request under its own read timeout (10 s unless given). It runs in an
environment of its own (`make` builds .venv-mcp2: mcp 2.x and the project's mcp 1.x cannot share one).

    python mcp2_client.py URL [HEADERS_JSON] [TIMEOUT_SECONDS]
    stdin:  {"op": "list"} | {"op": "call", "name": "...", "arguments": {...}, "progress": false}
    stdout: one JSON line per command: {"result": ..., "elapsedMs": n, "progress": [...]} or {"error": {...}}
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import anyio
import httpx2
from mcp.client.client import Client
from mcp.client.streamable_http import streamable_http_client

MODERN = "2026-07-28"


async def main(url: str, headers: dict[str, str], read_timeout: float) -> None:
    async with (
        httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(read_timeout * 3)) as http,
        Client(
            streamable_http_client(url, http_client=http), mode=MODERN, read_timeout_seconds=read_timeout, cache=None
        ) as client,
    ):
        print(json.dumps({"ready": client.protocol_version}), flush=True)
        stdin = anyio.wrap_file(sys.stdin)
        async for line in stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            started = time.perf_counter()
            progress: list[dict[str, Any]] = []

            async def on_progress(
                value: float, total: float | None, message: str | None, seen: list[dict[str, Any]] = progress
            ) -> None:
                seen.append({"progress": value, "total": total, "message": message})

            try:
                if command["op"] == "list":
                    result: Any = await client.list_tools()
                else:
                    result = await client.call_tool(
                        command["name"],
                        command.get("arguments") or {},
                        progress_callback=on_progress if command.get("progress") else None,
                    )
                answer: dict[str, Any] = {"result": result.model_dump(mode="json", by_alias=True, exclude_none=True)}
            except Exception as exc:  # noqa: BLE001 (whatever the client raised, the test reads what it said)
                answer = {"error": {"message": str(exc), "type": type(exc).__name__}}
            answer.update(elapsedMs=(time.perf_counter() - started) * 1000, progress=progress)
            print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    anyio.run(
        main,
        arguments[0],
        json.loads(arguments[1]) if len(arguments) > 1 else {},
        float(arguments[2]) if len(arguments) > 2 else 10.0,
    )
