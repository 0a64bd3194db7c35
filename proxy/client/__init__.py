"""The client in the box: `mcp-tasks-proxy tools`, `call` and `follow`, a 2026-07-28 MCP client that declares the
Tasks extension, for a person at a terminal (or a script). `connection.py` speaks the wire, `arguments.py` types
`key=value` by a tool's inputSchema, `terminal.py` shows progress and asks the upstream's questions,
`command_line.py` ties them to the command line. Imports the wire and the config's loader; nothing of the server.
"""
