"""The Streamable HTTP kind of upstream session: what its sessions share, the sessions, one request's event
stream, and a session's standalone GET stream. Imports aiohttp's client side; never the store or tasks.
"""
