"""The HTTP/1.1 client against aiohttp's, property-based: the same answer (any status, headers, body; framed by
Content-Length, chunked at any chunk boundaries, or the connection's end; HTTP/1.1 or 1.0), written by a raw
loopback upstream in any pieces, gives the same status, reason, headers and body read by the core fed those
pieces, by the lean client over the socket, and by aiohttp's client over the socket."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import aiohttp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from yarl import URL

from proxy.upstream.http.lean import LeanClient
from tests.support.h1 import RawUpstream, ResponseHead, read

Read = tuple[int, str, list[tuple[str, str]], bytes]


@dataclass(frozen=True)
class Case:
    answer: bytes
    cuts: list[int]  # where the upstream's writes (and the core's reads) split the answer

    def pieces(self) -> list[bytes]:
        bounds = [0, *sorted(set(self.cuts)), len(self.answer)]
        return [self.answer[a:b] for a, b in itertools.pairwise(bounds) if b > a]


NAMES = st.from_regex(r"X-[A-Za-z0-9-]{1,12}", fullmatch=True)
VALUES = st.from_regex(r"[!-~]([ !-~]{0,30}[!-~])?", fullmatch=True)
REASONS = st.from_regex(r"[A-Za-z]{1,10}( [A-Za-z]{1,10}){0,2}", fullmatch=True)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    status = draw(st.sampled_from([200, 201, 202, 400, 401, 404, 409, 500, 502, 503]))
    version = draw(st.sampled_from(["1.1", "1.0"]))
    framing = draw(st.sampled_from(["length", "close"] if version == "1.0" else ["length", "chunked", "close"]))
    headers = draw(st.lists(st.tuples(NAMES, VALUES), max_size=8))
    body = draw(st.binary(max_size=3000))
    head = [f"HTTP/{version} {status} {draw(REASONS)}\r\n"]
    head += [f"{name}: {value}\r\n" for name, value in headers]
    if framing == "length":
        head.append(f"Content-Length: {len(body)}\r\n")
        framed = body
    elif framing == "chunked":
        head.append("Transfer-Encoding: chunked\r\n")
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(body) - 1)), max_size=6)))) if body else []
        bounds = [0, *[cut for cut in cuts if cut < len(body)], len(body)]
        framed = b"".join(b"%x\r\n%s\r\n" % (b - a, body[a:b]) for a, b in itertools.pairwise(bounds) if b > a)
        framed += b"0\r\n\r\n"
    else:
        framed = body
    answer = "".join(head).encode() + b"\r\n" + framed
    return Case(answer, draw(st.lists(st.integers(1, len(answer) - 1), max_size=6)))


def by_the_core(case: Case) -> Read:
    recorder, _ = read(case.pieces(), end="close")
    head = recorder.events[0][1]
    assert isinstance(head, ResponseHead)
    body = b"".join(value for kind, value in recorder.events if kind == "data" and isinstance(value, bytes))
    assert recorder.events[-1] == ("end", None)
    return head.status, head.reason, head.headers, body


async def over_sockets(case: Case) -> tuple[Read, Read]:
    upstream = await RawUpstream(case.pieces(), end="close").start()
    lean = LeanClient(URL(upstream.url), 5, 10)
    try:
        answer = await lean.post("/mcp", [("Content-Type", "application/json")], b"{}")
        by_lean = (answer.status, answer.reason or "", list(answer.headers.items()), await answer.read())
        async with (
            aiohttp.ClientSession(auto_decompress=False) as http,
            http.post(upstream.url, data=b"{}") as response,
        ):
            body = await response.read()
            by_aiohttp = (response.status, response.reason or "", list(response.headers.items()), body)
    finally:
        await lean.close()
        await upstream.stop()
    return by_lean, by_aiohttp


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_the_core_the_lean_client_and_aiohttps_client_read_the_same_answer(case: Case) -> None:
    by_lean, by_aiohttp = asyncio.run(over_sockets(case))
    assert by_the_core(case) == by_lean == by_aiohttp
