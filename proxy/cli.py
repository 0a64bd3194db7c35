"""Command line: argv → config → logging → serve | check-config.

`mcp-tasks-proxy serve [--config FILE] [--upstream URL] [--host H] [--port P] [--db PATH]` and
`mcp-tasks-proxy check-config FILE`. Configuration errors are printed all at once, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from proxy.config import Config, ConfigError, load_config
from proxy.upstream.session import PROXY_VERSION

EXIT_CONFIG_ERROR = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy",
        description="Serve a legacy MCP server as an MCP 2026-07-28 server with durable Tasks.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {PROXY_VERSION}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the proxy", description="Run the proxy in the foreground.")
    serve.add_argument("--config", metavar="FILE", help="YAML config file (defaults apply without one)")
    serve.add_argument("--upstream", metavar="URL", help="legacy MCP endpoint (overrides upstream.url)")
    serve.add_argument("--host", help="listen address (overrides listen.host)")
    serve.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    serve.add_argument("--db", metavar="PATH", help="SQLite task database (overrides store.path)")

    check = commands.add_parser(
        "check-config", help="validate a config file", description="Validate a config file and exit."
    )
    check.add_argument("file", metavar="FILE")
    return parser


def _flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {}
    if args.upstream is not None:
        overrides.setdefault("upstream", {})["url"] = args.upstream
    if args.host is not None:
        overrides.setdefault("listen", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("listen", {})["port"] = args.port
    if args.db is not None:
        overrides.setdefault("store", {})["path"] = args.db
    return overrides


def _report(error: ConfigError) -> int:
    print(f"mcp-tasks-proxy: invalid configuration ({error.source}):", file=sys.stderr)
    for problem in error.problems:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


def serve(config: Config) -> None:
    from proxy.app import create_app
    from proxy.observability import configure_logging

    configure_logging(config.logging)
    web.run_app(
        create_app(config),
        host=config.listen.host,
        port=config.listen.port,
        print=lambda message: print(message, file=sys.stderr, flush=True),
        access_log=None,
        handler_cancellation=True,  # C-19: a client that closes its stream cancels its request.
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        try:
            load_config(args.file)
        except ConfigError as error:
            return _report(error)
        print(f"{args.file}: ok")
        return 0
    try:
        config = load_config(args.config, overrides=_flag_overrides(args))
    except ConfigError as error:
        return _report(error)
    serve(config)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
