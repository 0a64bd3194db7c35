"""upstream/http/h1.py, the HTTP/1.1 client's sans-IO core, by playbooks: a request in, bytes out (every name
and value checked, RFC 9110 §5.5, RFC 9112 §3.2); bytes in, events out, for every framing of RFC 9112 §6.3,
split at every byte boundary, and for malformed and oversized answers refused at their cap. No sockets."""

from __future__ import annotations

import pytest

from proxy.upstream.http.h1 import (
    DEFAULT_LIMITS,
    H1ConnectionError,
    H1LimitError,
    H1ProtocolError,
    H1RequestError,
    RequestWriter,
    ResponseReader,
)
from tests.support.h1 import End, Recorder, ResponseHead, read

JSON_BODY = b'{"jsonrpc":"2.0","id":1,"result":{}}'
BY_LENGTH = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nSet-Cookie: a=1\r\nSet-Cookie: b=2\r\n"
    b"Content-Length: %d\r\n\r\n%s" % (len(JSON_BODY), JSON_BODY)
)
CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;name=value\r\n" + JSON_BODY[:5] + b"\r\n" + b"%x\r\n" % (len(JSON_BODY) - 5) + JSON_BODY[5:] + b"\r\n"
    b"0\r\nX-Trailer: dropped\r\n\r\n"
)
UNTIL_CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n" + JSON_BODY


def head_of(recorder: Recorder) -> ResponseHead:
    kind, head = recorder.events[0]
    assert kind == "head"
    assert isinstance(head, ResponseHead)
    return head


# --- requests out ---------------------------------------------------------------------------------------------


