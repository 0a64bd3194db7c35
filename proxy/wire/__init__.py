"""SANS-IO wire rules: JSON-RPC framing, the 2026-07-28 envelope, legacy → modern translation.

Nothing here imports aiohttp, asyncio or the store; everything is unit-tested without an event loop.
"""
