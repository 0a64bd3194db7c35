"""The servers the proxy runs for legacy (2025-06-18 / 2025-11-25) clients: the pass-through to an HTTP
upstream (`passthrough.py`) and the proxy's own Streamable HTTP server in front of a stdio upstream
(`stdio_server.py`). Imports aiohttp's web side and the upstream pool; never tasks or the front.
"""
