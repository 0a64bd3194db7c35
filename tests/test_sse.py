"""upstream/sse.py: the incremental SSE parser, fed as the network delivers (any split)."""

from __future__ import annotations

from proxy.upstream.sse import SSEEvent, SSEParser, frame

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
