"""An upstream's HTTP answer as the proxy reads it, from either client, and the one place where both clients'
failures become `Upstream*Error`s: `Answer` (the lean client's `LeanAnswer` is one; `AiohttpAnswer` wraps
aiohttp's response: GET streams, DELETE, an https upstream), `CLIENT_FAILURES` and `failure()`, and
`checked_headers()`, the wire checks (`proxy.wire.fields`) for what aiohttp writes. Imports aiohttp's client
side, the HTTP/1.1 core's errors and the error tree; never a session."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

import aiohttp
from multidict import CIMultiDictProxy

from proxy.errors import UpstreamError, UpstreamRequestInvalidError, UpstreamTimeoutError, UpstreamUnreachableError
from proxy.upstream.http.h1 import (
    H1ConnectionError,
    H1Error,
    H1LimitError,
    H1ProtocolError,
    H1RequestError,
    H1TimeoutError,
)
from proxy.wire.fields import FieldError, check_fields

CUT_SHORT: Final = "Upstream MCP server closed the connection in the middle of its answer"


class Answer(Protocol):
    """What the relay and the upstream sessions read of an answer. Reads raise one of CLIENT_FAILURES."""

    @property
    def status(self) -> int: ...
    @property
    def reason(self) -> str | None: ...
    @property
    def headers(self) -> CIMultiDictProxy[str]: ...
    @property
    def media_type(self) -> str: ...
    @property
    def length(self) -> int | None: ...
    @property
    def received(self) -> bool: ...
    @property
    def ended(self) -> bool: ...
    def ready(self) -> bytes: ...
    async def next_chunk(self) -> bytes: ...
    async def read(self) -> bytes: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


async def chunks(answer: Answer) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive."""
    while chunk := await answer.next_chunk():
        yield chunk


@dataclass(eq=False, slots=True)
class AiohttpAnswer:
    """aiohttp's `ClientResponse` read as an `Answer`."""

    response: aiohttp.ClientResponse

    @property
    def status(self) -> int:
        return self.response.status

    @property
    def reason(self) -> str | None:
        return self.response.reason

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        return self.response.headers

    @property
    def media_type(self) -> str:
        return self.response.content_type

    @property
    def length(self) -> int | None:
        return self.response.content_length

    @property
    def received(self) -> bool:
        return self.response.content.is_eof()

    @property
    def ended(self) -> bool:
        return self.response.content.at_eof()

    def ready(self) -> bytes:
        return self.response.content.read_nowait()

    async def next_chunk(self) -> bytes:
        return await self.response.content.readany()

    async def read(self) -> bytes:
        return await self.response.read()

    def release(self) -> None:
        self.response.release()

    def close(self) -> None:
        self.response.close()


# What either client raises: the lean client's own errors, aiohttp's, a timeout.
CLIENT_FAILURES: Final = (H1Error, aiohttp.ClientError, TimeoutError)


def failure(exc: BaseException, during: str | None = None) -> UpstreamError:
    """`exc` (one of CLIENT_FAILURES) as the UpstreamError the caller is given; `during` names the request
    (`tools/call`) for the messages of a timeout or of a connection lost mid-answer. The library's own words
    go to the log only (`detail`)."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, H1RequestError | FieldError):
        return UpstreamRequestInvalidError(f"Request not sent upstream: {exc}")
    if isinstance(exc, H1TimeoutError | TimeoutError):  # (aiohttp's timeouts are TimeoutErrors too)
        return UpstreamTimeoutError(f"Upstream {during} timed out" if during else None, detail=detail)
    if isinstance(exc, H1LimitError):
        return UpstreamError(
            f"Upstream answer refused: over the proxy's limit {exc.limit} = {exc.maximum}",
            data={"limit": exc.limit, "max": exc.maximum},
        )
    if isinstance(exc, H1ProtocolError):
        return UpstreamError("Upstream answer is not valid HTTP/1.1", detail=detail)
    answered = (isinstance(exc, H1ConnectionError) and exc.answered) or isinstance(exc, aiohttp.ClientPayloadError)
    if answered:
        return UpstreamError(f"Upstream connection lost during {during}" if during else CUT_SHORT, detail=detail)
    return UpstreamUnreachableError("Upstream MCP server unavailable", detail=detail)


def checked_headers(headers: Mapping[str, str]) -> Mapping[str, str]:
    """`headers`, once every name and value passed the wire checks (`proxy.wire.fields`); raises
    UpstreamRequestInvalidError (nothing is sent) otherwise. For the requests aiohttp's client writes, whose own
    check looks for CR and LF only."""
    try:
        check_fields(list(headers.items()))  # the whole block in one pass; each field on its own only to name one
    except FieldError as exc:
        raise failure(exc) from None
    return headers