def test_a_request_is_written_with_the_origins_host_and_its_own_length() -> None:
    writer = RequestWriter("127.0.0.1:8080")
    headers = [("Accept", "application/json"), ("Content-Length", "999"), ("Transfer-Encoding", "chunked")]
    assert writer.request("POST", "/mcp?x=1", headers, b"{}") == (
        b"POST /mcp?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nAccept: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )


def test_a_host_among_the_headers_replaces_the_origins() -> None:
    request = RequestWriter("127.0.0.1:8080").request("POST", "/mcp", [("host", "upstream.example")], b"")
    assert request.startswith(b"POST /mcp HTTP/1.1\r\nHost: upstream.example\r\nContent-Length: 0\r\n\r\n")
    assert request.count(b"127.0.0.1") == 0


@pytest.mark.parametrize(
    "value",
    [
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\nX-Injected: yes",  # CR LF: a header of its own
        "a\nX-Injected: yes",  # a bare LF
        "a\rX-Injected: yes",  # a bare CR
        "a\x00b",  # NUL
        "a\x7fb",  # DEL
        "x\r\n\r\nPOST /admin HTTP/1.1\r\nHost: upstream",  # a second request smuggled on the connection
        " leading space",
        "trailing tab\t",
    ],
)
def test_a_value_that_could_split_a_header_or_a_request_is_never_written(value: str) -> None:
    """RFC 9110 §5.5: a field value holds no CR, LF, NUL or other control character but tab, and no surrounding
    whitespace. The error names the header, never the value (it may be a credential)."""
    with pytest.raises(H1RequestError) as refused:
        RequestWriter("upstream").request("POST", "/mcp", [("Accept", "*/*"), ("traceparent", value)], b"{}")
    assert "traceparent" in str(refused.value)
    assert "Injected" not in str(refused.value)
    assert "admin" not in str(refused.value)


@pytest.mark.parametrize("name", ["X Space", "X:Colon", "X\r\nInjected", "", "Ünicode", "X\x00"])
def test_a_header_name_that_is_not_a_token_is_never_written(name: str) -> None:
    """RFC 9110 §5.1: field-name = token."""
    with pytest.raises(H1RequestError):
        RequestWriter("upstream").request("POST", "/mcp", [(name, "v")], b"")


@pytest.mark.parametrize("target", ["/mcp x", "/mcp\r\nX: y", "mcp", "", "/ü", "/mcp\x00"])
def test_a_request_target_that_is_not_origin_form_is_never_written(target: str) -> None:
    """RFC 9112 §3.2.1: origin-form = absolute-path [ "?" query ], visible ASCII."""
    with pytest.raises(H1RequestError):
        RequestWriter("upstream").request("POST", target, [], b"")


def test_a_method_and_a_host_are_checked_too() -> None:
    with pytest.raises(H1RequestError):
        RequestWriter("upstream").request("POST /x HTTP/1.1\r\n", "/mcp", [], b"")
    with pytest.raises(H1RequestError):
        RequestWriter("up\r\nstream")
    with pytest.raises(H1RequestError):
        RequestWriter("upstream").request("POST", "/mcp", [("Host", "a\r\nb")], b"")


def test_a_name_checked_once_is_still_checked_with_its_next_value() -> None:
    writer = RequestWriter("upstream")
    writer.request("POST", "/mcp", [("traceparent", "ok")], b"")
    with pytest.raises(H1RequestError):
        writer.request("POST", "/mcp", [("traceparent", "bad\r\nX: y")], b"")


def test_a_writer_drops_the_framing_and_takes_the_host_of_every_request_whatever_the_case() -> None:
    """A name is looked up once per writer (its check, and what to do with it); the second request with the same
    names is written by the same rules as the first."""
    writer = RequestWriter("origin:8080")
    headers = [("content-LENGTH", "99"), ("HOST", "named.example"), ("X-A", "1"), ("transfer-encoding", "chunked")]
    for _ in range(2):
        assert writer.request("POST", "/mcp", headers, b"{}") == (
            b"POST /mcp HTTP/1.1\r\nHost: named.example\r\nX-A: 1\r\nContent-Length: 2\r\n\r\n{}"
        )
    with pytest.raises(H1RequestError, match="HOST"):
        writer.request("POST", "/mcp", [("HOST", "a\r\nb")], b"")


def test_obs_text_and_tabs_inside_a_value_are_written_as_they_came() -> None:
    """RFC 9110 §5.5: obs-text and HTAB are field content; a value read with surrogateescape goes back as its
    bytes."""
    value = "caf\xe9\tb" + b"\xff".decode("utf-8", "surrogateescape")
    request = RequestWriter("upstream").request("POST", "/mcp", [("X-Value", value)], b"")
    assert b"X-Value: caf\xc3\xa9\tb\xff\r\n" in request


# --- answers in: framing --------------------------------------------------------------------------------------


def test_an_answer_framed_by_content_length() -> None:
    recorder, reader = read([BY_LENGTH])
    head = head_of(recorder)
    assert (head.status, head.reason) == (200, "OK")
    assert head.headers == [
        ("Content-Type", "application/json"),
        ("Set-Cookie", "a=1"),
        ("Set-Cookie", "b=2"),
        ("Content-Length", str(len(JSON_BODY))),
    ]
    assert recorder.merged()[1:] == [("data", JSON_BODY), ("end", None)]
    assert reader.keep_alive


def test_a_chunked_answer_with_extensions_and_trailers() -> None:
    """RFC 9112 §7.1: chunk extensions are skipped; the trailer section is read and dropped."""
    recorder, reader = read([CHUNKED])
    assert head_of(recorder).headers == [("Transfer-Encoding", "chunked")]
    assert recorder.merged()[1:] == [("data", JSON_BODY), ("end", None)]
    assert reader.keep_alive


def test_an_answer_that_ends_with_the_connection() -> None:
    """RFC 9112 §6.3 item 8: no Content-Length, not chunked: the body ends when the connection closes."""
    recorder, reader = read([UNTIL_CLOSE], end=None)
    assert recorder.merged()[1:] == [("data", JSON_BODY)]  # not ended while the connection is open
    reader.closed()
    assert recorder.merged()[1:] == [("data", JSON_BODY), ("end", None)]
    assert not reader.keep_alive


def test_an_answer_that_ends_with_the_connection_is_cut_by_a_reset() -> None:
    """An abortive close (ECONNRESET) is a failure, never the end of the body (RFC 9112 §9.6)."""
    recorder, reader = read([UNTIL_CLOSE], end=None)
    with pytest.raises(H1ConnectionError) as cut:
        reader.closed(reset=True)
    assert cut.value.answered
    assert ("end", None) not in recorder.events


@pytest.mark.parametrize("answer", [BY_LENGTH, CHUNKED], ids=["content-length", "chunked"])
@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_a_body_cut_short_is_an_error_never_its_end(answer: bytes, reset: bool) -> None:
    recorder, reader = read([answer[:-3]], end=None)
    with pytest.raises(H1ConnectionError) as cut:
        reader.closed(reset=reset)
    assert cut.value.answered
    assert ("end", None) not in recorder.events


@pytest.mark.parametrize("answered", [b"", b"HTTP/1.1 200 OK\r\nContent-Le"])
def test_a_connection_closed_before_the_head_is_in_is_not_an_answer(answered: bytes) -> None:
    recorder, reader = read([answered] if answered else [], end=None)
    with pytest.raises(H1ConnectionError) as cut:
        reader.closed()
    assert not cut.value.answered
    assert recorder.events == []


def test_interim_answers_are_skipped() -> None:
    """RFC 9110 §15.2: 1xx answers precede the final one; only the final one is the answer."""
    interim = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </style.css>; rel=preload\r\n\r\n"
    recorder, _reader = read([interim + BY_LENGTH])
    assert head_of(recorder).status == 200
    assert [kind for kind, _ in recorder.merged()] == ["head", "data", "end"]
    assert ("Link", "</style.css>; rel=preload") not in head_of(recorder).headers


@pytest.mark.parametrize(
    ("answer", "keep_alive"),
    [
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\n{}", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\n{}", True),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}", False),
    ],
)
def test_http_1_0_and_connection_close_say_whether_the_connection_is_kept(answer: bytes, keep_alive: bool) -> None:
    """RFC 9112 §9.3: HTTP/1.0 closes unless it says keep-alive; `Connection: close` closes."""
    recorder, reader = read([answer])
    assert recorder.merged()[1:] == [("data", b"{}"), ("end", None)]
    assert reader.keep_alive is keep_alive


