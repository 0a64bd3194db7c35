"""Fixtures the 2026-07-28 conformance scenarios reach *through the proxy*, written the legacy
imperative way: where the suite expects an MRTR ``InputRequiredResult`` round, the tool simply awaits
``elicitation/create`` / ``sampling/createMessage`` / ``roots/list`` mid-call and the proxy translates.
Also the server-stateless helpers (missing capability, streaming, logging, list-changed triggers).
"""

from __future__ import annotations

from typing import Any

import anyio
from mcp import types
from mcp.server.fastmcp import FastMCP
from mcp.server.fastmcp.prompts.base import Message, UserMessage

from tests.upstream.support import Ctx, client_supports, content_str, elicit, list_roots, log, sample, text_result


def _string_schema(field: str) -> dict[str, Any]:
    return {"type": "object", "properties": {field: {"type": "string"}}, "required": [field]}


_CONFIRM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
}


def _confirmed(result: types.ElicitResult) -> bool:
    return result.action == "accept" and result.content is not None and result.content.get("ok") is True


def register(mcp: FastMCP[Any]) -> None:
    """Register the 2026-07-28 core fixtures on ``mcp``."""

    @mcp.tool(
        name="test_missing_capability",
        description="Requires the client's sampling capability: samples once, then returns Success",
    )
    async def test_missing_capability(ctx: Ctx) -> types.CallToolResult:
        # The SDK's default way: naming no request, so over HTTP it goes out on the session's GET stream.
        prompt = types.TextContent(type="text", text="Reply with any text to prove sampling works.")
        result = await ctx.session.create_message(
            messages=[types.SamplingMessage(role="user", content=prompt)], max_tokens=20
        )
        answer = result.content.text if isinstance(result.content, types.TextContent) else result.content.type
        return text_result(f"Success (sampled: {answer})")

    @mcp.tool(
        name="test_streaming_elicitation",
        description="Reports progress, then elicits a value mid-call, then completes",
    )
    async def test_streaming_elicitation(ctx: Ctx) -> types.CallToolResult:
        await ctx.report_progress(50, 100, "half way")
        result = await elicit(ctx, "Streaming elicitation: provide a value", _string_schema("value"))
        return text_result(f"Streaming complete (value={content_str(result, 'value')})")

    @mcp.tool(name="test_logging_tool", description="Emits one info log message, then returns")
    async def test_logging_tool(ctx: Ctx) -> types.CallToolResult:
        await log(ctx, "info", "Diagnostic trace logging activated")
        return text_result("Logging evaluated")

    @mcp.tool(name="test_trigger_tool_change", description="Sends notifications/tools/list_changed")
    async def test_trigger_tool_change(ctx: Ctx) -> types.CallToolResult:
        await ctx.request_context.session.send_tool_list_changed()
        return text_result("Mutation triggered")

    @mcp.tool(name="test_trigger_prompt_change", description="Sends notifications/prompts/list_changed")
    async def test_trigger_prompt_change(ctx: Ctx) -> types.CallToolResult:
        await ctx.request_context.session.send_prompt_list_changed()
        return text_result("Mutation triggered")

    @mcp.tool(
        name="test_input_required_result_elicitation",
        description="Elicits the user's name (key user_name), returns 'Hello, <name>!'",
    )
    async def test_input_required_result_elicitation(ctx: Ctx) -> types.CallToolResult:
        result = await elicit(ctx, "What is your name?", _string_schema("name"))
        return text_result(f"Hello, {content_str(result, 'name')}!")

    @mcp.tool(
        name="test_input_required_result_sampling",
        description="Samples 'What is the capital of France?', returns 'Sampling result: <text>'",
    )
    async def test_input_required_result_sampling(ctx: Ctx) -> types.CallToolResult:
        return text_result(f"Sampling result: {await sample(ctx, 'What is the capital of France?')}")

    @mcp.tool(
        name="test_input_required_result_list_roots",
        description="Lists the client's roots, returns 'Found <n> root(s)'",
    )
    async def test_input_required_result_list_roots(ctx: Ctx) -> types.CallToolResult:
        return text_result(f"Found {len(await list_roots(ctx))} root(s)")

    @mcp.tool(
        name="test_input_required_result_request_state",
        description="Elicits a boolean confirmation; returns 'state-ok: ...' when confirmed",
    )
    async def test_input_required_result_request_state(ctx: Ctx) -> types.CallToolResult:
        result = await elicit(ctx, "Please confirm", _CONFIRM_SCHEMA)
        if _confirmed(result):
            return text_result("state-ok: requestState validated")
        return text_result(f"state-not-confirmed: action={result.action}")

    @mcp.tool(
        name="test_input_required_result_multiple_inputs",
        description="Concurrently elicits a name, samples a greeting and lists roots; returns all three",
    )
    async def test_input_required_result_multiple_inputs(ctx: Ctx) -> types.CallToolResult:
        answers: dict[str, str] = {}

        async def ask_name() -> None:
            answers["name"] = content_str(await elicit(ctx, "What is your name?", _string_schema("name")), "name")

        async def ask_greeting() -> None:
            answers["greeting"] = await sample(ctx, "Generate a greeting", max_tokens=50)

        async def ask_roots() -> None:
            answers["roots"] = str(len(await list_roots(ctx)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(ask_name)
            tg.start_soon(ask_greeting)
            tg.start_soon(ask_roots)
        return text_result(f"Name: {answers['name']}; Greeting: {answers['greeting']}; Roots: {answers['roots']}")

    @mcp.tool(
        name="test_input_required_result_multi_round",
        description="Elicits a name, then (second round) a favourite colour; returns both",
    )
    async def test_input_required_result_multi_round(ctx: Ctx) -> types.CallToolResult:
        name = content_str(await elicit(ctx, "Step 1: What is your name?", _string_schema("name")), "name")
        color = content_str(await elicit(ctx, "Step 2: What is your favorite color?", _string_schema("color")), "color")
        return text_result(f"Multi-round complete for {name} who likes {color}")

    @mcp.tool(
        name="test_input_required_result_tampered_state",
        description="Elicits a boolean confirmation; returns 'integrity-ok: ...' (state integrity is the proxy's job)",
    )
    async def test_input_required_result_tampered_state(ctx: Ctx) -> types.CallToolResult:
        result = await elicit(ctx, "Please confirm", _CONFIRM_SCHEMA)
        return text_result(f"integrity-ok: state verified (action={result.action})")

    @mcp.tool(
        name="test_input_required_result_capabilities",
        description="Elicits only if the client declared elicitation, samples only if it declared sampling",
    )
    async def test_input_required_result_capabilities(ctx: Ctx) -> types.CallToolResult:
        received: list[str] = []

        async def ask_elicit() -> None:
            await elicit(ctx, "Elicitation input", _string_schema("value"))
            received.append("elicit_input")

        async def ask_sample() -> None:
            await sample(ctx, "Sample request", max_tokens=50)
            received.append("sample_input")

        async with anyio.create_task_group() as tg:
            if client_supports(ctx, types.ClientCapabilities(elicitation=types.ElicitationCapability())):
                tg.start_soon(ask_elicit)
            if client_supports(ctx, types.ClientCapabilities(sampling=types.SamplingCapability())):
                tg.start_soon(ask_sample)
        if not received:
            return text_result("No supported capabilities declared")
        return text_result(f"capabilities-ok: received {','.join(sorted(received))}")

    @mcp.tool(
        name="test_tool_with_task",
        description="Elicits a user name, works for ~1 s, returns text containing the name",
    )
    async def test_tool_with_task(ctx: Ctx) -> types.CallToolResult:
        name = content_str(await elicit(ctx, "What is your name?", _string_schema("name")), "name")
        await anyio.sleep(1.0)
        return text_result(f"Task completed for {name}")

    @mcp.prompt(
        name="test_input_required_result_prompt",
        description="Prompt that elicits the context to use while being rendered (prompts/get)",
    )
    async def test_input_required_result_prompt() -> list[Message]:
        # Not a `ctx: Ctx` parameter: FastMCP wraps prompt functions in pydantic's validate_call, which
        # re-validates a parameterised Context into a copy without its request context.
        ctx = mcp.get_context()
        result = await elicit(ctx, "What context should the prompt use?", _string_schema("context"))
        return [UserMessage(f"Prompt with context: {content_str(result, 'context')}")]
