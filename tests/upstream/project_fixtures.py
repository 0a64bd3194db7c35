"""Fixtures for the project's own tests: ``sleep`` (progress every 0.1 s), ``chatty`` (log and progress as fast as
they go), ``echo``, ``raise_error``
(JSON-RPC error), ``tool_error`` (isError), ``ask_name`` / ``sample`` / ``list_roots`` (one
server->client request each), ``log``, ``update_resource`` (resources/updated to subscribers) and
``ping_client`` (a ping on the call's stream), ``whoami`` (headers the call arrived with), ``trace_context``
(the W3C trace context the call arrived with, in headers and in ``_meta``) and
``cancelled_requests`` (which tools/call ids the upstream saw cancelled via notifications/cancelled),
``calls_started`` (how many ``sleep`` / ``counted`` calls began: a call is running upstream),
``counted`` / ``call_count`` (how often a call really reached the upstream), ``ask_three`` (sampling and
roots on the GET stream, an elicitation on its own stream, all at once), ``big_text`` (a result of any size).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import anyio
from mcp import types
from mcp.server.fastmcp import FastMCP
from mcp.shared.exceptions import McpError
from mcp.shared.message import ServerMessageMetadata
from pydantic import AnyUrl, Field

from tests.upstream import support
from tests.upstream.support import Ctx, content_str, elicit, text_result

PROGRESS_INTERVAL_S = 0.1


def register(mcp: FastMCP[Any]) -> None:
    """Register the project-test fixtures on ``mcp``."""

    @mcp.tool(
        name="sleep",
        description="Sleeps `seconds` (cancellable), reporting progress every 0.1 s (its message padded to `pad` "
        "characters); returns 'slept {seconds}'",
    )
    async def sleep(
        ctx: Ctx,
        seconds: Annotated[float, Field(description="How long to sleep, in seconds", ge=0)],
        pad: Annotated[int, Field(description="Pad each progress message to this length", ge=0)] = 0,
    ) -> types.CallToolResult:
        support.call_started("sleep")
        start = anyio.current_time()
        while (remaining := seconds - (anyio.current_time() - start)) > 0:
            await anyio.sleep(min(PROGRESS_INTERVAL_S, remaining))
            done = min(seconds, anyio.current_time() - start)
            await ctx.report_progress(round(done, 3), seconds, f"slept {done:.1f}/{seconds:g} s".ljust(pad, "."))
        return text_result(f"slept {seconds:g}")

    @mcp.tool(
        name="chatty",
        description="Sends `count` log messages of `size` characters, each followed by a progress notification, as "
        "fast as the stream takes them; returns 'chatted {count}'",
    )
    async def chatty(
        ctx: Ctx,
        count: Annotated[int, Field(description="How many log messages (and progress notifications)", ge=0)],
        size: Annotated[int, Field(description="Characters in each log message", ge=0)] = 1000,
    ) -> types.CallToolResult:
        for number in range(count):
            await support.log(ctx, "info", f"{number:08d}".ljust(size, "."), logger="chatty")
            await ctx.report_progress(number + 1, count)
        return text_result(f"chatted {count}")

    @mcp.tool(name="echo", description="Returns `text` unchanged")
    async def echo(text: Annotated[str, Field(description="Text to return")]) -> types.CallToolResult:
        return text_result(text)

    @mcp.tool(
        name="raise_error",
        description="Fails with a JSON-RPC error carrying `message` and `code` (default -32602)",
    )
    async def raise_error(
        message: Annotated[str, Field(description="Error message")],
        code: Annotated[int, Field(description="JSON-RPC error code")] = types.INVALID_PARAMS,
    ) -> types.CallToolResult:
        raise McpError(types.ErrorData(code=code, message=message))

    @mcp.tool(name="tool_error", description="Returns an isError result whose text is `message`")
    async def tool_error(message: Annotated[str, Field(description="Error text")]) -> types.CallToolResult:
        return text_result(message, is_error=True)

    @mcp.tool(name="ask_name", description="Elicits a name once; returns 'Hello, <name>'")
    async def ask_name(ctx: Ctx) -> types.CallToolResult:
        result = await elicit(
            ctx,
            "What is your name?",
            {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        )
        if result.action != "accept":
            return text_result(f"No name given (action={result.action})")
        return text_result(f"Hello, {content_str(result, 'name')}")

    @mcp.tool(
        name="ask_then_progress",
        description="Elicits a name, then reports progress 1/2 'greeted' on the call's stream; returns 'Hello, <name>'",
    )
    async def ask_then_progress(ctx: Ctx) -> types.CallToolResult:
        result = await elicit(
            ctx,
            "What is your name?",
            {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
        )
        await ctx.report_progress(1, 2, "greeted")
        return text_result(f"Hello, {content_str(result, 'name')}")

    @mcp.tool(name="ask_many", description="Asks `count` yes/no elicitations at once; returns how many were accepted")
    async def ask_many(
        ctx: Ctx, count: Annotated[int, Field(description="How many questions to ask at once", ge=1, le=500)]
    ) -> types.CallToolResult:
        actions: list[str] = []

        async def ask(number: int) -> None:
            schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
            actions.append((await elicit(ctx, f"Question {number}?", schema)).action)

        async with anyio.create_task_group() as tg:
            for number in range(count):
                tg.start_soon(ask, number)
        return text_result(f"accepted={actions.count('accept')} declined={actions.count('decline')}")

    @mcp.tool(name="ask_url", description="URL-mode elicitation (elicitationId 'consent-1'); returns the action")
    async def ask_url(ctx: Ctx) -> types.CallToolResult:
        result = await ctx.request_context.session.elicit_url(
            "Open the page to give consent",
            "https://consent.example/flow",
            "consent-1",
            related_request_id=ctx.request_context.request_id,
        )
        return text_result(f"url elicitation: action={result.action}")

    @mcp.resource(
        "test://elicited-resource",
        name="elicited-resource",
        description="Elicits the word it holds while being read (resources/read asks the client)",
        mime_type="text/plain",
    )
    async def elicited_resource() -> str:
        # FastMCP resource functions take no Context parameter; the request's context is still current.
        result = await elicit(
            mcp.get_context(),
            "Which word should the resource hold?",
            {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
        )
        return f"word={content_str(result, 'word')}"

    @mcp.tool(name="sample", description="Sends `prompt` via sampling/createMessage; returns the model's text")
    async def sample(
        ctx: Ctx, prompt: Annotated[str, Field(description="Prompt for the client's model")]
    ) -> types.CallToolResult:
        return text_result(await support.sample(ctx, prompt))

    @mcp.tool(
        name="sample_standalone",
        description="Samples with a plain ctx.session.create_message (naming no request: over HTTP it goes out on "
        "the session's GET stream); returns the model's text, or what the refusal said",
    )
    async def sample_standalone(ctx: Ctx) -> types.CallToolResult:
        message = types.SamplingMessage(role="user", content=types.TextContent(type="text", text="Say anything"))
        try:
            result = await ctx.session.create_message(messages=[message], max_tokens=20)
        except McpError as exc:
            return text_result(f"sampling refused: {exc.error.message}")
        content = result.content
        return text_result(content.text if isinstance(content, types.TextContent) else f"<{content.type}>")

    @mcp.tool(name="list_roots", description="Requests roots/list; returns the root URIs joined by ', '")
    async def list_roots(ctx: Ctx) -> types.CallToolResult:
        return text_result(", ".join(str(root.uri) for root in await support.list_roots(ctx)))

    @mcp.tool(name="log", description="Emits notifications/message at `level` with `message`; returns 'logged'")
    async def log(
        ctx: Ctx,
        level: Annotated[types.LoggingLevel, Field(description="Log level")],
        message: Annotated[str, Field(description="Log message")],
    ) -> types.CallToolResult:
        await support.log(ctx, level, message, logger="fixture")
        return text_result("logged")

    @mcp.tool(
        name="update_resource",
        description="Sends notifications/resources/updated for `uri` to every session subscribed to it",
    )
    async def update_resource(
        uri: Annotated[str, Field(description="Resource URI")] = "test://watched-resource",
    ) -> types.CallToolResult:
        sessions = support.subscribers(uri)
        for session in sessions:
            await session.send_resource_updated(AnyUrl(uri))
        return text_result(f"notified {len(sessions)} subscriber(s)")

    @mcp.tool(
        name="ping_client",
        description="Sends a ping to the client on this call's stream, then returns 'pong answered'",
    )
    async def ping_client(ctx: Ctx) -> types.CallToolResult:
        await ctx.request_context.session.send_request(
            types.ServerRequest(types.PingRequest(method="ping")),
            types.EmptyResult,
            metadata=ServerMessageMetadata(related_request_id=ctx.request_context.request_id),
        )
        return text_result("pong answered")

    @mcp.tool(
        name="list_roots_standalone",
        description="Calls the SDK's list_roots(), which goes out on the session's GET stream (not this call's)",
    )
    async def list_roots_standalone(ctx: Ctx) -> types.CallToolResult:
        try:
            result = await ctx.request_context.session.list_roots()
        except McpError as exc:
            return text_result(f"roots refused: {exc.error.message}")
        return text_result(", ".join(str(root.uri) for root in result.roots))

    @mcp.tool(
        name="header_params",
        description="Echoes its arguments; `region`, `count` and `verbose` carry x-mcp-header annotations",
    )
    async def header_params(
        region: Annotated[str, Field(description="Region to run in", json_schema_extra={"x-mcp-header": "Region"})],
        count: Annotated[int, Field(description="How many", json_schema_extra={"x-mcp-header": "Count"})] = 1,
        verbose: Annotated[
            bool, Field(description="Chatty output", json_schema_extra={"x-mcp-header": "Verbose"})
        ] = False,
    ) -> types.CallToolResult:
        return text_result(json.dumps({"region": region, "count": count, "verbose": verbose}))

    @mcp.tool(
        name="whoami",
        description="Returns the Authorization and traceparent headers this server received with the call",
    )
    async def whoami(ctx: Ctx) -> types.CallToolResult:
        request = ctx.request_context.request
        headers = getattr(request, "headers", {})
        seen = {name: headers.get(name) for name in ("authorization", "traceparent")}
        return text_result(json.dumps(seen))

    @mcp.tool(
        name="trace_context",
        description="Returns the W3C trace context this server received with the call: HTTP headers and _meta keys",
    )
    async def trace_context(ctx: Ctx) -> types.CallToolResult:
        request = ctx.request_context.request
        headers = getattr(request, "headers", {})
        meta = ctx.request_context.meta
        extra = (meta.model_extra or {}) if meta is not None else {}
        keys = ("traceparent", "tracestate", "baggage")
        seen = {"headers": {key: headers.get(key) for key in keys}, "meta": {key: extra.get(key) for key in keys}}
        return text_result(json.dumps(seen))

    @mcp.tool(
        name="cancelled_requests",
        description="JSON list of tools/call request ids this server saw cancelled by notifications/cancelled",
    )
    async def cancelled_requests() -> types.CallToolResult:
        return text_result(json.dumps(support.CANCELLED_REQUEST_IDS))

    @mcp.tool(
        name="calls_started",
        description="JSON object: how many calls of `sleep` and of `counted` this server has started, per tool",
    )
    async def calls_started() -> types.CallToolResult:
        return text_result(json.dumps(support.CALLS_STARTED))

    @mcp.tool(
        name="counted",
        description="Counts its calls per `key`, sleeps `seconds` (cancellable), returns the count so far",
    )
    async def counted(
        key: Annotated[str, Field(description="Counter name")],
        seconds: Annotated[float, Field(description="How long to work, in seconds", ge=0)] = 0,
    ) -> types.CallToolResult:
        support.call_started("counted")
        support.CALL_COUNTS[key] = support.CALL_COUNTS.get(key, 0) + 1
        count = support.CALL_COUNTS[key]
        await anyio.sleep(seconds)
        return text_result(str(count))

    @mcp.tool(name="call_count", description="How many times `counted` was called with `key`")
    async def call_count(key: Annotated[str, Field(description="Counter name")]) -> types.CallToolResult:
        return text_result(str(support.CALL_COUNTS.get(key, 0)))

    @mcp.tool(
        name="ask_three",
        description="Asks three questions at once: sampling and roots/list the SDK's default way (no related "
        "request, so on the session's GET stream) and a name elicitation on the call's own stream; returns all "
        "three answers",
    )
    async def ask_three(ctx: Ctx) -> types.CallToolResult:
        session = ctx.request_context.session
        answers: dict[str, str] = {}

        async def sampled() -> None:
            result = await session.create_message(
                messages=[types.SamplingMessage(role="user", content=types.TextContent(type="text", text="2+2?"))],
                max_tokens=10,
            )
            content = result.content
            answers["sampled"] = content.text if isinstance(content, types.TextContent) else content.type

        async def roots() -> None:
            answers["roots"] = ",".join(str(root.uri) for root in (await session.list_roots()).roots)

        async def named() -> None:
            schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
            answers["name"] = content_str(await elicit(ctx, "Your name?", schema), "name")

        async with anyio.create_task_group() as group:
            for ask in (sampled, roots, named):
                group.start_soon(ask)
        return text_result(f"sampled={answers['sampled']}; roots={answers['roots']}; name={answers['name']}")

    @mcp.tool(name="big_text", description="Returns one text block of `size` characters (for size limits)")
    async def big_text(size: Annotated[int, Field(description="Characters of text", ge=0)]) -> types.CallToolResult:
        return text_result("x" * size)

    @mcp.tool(
        name="held",
        description="Holds the call for `seconds` (cancellable) while counting the `held` calls running at once; "
        "returns `tag`",
    )
    async def held(
        tag: Annotated[str, Field(description="Returned as the result's text")],
        seconds: Annotated[float, Field(description="How long to hold the call, in seconds", ge=0)] = 0,
    ) -> types.CallToolResult:
        support.call_started("held")
        support.HELD["now"] += 1
        support.HELD["most"] = max(support.HELD["most"], support.HELD["now"])
        try:
            await anyio.sleep(seconds)
        finally:
            support.HELD["now"] -= 1
        return text_result(tag)

    @mcp.tool(
        name="held_at_once",
        description="JSON object: how many `held` calls run now and the most that ever ran at once; `reset` "
        "starts the most afresh",
    )
    async def held_at_once(
        reset: Annotated[bool, Field(description="Start counting the most afresh")] = False,
    ) -> types.CallToolResult:
        counts = dict(support.HELD)
        if reset:
            support.HELD["most"] = support.HELD["now"]
        return text_result(json.dumps(counts))
