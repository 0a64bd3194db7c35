"""The proxy as a legacy MCP client, and only that: all I/O towards the upstream server. What a session is
(`session.py`), the pool (`pool/`, which knows no kind), and the two kinds laid out
alike (`http/`, `stdio/`; `kinds.py` picks one from the configuration). The servers legacy clients get are in
`proxy/legacy/` (which one is chosen there), SSE framing in `proxy/wire/sse.py`. Never imports legacy/, tasks,
the store or the front.
"""
