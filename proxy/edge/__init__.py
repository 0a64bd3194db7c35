"""The HTTP edge: the aiohttp application (`app.py`), its one error edge, admission, the operators' endpoints
(bare probes on the MCP listener; metrics and readiness reasons on the operations listener), drain and
lifecycle, and the serve loop (`serve.py`) with what a start says (`startup.py`). The only room that imports
aiohttp's server side besides `legacy/` and the admin listener."""
