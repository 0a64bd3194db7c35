"""Fixtures the official conformance suite's 2025-11-25 server scenarios call directly: the
``test_*`` content/logging/progress/error/sampling/elicitation tools, ``json_schema_2020_12_tool``,
``test_reconnection`` (SSE polling), the ``test://`` resources and template, the ``test_*`` prompts,
and the completion values served by ``completion/complete``.
"""

from __future__ import annotations

import base64
import json
from typing import Annotated, Any

import anyio
from mcp import types
from mcp.server.fastmcp import FastMCP
from mcp.server.fastmcp.prompts.base import Message, UserMessage
from pydantic import AnyUrl, Field

from tests.upstream.support import Ctx, elicit, log, sample, text_result

# 1x1 red PNG and a minimal WAV, as in the suite's reference server.
TEST_IMAGE_BASE64 = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8DwHwAFBQIAX8jx0gAAAABJRU5ErkJggg=="
TEST_AUDIO_BASE64 = "UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAAB9AAACABAAZGF0YQIAAAA="

JSON_SCHEMA_2020_12_INPUT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "$defs": {
        "address": {
            "$anchor": "addressDef",
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
        }
    },
    "properties": {
        "name": {"type": "string"},
        "address": {"$ref": "#/$defs/address"},
        "contactMethod": {"type": "string", "enum": ["phone", "email"]},
        "phone": {"type": "string"},
        "email": {"type": "string"},
    },
    "allOf": [{"anyOf": [{"required": ["phone"]}, {"required": ["email"]}]}],
    "if": {"properties": {"contactMethod": {"const": "phone"}}, "required": ["contactMethod"]},
    "then": {"required": ["phone"]},
    "else": {"required": ["email"]},
    "additionalProperties": False,
}

_SEP1034_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "description": "User name", "default": "John Doe"},
        "age": {"type": "integer", "description": "User age", "default": 30},
        "score": {"type": "number", "description": "User score", "default": 95.5},
        "status": {
            "type": "string",
            "description": "User status",
            "enum": ["active", "inactive", "pending"],
            "default": "active",
        },
        "verified": {"type": "boolean", "description": "Verification status", "default": True},
    },
    "required": [],
}

_SEP1330_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "untitledSingle": {
            "type": "string",
            "description": "Select one option",
            "enum": ["option1", "option2", "option3"],
        },
        "titledSingle": {
            "type": "string",
            "description": "Select one option with titles",
            "oneOf": [
                {"const": "value1", "title": "First Option"},
                {"const": "value2", "title": "Second Option"},
                {"const": "value3", "title": "Third Option"},
            ],
        },
        "legacyEnum": {
            "type": "string",
            "description": "Select one option (legacy)",
            "enum": ["opt1", "opt2", "opt3"],
            "enumNames": ["Option One", "Option Two", "Option Three"],
        },
        "untitledMulti": {
            "type": "array",
            "description": "Select multiple options",
            "minItems": 1,
            "maxItems": 3,
            "items": {"type": "string", "enum": ["option1", "option2", "option3"]},
        },
        "titledMulti": {
            "type": "array",
            "description": "Select multiple options with titles",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "anyOf": [
                    {"const": "value1", "title": "First Choice"},
                    {"const": "value2", "title": "Second Choice"},
                    {"const": "value3", "title": "Third Choice"},
                ]
            },
        },
    },
    "required": [],
}

_PROMPT_ARG_COMPLETIONS: dict[str, list[str]] = {
    "arg1": ["alpha", "beta", "gamma"],
    "arg2": ["one", "two", "three"],
    "resourceUri": ["test://static-text", "test://static-binary", "test://watched-resource"],
}
_TEMPLATE_ID_COMPLETIONS = ["1", "2", "3", "123"]

WATCHED_RESOURCE_TEXT = "Watched resource content"


def completions(ref: types.PromptReference | types.ResourceTemplateReference, argument: str) -> list[str]:
    """Candidate values for ``completion/complete`` (filtered by prefix by the caller)."""
    if isinstance(ref, types.PromptReference):
        return _PROMPT_ARG_COMPLETIONS.get(argument, [])
    if ref.uri == "test://template/{id}/data" and argument == "id":
        return _TEMPLATE_ID_COMPLETIONS
    return []


def _elicitation_summary(prefix: str, result: types.ElicitResult) -> types.CallToolResult:
    content = json.dumps(result.content or {}, separators=(",", ":"))
    return text_result(f"{prefix}: action={result.action}, content={content}")


