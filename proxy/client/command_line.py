"""`mcp-tasks-proxy tools`, `call TOOL key=value …` and `follow TASK_ID`: the client in the box on the command line
(its parser, where it connects and with which credentials); what each command does is `flows.py`'s. Imports
only the standard library at module level: `cli.py` builds its parser here, and the probe must not pay for it."""

# The proxy is found by `--url`, else the listen address of `--config FILE`, else DEFAULT_URL; credentials come from
# `--header` (repeatable) or `$MCP_TASKS_CLIENT_TOKEN` (a Bearer token). Exit codes (`flows.py`): 0; 1 a tool error,
# a JSON-RPC error, a failed or cancelled task; 2 usage; 3 the proxy cannot be reached; 130 Ctrl-C with the task
# left running.

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from typing import Any, Final

DEFAULT_URL: Final = "http://127.0.0.1:8080/mcp"
TOKEN_VARIABLE: Final = "MCP_TASKS_CLIENT_TOKEN"


def add_parsers(commands: Any) -> None:
    """`tools`, `call` and `follow` on `commands` (argparse's subparsers action)."""
    common = argparse.ArgumentParser(add_help=False)
    where = common.add_argument_group("where and as whom")
    where.add_argument(
        "--url", help=f"the proxy's MCP endpoint (default: --config's listen address, else {DEFAULT_URL})"
    )
    where.add_argument("--config", metavar="FILE", help="a proxy config file: its listen address and path are used")
    where.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help=f"a header sent with every request, e.g. the credential (repeatable; ${TOKEN_VARIABLE} sends "
        "'Authorization: Bearer $TOKEN')",
    )
    common.add_argument("--json", action="store_true", help="print one JSON document; no progress display")
    common.add_argument(
        "--no-input", action="store_true", help="never ask the upstream's questions here (they are declined)"
    )
    commands.add_parser(
        "tools",
        parents=[common],
        help="list the tools the proxy serves",
        description="List the tools of the MCP server behind the proxy, as a 2026-07-28 client sees them.",
    )
    call = commands.add_parser(
        "call",
        parents=[common],
        help="call a tool, following its task with live progress",
        usage="%(prog)s [options] TOOL [key=value | key:=JSON ...]",
        description="Call TOOL with arguments typed by its inputSchema: key=value takes the argument's type "
        "(string, integer, number, boolean, one of an enum); key:=JSON any JSON value (arrays, objects). A call "
        "that becomes a task is followed until it ends, its progress shown on stderr; the server's questions are "
        "asked here; Ctrl-C offers to cancel the task or leave it running. Exit codes: 0 success, 1 a tool error "
        "or a failed or cancelled task, 2 usage, 3 the proxy cannot be reached, 130 Ctrl-C (task left running).",
    )
    call.add_argument("tool", metavar="TOOL")
    call.add_argument("arguments", metavar="ARGUMENT", nargs="*", help="key=value or key:=JSON")
    follow = commands.add_parser(
        "follow",
        parents=[common],
        help="follow a task to its end",
        description="Follow a task (created by `call`, or by any client with the same credentials) until it "
        "ends: its progress on stderr, its questions asked here, its result on stdout. Exit codes as for call.",
    )
    follow.add_argument("task_id", metavar="TASK_ID")


def main(args: argparse.Namespace) -> int:
    """Run `tools`, `call` or `follow`; the exit code."""
    import asyncio

    from proxy.client.arguments import UsageError
    from proxy.client.connection import RpcError, UnreachableError
    from proxy.client.flows import EXIT_FAILED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, run

    url = DEFAULT_URL
    try:
        url = endpoint(args)
        headers = request_headers(args.header, os.environ)
        return asyncio.run(run(args, url, headers))
    except UsageError as exc:
        _say(f"mcp-tasks-proxy: {exc}")
        return EXIT_USAGE
    except UnreachableError as exc:
        _say(f"mcp-tasks-proxy: cannot reach the proxy at {url}: {exc} (is it running? give --url or --config)")
        return EXIT_UNREACHABLE
    except RpcError as exc:
        _say(f"mcp-tasks-proxy: {_described(exc)}")
        return EXIT_FAILED
    except BrokenPipeError:  # stdout closed early (`| head`): nothing more to say
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - the interpreter flushes it at exit
        return EXIT_OK


def endpoint(args: argparse.Namespace) -> str:
    """`--url`, else the listen address of `--config` (an address that means every interface is reached on
    loopback), else DEFAULT_URL."""
    if args.url:
        return str(args.url)
    if args.config is None:
        return DEFAULT_URL
    from proxy.config.loader import ConfigError, load_config

    try:
        listen = load_config(args.config, files=()).listen  # the endpoint alone: no key file is read
    except ConfigError as exc:
        from proxy.client.arguments import UsageError

        raise UsageError(f"--config {args.config}: {'; '.join(exc.problems)}") from None
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(listen.host, listen.host)
    shown = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"http://{shown}:{listen.port}{listen.path}"


def request_headers(given: list[str], environ: Mapping[str, str]) -> dict[str, str]:
    """`--header 'Name: value'` lines, over the Bearer token of $MCP_TASKS_CLIENT_TOKEN."""
    from proxy.client.arguments import UsageError

    headers: dict[str, str] = {}
    token = environ.get(TOKEN_VARIABLE)
    if token:
        headers["Authorization"] = f"Bearer {token}"
    for line in given:
        name, separator, value = line.partition(":")
        if not separator or not name.strip() or any(char in line for char in "\r\n\0"):
            raise UsageError(f"--header {line!r} is not 'Name: value' on one line")
        headers[name.strip()] = value.strip()
    return headers


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _described(error: Any) -> str:
    """A JSON-RPC error as a sentence, with what to do about a refused credential or Host."""
    text = error.message if error.code is None else f"{error.message} ({error.code})"
    if error.status == 401:
        text += f"; send a credential: --header 'Authorization: Bearer …' or ${TOKEN_VARIABLE}"
    return text