def test_an_http_1_0_answer_without_a_length_ends_with_the_connection() -> None:
    recorder, reader = read([b"HTTP/1.0 200 OK\r\n\r\nab", b"cd"], end="close")
    assert head_of(recorder).status == 200
    assert recorder.merged()[1:] == [("data", b"abcd"), ("end", None)]
    assert not reader.keep_alive


@pytest.mark.parametrize("status", [204, 304])
def test_a_204_or_304_has_no_body(status: int) -> None:
    """RFC 9112 §6.3 item 1."""
    recorder, reader = read([b"HTTP/1.1 %d Nothing\r\n\r\n" % status])
    assert recorder.merged()[1:] == [("end", None)]
    assert reader.keep_alive


@pytest.mark.parametrize("answer", [BY_LENGTH, CHUNKED, UNTIL_CLOSE], ids=["content-length", "chunked", "close"])
def test_every_split_of_the_bytes_gives_the_same_events(answer: bytes) -> None:
    """However the reads cut the bytes (one byte at a time, or in two pieces at any boundary), the events are the
    same."""
    end: End = "close" if answer is UNTIL_CLOSE else "keep"
    whole = read([answer], end=end)[0].merged()
    assert read([answer[i : i + 1] for i in range(len(answer))], end=end)[0].merged() == whole
    for cut in range(1, len(answer)):
        assert read([answer[:cut], answer[cut:]], end=end)[0].merged() == whole, cut


def test_two_answers_one_after_the_other_on_one_connection() -> None:
    recorder = Recorder()
    reader = ResponseReader(recorder)
    for _ in range(2):
        reader.expect()
        reader.feed(BY_LENGTH)
    assert [kind for kind, _ in recorder.merged()] == ["head", "data", "end", "head", "data", "end"]


