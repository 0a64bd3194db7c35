"""Legacy (2025-06-18 / 2025-11-25) MCP fixture upstream built on the mcp 1.x SDK (FastMCP).

Used in-process via :func:`build_server` / :func:`build_app`, or as a process via
``python -m tests.upstream``; see README.md in this directory for every fixture.
"""

from tests.upstream.server import build_app, build_server

__all__ = ["build_app", "build_server"]
