"""The stdio kind of upstream session: one server process is one session. What its processes share, the
sessions, the supervised process itself, and the rates that bound restarts and stderr logging. Never imports
aiohttp, the store or tasks.
"""
