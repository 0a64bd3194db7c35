"""Misbehaving stdio MCP servers for fault tests: ``python -m tests.upstream.faulty_stdio MODE [options]``.

Plain Python, no dependencies: read JSON-RPC lines on stdin, write JSON-RPC lines on stdout. Modes:

- ``exit-at-start``: exits with code 3 before reading anything (``--healthy-while FILE``: unless FILE exists,
  then it is well-behaved: a server that started once and can no longer start).
- ``garbage``: a well-behaved server (initialize, tools/list, tools/call of ``echo``, ping) that writes
  non-JSON lines, non-object JSON and blank lines on stdout before each answer.
- ``no-initialize``: reads stdin and never answers; keeps running after stdin closes (``--ignore-sigterm``:
  SIGTERM too). Writes ``ready`` on stderr once its signal handling is set up.
- ``stderr-flood``: well-behaved, while a thread writes megabytes of stderr lines (and some very long ones)
  until stdin closes.
- ``huge-line``: answers initialize, then writes one line of ``--bytes`` bytes (default 20 MiB) on stdout.
- ``slow-start``: sleeps ``--seconds`` (as ``uvx`` resolving a server does) before reading anything, then is
  well-behaved.

Every well-behaved mode also has the tool ``environment``: its text is the server's environment as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

MODES = ("exit-at-start", "garbage", "no-initialize", "stderr-flood", "huge-line", "slow-start")
GARBAGE = (b"this is not JSON", b"[1, 2]", b'"a string"', b"42", b"null", b"", b"\xff\xfe not UTF-8", b"x" * 1000)
_out_lock = threading.Lock()


def write(message: dict[str, Any]) -> None:
    raw(json.dumps(message).encode())


def raw(line: bytes) -> None:
    with _out_lock:
        sys.stdout.buffer.write(line + b"\n")
        sys.stdout.buffer.flush()


def answer(request: dict[str, Any]) -> dict[str, Any] | None:
    """The result of a request this tiny server knows; None for notifications and answers."""
    method = request.get("method")
    if "id" not in request or method is None:
        return None
    if method == "initialize":
        version = request.get("params", {}).get("protocolVersion", "2025-11-25")
        result: dict[str, Any] = {
            "protocolVersion": version,
            "capabilities": {"tools": {}},
            "serverInfo": {"name": "faulty-stdio", "version": "0"},
        }
    elif method == "tools/list":
        result = {
            "tools": [
                {"name": "echo", "inputSchema": {"type": "object"}},
                {"name": "environment", "inputSchema": {"type": "object"}},
            ]
        }
    elif method == "tools/call" and request.get("params", {}).get("name") == "environment":
        result = {"content": [{"type": "text", "text": json.dumps(dict(os.environ))}], "isError": False}
    elif method == "tools/call":
        text = json.dumps(request.get("params", {}).get("arguments", {}), sort_keys=True)
        result = {"content": [{"type": "text", "text": text}], "isError": False}
    elif method == "ping":
        result = {}
    else:
        return {"jsonrpc": "2.0", "id": request["id"], "error": {"code": -32601, "message": "Method not found"}}
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


def serve(before_each_answer: Sequence[bytes] = ()) -> None:
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        response = answer(request) if isinstance(request, dict) else None
        if response is not None:
            for junk in before_each_answer:
                raw(junk)
            write(response)


def flood() -> None:
    lines = b"".join(b"flood line %d: " % n + b"e" * 80 + b"\n" for n in range(500))
    long_line = b"L" * 200_000 + b"\n"
    for round_number in itertools.count():
        sys.stderr.buffer.write(lines)
        if round_number % 20 == 0:
            sys.stderr.buffer.write(long_line)
        sys.stderr.buffer.flush()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.upstream.faulty_stdio", description=__doc__)
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--ignore-sigterm", action="store_true", help="no-initialize: survive SIGTERM")
    parser.add_argument("--bytes", type=int, default=20 * 1024 * 1024, help="huge-line: the line's length")
    parser.add_argument("--seconds", type=float, default=2.0, help="slow-start: how long it sleeps first")
    parser.add_argument("--healthy-while", metavar="FILE", help="exit-at-start: well-behaved while FILE exists")
    args = parser.parse_args(argv)
    if args.mode == "exit-at-start":
        if args.healthy_while is None or not os.path.exists(args.healthy_while):
            return 3
        serve()
        return 0
    if args.mode == "slow-start":
        time.sleep(args.seconds)
        serve()
        return 0
    if args.mode == "garbage":
        serve(GARBAGE)
    elif args.mode == "no-initialize":
        if args.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sys.stderr.write("ready\n")
        sys.stderr.flush()
        for _ in sys.stdin.buffer:
            pass
        while True:
            time.sleep(3600)
    elif args.mode == "stderr-flood":
        threading.Thread(target=flood, daemon=True).start()
        serve()
        os._exit(0)  # at once: a daemon thread stopped inside a stderr write can abort interpreter shutdown
    else:
        line = sys.stdin.buffer.readline()
        response = answer(json.loads(line))
        assert response is not None
        write(response)
        raw(b'{"jsonrpc":"2.0","method":"notifications/message","params":{"data":"' + b"h" * args.bytes + b'"}}')
        serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
