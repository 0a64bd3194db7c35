"""Fixtures for the Tasks extension scenarios: ordinary synchronous legacy tools (the proxy is what
turns them into tasks) - ``greet``, cancellable ``slow_compute``, ``failing_job`` (isError result),
``protocol_error_job`` (JSON-RPC error), ``confirm_delete`` (one elicitation) and ``multi_input``
(two concurrent elicitations).
"""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from mcp import types
from mcp.server.fastmcp import FastMCP
from mcp.shared.exceptions import McpError
from pydantic import Field

from tests.upstream.support import Ctx, content_str, elicit, text_result

PROTOCOL_ERROR_JOB_CODE = types.INTERNAL_ERROR


def register(mcp: FastMCP[Any]) -> None:
    """Register the tasks fixtures on ``mcp``."""

    @mcp.tool(name="greet", description="Returns exactly 'Hello, {name}!'")
    async def greet(name: Annotated[str, Field(description="Who to greet")]) -> types.CallToolResult:
        return text_result(f"Hello, {name}!")

    @mcp.tool(
        name="slow_compute",
        description="Sleeps `seconds` (cancellable), then returns a text mentioning `label`",
    )
    async def slow_compute(
        seconds: Annotated[float, Field(description="How long to work, in seconds", ge=0)],
        label: Annotated[str, Field(description="Echoed back in the result")] = "",
    ) -> types.CallToolResult:
        await anyio.sleep(seconds)
        return text_result(f"slow_compute finished: label={label} seconds={seconds:g}")

    @mcp.tool(name="failing_job", description="Works ~1 s, then returns a tool execution error (isError: true)")
    async def failing_job() -> types.CallToolResult:
        await anyio.sleep(1.0)
        return text_result("failing_job failed: simulated tool execution error", is_error=True)

    @mcp.tool(
        name="protocol_error_job",
        description="Works ~1 s, then fails with a JSON-RPC error (-32603), not an isError result",
    )
    async def protocol_error_job() -> types.CallToolResult:
        await anyio.sleep(1.0)
        raise McpError(
            types.ErrorData(code=PROTOCOL_ERROR_JOB_CODE, message="protocol_error_job: simulated protocol error")
        )

    @mcp.tool(
        name="confirm_delete",
        description="Asks (one elicitation, boolean `confirm`) whether to delete `filename`, then reports",
    )
    async def confirm_delete(
        ctx: Ctx, filename: Annotated[str, Field(description="File to (pretend to) delete")]
    ) -> types.CallToolResult:
        result = await elicit(
            ctx,
            f"Delete {filename}?",
            {
                "type": "object",
                "properties": {"confirm": {"type": "boolean", "description": f"Confirm deleting {filename}"}},
                "required": ["confirm"],
            },
        )
        confirmed = result.action == "accept" and result.content is not None and result.content.get("confirm") is True
        if confirmed:
            return text_result(f"Deleted {filename}")
        return text_result(f"Kept {filename} (action={result.action})")

    @mcp.tool(
        name="multi_input",
        description="Two concurrent elicitations (name, color); returns both answers",
    )
    async def multi_input(ctx: Ctx) -> types.CallToolResult:
        answers: dict[str, str] = {}

        async def ask(field: str, message: str) -> None:
            schema = {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}
            answers[field] = content_str(await elicit(ctx, message, schema), field)

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask, "name", "What is your name?")
            tg.start_soon(ask, "color", "What is your favorite color?")
        return text_result(f"name={answers['name']}; color={answers['color']}")
