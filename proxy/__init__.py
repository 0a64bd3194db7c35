"""mcp-tasks-proxy: a legacy MCP server served as an MCP 2026-07-28 server (see README.md)."""
