"""The Streamable HTTP kind of upstream session: the kind and its sessions (`session.py`), one request's event
stream, a session's GET stream, the answers of either HTTP client, and the lean client (`lean.py`) over its
sans-IO HTTP/1.1 core (`h1.py`). Imports aiohttp's client side; never the store or tasks.
"""
