"""The Events extension's errors (SEP-3415, "Error Handling"): five general-purpose codes in the specification's
range, each with a typed `data`. The numbers are the ones the SEP requests next after -32020..-32022.
Imports only the error tree.
"""

from __future__ import annotations

from typing import Any

from proxy.errors import ProxyError


class EventsNotFoundError(ProxyError):
    """An unknown event name, no subscription for the key on `events/unsubscribe`, or a task that is not the
    caller's (told exactly like one that never existed)."""

    code = -32023
    http_status = 400
    default_message = "Not found"


class EventsForbiddenError(ProxyError):
    code = -32024
    http_status = 403
    default_message = "Forbidden"


class ResourceExhaustedError(ProxyError):
    """A limit of the proxy (`data.limit` names it, `data.max` its ceiling): 429 for a caller's share, 503 for
    the proxy's own (temporary)."""

    code = -32025
    default_message = "Resource exhausted"

    def __init__(self, limit: str, maximum: int, *, http_status: int = 429) -> None:
        super().__init__(
            f"Resource exhausted: {limit} (at most {maximum}); try again later",
            data={"limit": limit, "max": maximum},
            http_status=http_status,
        )


class UnsupportedError(ProxyError):
    code = -32026
    http_status = 400
    default_message = "Unsupported"

    def __init__(self, message: str, data: Any) -> None:
        super().__init__(message, data=data)


class CallbackEndpointError(ProxyError):
    """The callback failed its challenge or could not be reached; `data.reason` is a category only, never what
    the endpoint answered."""

    code = -32027
    http_status = 400
    default_message = "Callback endpoint error"

    def __init__(self, reason: str) -> None:
        super().__init__(f"Callback endpoint error: {reason}", data={"reason": reason})
