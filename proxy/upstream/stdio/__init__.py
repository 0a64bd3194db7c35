"""The stdio kind of upstream session: one server process is one session. The kind and its sessions
(`session.py`), the supervised process itself, and the rates that bound restarts and stderr logging. Never
imports aiohttp, the store or tasks.
"""
