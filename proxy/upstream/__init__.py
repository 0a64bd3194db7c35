"""The proxy as a legacy MCP client: all I/O towards the upstream server (sessions of either kind, Streamable
HTTP or stdio processes, calls, GET stream, the pool), and what legacy clients get (the pass-through, or the
proxy's own server for a stdio upstream). Only this package and `app.py` import aiohttp.
"""
