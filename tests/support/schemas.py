"""Validation of what the proxy sends against the published JSON Schemas vendored in tests/schema/ (Draft
2020-12, the `jsonschema` package). Imports nothing of the proxy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schema"
MODERN_SCHEMA = SCHEMA_DIR / "mcp-2026-07-28.schema.json"
LEGACY_SCHEMA = SCHEMA_DIR / "mcp-2025-11-25.schema.json"
TASKS_SCHEMA = SCHEMA_DIR / "tasks-extension-2026-07-28.schema.json"


class SchemaValidator:
    def __init__(self, path: Path) -> None:
        self.document = json.loads(path.read_text())
        self.defs = self.document["$defs"]

    def validate(self, instance: Any, definition: str) -> None:
        schema = {"$schema": self.document["$schema"], "$defs": self.defs, "$ref": f"#/$defs/{definition}"}
        jsonschema.Draft202012Validator(schema).validate(instance)


RESPONSE_DEFS = {
    "server/discover": "DiscoverResultResponse",
    "tools/list": "ListToolsResultResponse",
    "tools/call": "CallToolResultResponse",
    "prompts/list": "ListPromptsResultResponse",
    "prompts/get": "GetPromptResultResponse",
    "resources/list": "ListResourcesResultResponse",
    "resources/templates/list": "ListResourceTemplatesResultResponse",
    "resources/read": "ReadResourceResultResponse",
    "completion/complete": "CompleteResultResponse",
}


class ModernSchema(SchemaValidator):
    def check(self, message: dict[str, Any], method: str) -> None:
        """Validate one message the proxy sent for a request of `method` against the 2026-07-28 schema."""
        if "error" in message:
            self.validate(message, "JSONRPCErrorResponse")
        elif "result" in message:
            self.validate(message, RESPONSE_DEFS[method])
            if message["result"].get("resultType") == "input_required":
                # Only these methods may answer `input_required`; the loose anyOf of the response type is not enough.
                assert method in ("tools/call", "prompts/get", "resources/read"), method
                self.validate(message["result"], "InputRequiredResult")
        else:
            self.validate(message, "ServerNotification")

    def check_all(self, messages: list[dict[str, Any]], method: str) -> None:
        for message in messages:
            self.check(message, method)