# --- answers in: refused --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 abc OK\r\n\r\n",
        b"SMTP 220 hello\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Name: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nX: a\x00b\r\n\r\n",
    ],
)
def test_a_malformed_answer_is_a_protocol_error(answer: bytes) -> None:
    with pytest.raises(H1ProtocolError):
        read([answer])


def test_bytes_no_request_asked_for_are_a_protocol_error() -> None:
    reader = ResponseReader(Recorder())
    with pytest.raises(H1ProtocolError):
        reader.feed(BY_LENGTH)
    _, after_one = read([BY_LENGTH])
    with pytest.raises(H1ProtocolError):
        after_one.feed(BY_LENGTH)  # a second answer to one request


def feed_until_refused(reader: ResponseReader, stream: bytes, read_bytes: int = 65536) -> tuple[str, int]:
    """Feeds `stream` in reads of `read_bytes` until the reader refuses it; returns the limit that refused it and
    the bytes fed by then."""
    for fed in range(0, len(stream), read_bytes):
        try:
            reader.feed(stream[fed : fed + read_bytes])
        except H1LimitError as refused:
            return refused.limit, fed + read_bytes
    raise AssertionError("the reader took the whole stream")


def limit_hit(stream: bytes) -> tuple[str, int]:
    reader = ResponseReader(Recorder())
    reader.expect()
    return feed_until_refused(reader, stream)


def test_a_one_megabyte_status_line_is_refused_at_its_cap() -> None:
    limit, fed = limit_hit(b"HTTP/1.1 200 " + b"x" * (1 << 20) + b"\r\n\r\n")
    assert limit == "max_status_line_bytes"
    assert fed <= 65536  # refused in the first read: never held whole


def test_ten_thousand_headers_are_refused_at_the_cap() -> None:
    limit, fed = limit_hit(b"HTTP/1.1 200 OK\r\n" + b"X-A: b\r\n" * 10_000 + b"\r\n")
    assert limit == "max_headers"
    assert fed <= 65536


def test_a_long_header_line_is_refused() -> None:
    limit, _ = limit_hit(b"HTTP/1.1 200 OK\r\nX-Long: " + b"v" * (20 * 1024) + b"\r\n\r\n")
    assert limit == "max_header_line_bytes"


def test_a_head_larger_than_the_budget_is_refused_before_it_is_parsed_whole() -> None:
    stream = b"HTTP/1.1 200 OK\r\n" + b"X-H: " + b"v" * 1000 + b"\r\n"
    stream = stream + (b"X-H: " + b"v" * 1000 + b"\r\n") * 200 + b"\r\n"  # 200 kB in headers under every line cap
    limit, fed = limit_hit(stream)
    assert limit == "max_head_bytes"
    assert fed <= DEFAULT_LIMITS.max_head_bytes + 65536


def test_endless_interim_answers_are_refused() -> None:
    """The heads of one exchange share one budget, so 1xx answers cannot keep a reader busy without end."""
    limit, _ = limit_hit(b"HTTP/1.1 100 Continue\r\n\r\n" * 10_000)
    assert limit == "max_head_bytes"


def test_a_long_chunk_size_line_is_refused() -> None:
    """RFC 9112 §7.1.1: chunk extensions may be ignored, not read without end."""
    reader = ResponseReader(Recorder())
    reader.expect()
    reader.feed(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
    stream = b"5;ext=" + b"e" * (1 << 20) + b"\r\nhello\r\n0\r\n\r\n"
    limit, fed = feed_until_refused(reader, stream, read_bytes=1024)
    assert limit == "max_chunk_line_bytes"
    assert fed <= DEFAULT_LIMITS.max_chunk_line_bytes + 2048


def test_large_chunks_are_not_a_long_chunk_line() -> None:
    body = b"x" * 300_000
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    recorder, _ = read([answer[i : i + 4096] for i in range(0, len(answer), 4096)])
    assert recorder.merged()[1:] == [("data", body), ("end", None)]
