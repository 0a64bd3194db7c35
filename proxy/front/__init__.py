"""The 2026-07-28 front: the method table (`dispatch.py`) and `subscriptions/listen` (`listen.py`). Talks to the
client through a channel and to tasks through the runner; never imports aiohttp."""
