"""Task handles for clients that do not declare the Tasks extension, in both eras: a `handle` tool's call held
up to `handles.hold_ms`, then a plain tool result naming its task, and the synthesised task tools that serve
it (`tools.py`: pure shapes; `service.py`: the calls and the tools; the legacy front's reading of `tools/list`
and `tools/call` is the edge's, `edge/_legacy_handles.py`). The call, record and store are a native task's.
"""
