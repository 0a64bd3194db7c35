"""The proxy as a legacy MCP client: all I/O towards the upstream server (sessions, calls, GET stream,
pass-through of legacy clients). Only this package and `app.py` import aiohttp.
"""
