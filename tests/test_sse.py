"""wire/sse.py: the incremental SSE parser, fed as the network delivers (any split)."""

from __future__ import annotations

import re

import pytest

from proxy.wire.sse import EventTooLargeError, SSEEvent, SSEParser, frame

STREAM = (
    b": comment\n"
    b"id: 1\nretry: 1500\ndata: \n\n"
    b'event: message\nid: 2\ndata: {"a":\r\ndata: 1}\r\n\r\n'
    b"data: caf\xc3\xa9\rdata: two\r\r"
)


def _events(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(parser.feed(chunk))
    return events


def test_whole_stream() -> None:
    events = _events([STREAM])
    assert [event.data for event in events] == ["", '{"a":\n1}', "café\ntwo"]
    assert events[0].id == "1"
    assert events[0].retry_ms == 1500
    assert events[1].id == "2"
    assert events[2].id == "2"  # the last event id persists until changed


def test_every_split_point_gives_the_same_events() -> None:
    expected = _events([STREAM])
    for split in range(1, len(STREAM)):
        assert _events([STREAM[:split], STREAM[split:]]) == expected, split


def test_byte_by_byte() -> None:
    assert _events([bytes([byte]) for byte in STREAM]) == _events([STREAM])


def test_frame_round_trips() -> None:
    data = '{"jsonrpc":"2.0","id":1,"result":{}}'
    assert _events([frame(data)]) == [SSEEvent(data=data)]
    assert _events([frame("a\nb", event_id="7")]) == [SSEEvent(data="a\nb", id="7")]


def test_an_event_over_the_cap_is_refused_as_soon_as_it_grows_past_it() -> None:
    parser = SSEParser(max_event_chars=100)
    assert [event.data for event in parser.feed(b"data: " + b"x" * 100 + b"\n\n")] == ["x" * 100]
    for _ in range(50):  # the cap is per event: many events within it pass
        assert len(parser.feed(b"data: " + b"y" * 60 + b"\ndata: " + b"z" * 30 + b"\n\n")) == 1
    with pytest.raises(EventTooLargeError):
        parser.feed(b"data: " + b"y" * 60 + b"\ndata: " + b"z" * 50 + b"\n\n")  # 110 characters of data


def test_an_unfinished_line_over_the_cap_is_refused_before_it_ends() -> None:
    parser = SSEParser(max_event_chars=1000)
    parser.feed(b"data: ")
    for _ in range(9):
        assert parser.feed(b"x" * 100) == []
    with pytest.raises(EventTooLargeError):
        parser.feed(b"x" * 200)  # no line end yet: the line alone is over the cap


def test_a_long_line_split_into_many_chunks_is_joined_once() -> None:
    parser = SSEParser()
    body = b'{"text": "' + b"a" * 100_000 + b'"}'
    events: list[SSEEvent] = []
    for start in range(0, len(body), 997):
        events += parser.feed((b"data: " if start == 0 else b"") + body[start : start + 997])
    events += parser.feed(b"\r\n\r\n")
    assert [event.data for event in events] == [body.decode()]


@pytest.mark.parametrize("data", ["a\rid: 7\rdata: injected", "a\r\n\r\nevent: injected", "a\n\ndata: injected"])
def test_no_text_in_data_ends_the_event_or_starts_a_field_of_its_own(data: str) -> None:
    """HTML Living Standard §9.2.5: CR, LF and CR LF all end a line; each becomes a `data:` line of the one event."""
    parser = SSEParser()
    events = list(parser.feed(frame(data)))
    assert len(events) == 1
    assert events[0].event == "message"
    assert events[0].id is None
    lines = re.split(r"\r\n|\r|\n", frame(data).decode())
    assert all(line.startswith(("data: ", "event: ")) or line == "" for line in lines)


@pytest.mark.parametrize("event_id", ["a\x00b", "a\x01b", "a\x7f", "a "])
def test_an_id_that_could_not_be_sent_back_as_last_event_id_is_ignored(event_id: str) -> None:
    """HTML Living Standard §9.2.6: an id holding NUL is ignored; so is one that is no valid header value (RFC
    9110 §5.5), since the proxy sends the last id back as `Last-Event-ID` when it resumes a stream."""
    events = _events([b"id: 1\ndata: x\n\n", f"id: {event_id}\ndata: y\n\n".encode()])
    assert [event.id for event in events] == ["1", "1"]