def register(mcp: FastMCP[Any]) -> None:
    """Register the 2025-11-25 conformance fixtures on ``mcp``."""

    @mcp.tool(name="test_simple_text", description="Tests simple text content response")
    async def test_simple_text() -> types.CallToolResult:
        return text_result("This is a simple text response for testing.")

    @mcp.tool(name="test_image_content", description="Tests image content response")
    async def test_image_content() -> types.CallToolResult:
        return types.CallToolResult(
            content=[types.ImageContent(type="image", data=TEST_IMAGE_BASE64, mimeType="image/png")]
        )

    @mcp.tool(name="test_audio_content", description="Tests audio content response")
    async def test_audio_content() -> types.CallToolResult:
        return types.CallToolResult(
            content=[types.AudioContent(type="audio", data=TEST_AUDIO_BASE64, mimeType="audio/wav")]
        )

    @mcp.tool(name="test_embedded_resource", description="Tests embedded resource content response")
    async def test_embedded_resource() -> types.CallToolResult:
        return types.CallToolResult(
            content=[
                types.EmbeddedResource(
                    type="resource",
                    resource=types.TextResourceContents(
                        uri=AnyUrl("test://embedded-resource"),
                        mimeType="text/plain",
                        text="This is an embedded resource content.",
                    ),
                )
            ]
        )

    @mcp.tool(
        name="test_multiple_content_types",
        description="Tests response with multiple content types (text, image, resource)",
    )
    async def test_multiple_content_types() -> types.CallToolResult:
        return types.CallToolResult(
            content=[
                types.TextContent(type="text", text="Multiple content types test:"),
                types.ImageContent(type="image", data=TEST_IMAGE_BASE64, mimeType="image/png"),
                types.EmbeddedResource(
                    type="resource",
                    resource=types.TextResourceContents(
                        uri=AnyUrl("test://mixed-content-resource"),
                        mimeType="application/json",
                        text=json.dumps({"test": "data", "value": 123}),
                    ),
                ),
            ]
        )

    @mcp.tool(name="test_tool_with_logging", description="Tests tool that emits log messages during execution")
    async def test_tool_with_logging(ctx: Ctx) -> types.CallToolResult:
        await log(ctx, "info", "Tool execution started")
        await anyio.sleep(0.05)
        await log(ctx, "info", "Tool processing data")
        await anyio.sleep(0.05)
        await log(ctx, "info", "Tool execution completed")
        return text_result("Tool with logging executed successfully")

    @mcp.tool(name="test_tool_with_progress", description="Tests tool that reports progress notifications")
    async def test_tool_with_progress(ctx: Ctx) -> types.CallToolResult:
        for step in (0, 50, 100):
            if step:
                await anyio.sleep(0.05)
            await ctx.report_progress(step, 100, f"Completed step {step} of 100")
        meta = ctx.request_context.meta
        token = meta.progressToken if meta is not None else None
        return text_result(str(token) if token is not None else "no progress token")

    @mcp.tool(name="test_error_handling", description="Tests error response handling")
    async def test_error_handling() -> types.CallToolResult:
        raise RuntimeError("This tool intentionally returns an error for testing")

    @mcp.tool(
        name="test_reconnection",
        description=(
            "Tests SSE stream disconnection and client reconnection (SEP-1699): closes the POST SSE "
            "stream mid-call; the result is delivered after the client resumes with Last-Event-ID."
        ),
    )
    async def test_reconnection(ctx: Ctx) -> types.CallToolResult:
        await ctx.close_sse_stream()
        await anyio.sleep(0.1)
        return text_result(
            "Reconnection test completed successfully. If you received this, the client properly "
            "reconnected after stream closure."
        )

    @mcp.tool(name="test_sampling", description="Tests server-initiated sampling (LLM completion request)")
    async def test_sampling(
        ctx: Ctx, prompt: Annotated[str, Field(description="The prompt to send to the LLM")]
    ) -> types.CallToolResult:
        return text_result(f"LLM response: {await sample(ctx, prompt)}")

    @mcp.tool(name="test_elicitation", description="Tests server-initiated elicitation (user input request)")
    async def test_elicitation(
        ctx: Ctx, message: Annotated[str, Field(description="The message to show the user")]
    ) -> types.CallToolResult:
        schema = {
            "type": "object",
            "properties": {
                "username": {"type": "string", "description": "User's response"},
                "email": {"type": "string", "description": "User's email address"},
            },
            "required": ["username", "email"],
        }
        return _elicitation_summary("User response", await elicit(ctx, message, schema))

    @mcp.tool(
        name="test_elicitation_sep1034_defaults",
        description="Tests elicitation with default values per SEP-1034",
    )
    async def test_elicitation_sep1034_defaults(ctx: Ctx) -> types.CallToolResult:
        result = await elicit(ctx, "Please review and update the form fields with defaults", _SEP1034_SCHEMA)
        return _elicitation_summary("Elicitation completed", result)

    @mcp.tool(
        name="test_elicitation_sep1330_enums",
        description="Tests elicitation with enum schema improvements per SEP-1330",
    )
    async def test_elicitation_sep1330_enums(ctx: Ctx) -> types.CallToolResult:
        result = await elicit(ctx, "Please select options from the enum fields", _SEP1330_SCHEMA)
        return _elicitation_summary("Elicitation completed", result)

    @mcp.tool(
        name="json_schema_2020_12_tool",
        description="Tool with JSON Schema 2020-12 features for conformance testing (SEP-1613)",
    )
    async def json_schema_2020_12_tool(
        name: str | None = None,
        address: dict[str, str] | None = None,
        contactMethod: str | None = None,
        phone: str | None = None,
        email: str | None = None,
    ) -> types.CallToolResult:
        given = {
            k: v
            for k, v in {
                "name": name,
                "address": address,
                "contactMethod": contactMethod,
                "phone": phone,
                "email": email,
            }.items()
            if v is not None
        }
        return text_result(f"JSON Schema 2020-12 tool called with: {json.dumps(given)}")

    # tools/list must show the raw 2020-12 schema (FastMCP would derive a plain one from the signature);
    # arguments are still validated by the signature-derived model.
    schema_tool = mcp._tool_manager.get_tool("json_schema_2020_12_tool")
    assert schema_tool is not None
    schema_tool.parameters = JSON_SCHEMA_2020_12_INPUT_SCHEMA

    # ----- resources -----

    @mcp.resource(
        "test://static-text",
        name="static-text",
        title="Static Text Resource",
        description="A static text resource for testing",
        mime_type="text/plain",
    )
    async def static_text() -> str:
        return "This is the content of the static text resource."

    @mcp.resource(
        "test://static-binary",
        name="static-binary",
        title="Static Binary Resource",
        description="A static binary resource (image) for testing",
        mime_type="image/png",
    )
    async def static_binary() -> bytes:
        return base64.b64decode(TEST_IMAGE_BASE64)

    @mcp.resource(
        "test://template/{id}/data",
        name="template",
        title="Resource Template",
        description="A resource template with parameter substitution",
        mime_type="application/json",
    )
    async def template(id: str) -> str:
        return json.dumps({"id": id, "templateTest": True, "data": f"Data for ID: {id}"})

    @mcp.resource(
        "test://watched-resource",
        name="watched-resource",
        title="Watched Resource",
        description="A subscribable resource; the update_resource tool notifies its subscribers",
        mime_type="text/plain",
    )
    async def watched_resource() -> str:
        return WATCHED_RESOURCE_TEXT

    # ----- prompts -----

    @mcp.prompt(name="test_simple_prompt", title="Simple Test Prompt", description="A simple prompt without arguments")
    async def test_simple_prompt() -> list[Message]:
        return [UserMessage("This is a simple prompt for testing.")]

    @mcp.prompt(
        name="test_prompt_with_arguments",
        title="Prompt With Arguments",
        description="A prompt with required arguments",
    )
    async def test_prompt_with_arguments(
        arg1: Annotated[str, Field(description="First test argument")],
        arg2: Annotated[str, Field(description="Second test argument")],
    ) -> list[Message]:
        return [UserMessage(f"Prompt with arguments: arg1='{arg1}', arg2='{arg2}'")]

    @mcp.prompt(
        name="test_prompt_with_embedded_resource",
        title="Prompt With Embedded Resource",
        description="A prompt that includes an embedded resource",
    )
    async def test_prompt_with_embedded_resource(
        resourceUri: Annotated[str, Field(description="URI of the resource to embed")],
    ) -> list[Message]:
        return [
            UserMessage(
                types.EmbeddedResource(
                    type="resource",
                    resource=types.TextResourceContents(
                        uri=AnyUrl(resourceUri),
                        mimeType="text/plain",
                        text="Embedded resource content for testing.",
                    ),
                )
            ),
            UserMessage("Please process the embedded resource above."),
        ]

    @mcp.prompt(
        name="test_prompt_with_image", title="Prompt With Image", description="A prompt that includes image content"
    )
    async def test_prompt_with_image() -> list[Message]:
        return [
            UserMessage(types.ImageContent(type="image", data=TEST_IMAGE_BASE64, mimeType="image/png")),
            UserMessage("Please analyze the image above."),
        ]
