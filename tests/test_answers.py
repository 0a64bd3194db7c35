"""upstream/http/answers.py: both HTTP clients' failures become the proxy's Upstream*Errors in one table (each
with its JSON-RPC code and HTTP status, the library's words kept for the log only), and the headers aiohttp's
client writes pass the same wire checks as the lean client's (RFC 9110 §5.5)."""

from __future__ import annotations

import aiohttp
import pytest

from proxy.errors import (
    UpstreamError,
    UpstreamRequestInvalidError,
    UpstreamTimeoutError,
    UpstreamUnreachableError,
)
from proxy.upstream.http.answers import CUT_SHORT, checked_headers, failure
from proxy.upstream.http.h1 import H1ConnectionError, H1LimitError, H1ProtocolError, H1RequestError, H1TimeoutError


@pytest.mark.parametrize(
    ("raised", "kind", "status", "code"),
    [
        (
            H1RequestError("the value of header 'traceparent' holds a control character"),
            UpstreamRequestInvalidError,
            400,
            -32602,
        ),
        (H1TimeoutError("late"), UpstreamTimeoutError, 504, -32603),
        (aiohttp.ServerTimeoutError("late"), UpstreamTimeoutError, 504, -32603),
        (TimeoutError(), UpstreamTimeoutError, 504, -32603),
        (H1LimitError("max_headers", 256), UpstreamError, 502, -32603),
        (H1ProtocolError("bad status line at 127.0.0.1"), UpstreamError, 502, -32603),
        (H1ConnectionError("cut", answered=True), UpstreamError, 502, -32603),
        (aiohttp.ClientPayloadError("cut"), UpstreamError, 502, -32603),
        (H1ConnectionError("cannot connect to 127.0.0.1:9"), UpstreamUnreachableError, 502, -32603),
        (aiohttp.ServerDisconnectedError(), UpstreamUnreachableError, 502, -32603),
    ],
)
def test_every_client_failure_is_one_upstream_error(
    raised: BaseException, kind: type[UpstreamError], status: int, code: int
) -> None:
    translated = failure(raised)
    assert type(translated) is kind
    assert (translated.status, translated.code) == (status, code)
    assert "127.0.0.1" not in translated.message  # addresses go to the log (`detail`), never to the client


def test_a_limit_is_named_in_the_errors_data() -> None:
    assert failure(H1LimitError("max_status_line_bytes", 8192)).data == {"limit": "max_status_line_bytes", "max": 8192}


def test_a_request_named_in_a_cut_or_a_timeout_is_named_in_the_message() -> None:
    assert failure(H1ConnectionError("cut", answered=True)).message == CUT_SHORT
    assert failure(H1ConnectionError("cut", answered=True), "tools/call").message == (
        "Upstream connection lost during tools/call"
    )
    assert failure(H1TimeoutError("late"), "tools/call").message == "Upstream tools/call timed out"


@pytest.mark.parametrize("value", ["a\r\nX-Injected: yes", "a\nb", "a\x00b", " padded"])
def test_headers_for_aiohttps_client_are_checked_before_it_writes_them(value: str) -> None:
    with pytest.raises(UpstreamRequestInvalidError, match="traceparent") as refused:
        checked_headers({"Accept": "*/*", "traceparent": value})
    assert "Injected" not in refused.value.message
    headers = {"Accept": "*/*", "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    assert checked_headers(headers) is headers
