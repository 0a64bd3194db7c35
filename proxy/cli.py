"""Command line: argv → config → logging → serve | check-config | tasks … | tools | call | follow | probe; every
command has `--help`. Imports only the standard library at module level: the probe (the container HEALTHCHECK,
every 30 s) must not load aiohttp, pydantic or the app; each command imports what it needs when it runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from proxy.client import command_line as client_commands
from proxy.operators import tasks_cli as operator_cli

# `serve` runs the proxy (`serve … -- CMD ARGS` names a stdio server instead of an upstream URL); `check-config
# [FILE]` validates what `serve` would run (errors all at once, exit code 2; the warnings `serve` logs; `--print`
# writes it as YAML, credentials redacted; `--probe` asks the upstream for its tools); `tasks
# list|show|stats|cancel|purge` work on the store the config names (`operators/tasks_cli.py`); `tools`, `call TOOL
# key=value …` and `follow TASK_ID` are the client in the box (`client/command_line.py`); `probe [URL]` is the container
# HEALTHCHECK (exit 0 on HTTP 200). `--version` prints the version.

if TYPE_CHECKING:
    import asyncio

    from proxy.config.loader import ConfigError
    from proxy.config.schema import Config

EXIT_CONFIG_ERROR = 2  # the other start failures' codes (3 to 6) are in proxy/edge/startup.py
EXIT_PROBE_FAILED = 1  # check-config --probe: the upstream could not be reached
DEFAULT_PROBE_URL = "http://127.0.0.1:8080/healthz"


class _VersionAction(argparse.Action):
    """`--version`, with the version looked up only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="show the version and exit", **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        from proxy.upstream.session import PROXY_VERSION

        print(f"{parser.prog} {PROXY_VERSION}")  # on stdout, as argparse's own version action does
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mcp-tasks-proxy",
        description="Serve a legacy MCP server as an MCP 2026-07-28 server with durable Tasks.",
    )
    parser.add_argument("--version", action=_VersionAction)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the proxy",
        usage="%(prog)s [options] [-- CMD ARGS...]",
        description="Run the proxy in the foreground. After `--`: the command of a legacy MCP server that speaks "
        "stdio, run by the proxy (sets upstream.command, clears upstream.url).",
    )
    serve.add_argument("--config", metavar="FILE", help="YAML config file (defaults apply without one)")
    _add_serve_flags(serve)

    check = commands.add_parser(
        "check-config",
        help="validate a config file",
        usage="%(prog)s [options] [FILE] [-- CMD ARGS...]",
        description="Validate a config file (with the MCP_TASKS_PROXY_* environment and the flags, merged as "
        "`serve` merges them) and exit: 0 when valid, 2 with every problem. A key file that does not exist on "
        "this machine (a Secret mounted only in the pod) is a note, not a problem, unless --strict.",
    )
    check.add_argument("file", metavar="FILE", nargs="?", help="YAML config file (defaults apply without one)")
    check.add_argument(
        "--print",
        action="store_true",
        help="print the effective configuration as YAML, credentials redacted (what `serve` with the same "
        "file, environment and flags would run)",
    )
    check.add_argument(
        "--strict", action="store_true", help="a key file that does not exist here is a problem (exit 2)"
    )
    check.add_argument(
        "--probe",
        action="store_true",
        help="also contact the upstream (initialize, tools/list; a stdio server is started and stopped) and warn "
        "about tool policies and job tools it does not list, with the closest name; exit 1 when it cannot be "
        "reached",
    )
    _add_serve_flags(check)

    operator_cli.add_parser(commands)
    client_commands.add_parsers(commands)

    probe = commands.add_parser(
        "probe",
        help="health check for containers",
        description="GET URL; exit 0 on HTTP 200, 1 otherwise (the image's HEALTHCHECK).",
    )
    probe.add_argument("url", metavar="URL", nargs="?", default=DEFAULT_PROBE_URL)
    probe.add_argument("--timeout", type=float, default=3.0, help="seconds to wait (default 3)")
    return parser


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The flags `serve` merges over the file and the environment (`flag_overrides`); check-config takes them
    too, so that it checks (and prints) what serve would run."""
    parser.add_argument(
        "--upstream", metavar="URL", help="legacy MCP endpoint (sets upstream.url, clears upstream.command)"
    )
    parser.add_argument("--host", help="listen address (overrides listen.host)")
    parser.add_argument("--port", type=int, help="listen port (overrides listen.port)")
    parser.add_argument(
        "--db", metavar="PATH", help="SQLite task database (overrides store.path; relative: from the working directory)"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """argparse, plus `serve … -- CMD ARGS`: what follows the first `--` is `args.server_command` (else [])."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    server_command: list[str] | None = None
    if "--" in argv:
        split = argv.index("--")
        argv, server_command = argv[:split], argv[split + 1 :]
    args = parser.parse_args(argv)
    args.server_command = server_command or []
    if server_command is not None:
        if args.command not in ("serve", "check-config"):
            parser.error("only `serve` and `check-config` take a server command (after `--`)")
        if not server_command:
            parser.error("`--` must be followed by the server's command")
        if args.upstream is not None:
            parser.error("give either --upstream URL or -- CMD ARGS, not both")
    return args


def flag_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The `serve` flags as config overrides (they beat the file and the environment)."""
    overrides: dict[str, dict[str, Any]] = {}
    if args.upstream is not None:
        overrides["upstream"] = {"url": args.upstream, "command": []}
    if args.server_command:
        overrides["upstream"] = {"url": "", "command": list(args.server_command)}
    if args.host is not None:
        overrides.setdefault("listen", {})["host"] = args.host
    if args.port is not None:
        overrides.setdefault("listen", {})["port"] = args.port
    if args.db is not None:
        overrides.setdefault("store", {})["path"] = args.db
    return overrides


def effective_config(path: str | None, overrides: dict[str, dict[str, Any]], absent: list[str] | None = None) -> Config:
    """What `serve` runs: the file, then the MCP_TASKS_PROXY_* environment, then the flags (`overrides`)."""
    from proxy.config.loader import load_config

    return load_config(path, overrides=overrides, absent=absent)


def check_config(args: argparse.Namespace) -> int:
    """`check-config`: the effective configuration validated, and with --print written as YAML (credentials
    redacted). Key files missing here are notes on stderr (exit 0) unless --strict."""
    import asyncio

    import yaml

    from proxy.config.loader import ConfigError, redacted
    from proxy.config.schema import LoggingConfig
    from proxy.config.warnings import start_warnings
    from proxy.observe.logs import configure_logging
    from proxy.operators.probe import probe

    notes: list[str] = []
    try:
        config = effective_config(args.file, flag_overrides(args), absent=None if args.strict else notes)
    except ConfigError as error:
        return report_config_error(error)
    for note in notes:
        print(f"mcp-tasks-proxy: note: {note}", file=sys.stderr)
    warnings = [f"{event}: {fields['hint']}" for event, fields in start_warnings(config)]  # what serve logs
    if args.probe:
        configure_logging(LoggingConfig(level="warning", format=config.logging.format))  # its failures, on stderr
        found, unreachable = asyncio.run(probe(config))
        warnings += found
        if unreachable is not None:
            print(f"mcp-tasks-proxy: cannot probe the upstream: {unreachable}", file=sys.stderr)
            return EXIT_PROBE_FAILED
    for warning in warnings:
        print(f"mcp-tasks-proxy: warning: {warning}", file=sys.stderr)
    name = args.file if args.file is not None else "<defaults>"
    if args.print:
        print(f"# the effective configuration of {name}: the file, the MCP_TASKS_PROXY_* environment, the flags")
        print("# (credentials shown as <redacted>); store.path is absolute")
        print(yaml.safe_dump(redacted(config), sort_keys=False, allow_unicode=True), end="")
    else:
        said = [
            f"{len(items)} {kind}{'s' if len(items) > 1 else ''}"
            for kind, items in (("note", notes), ("warning", warnings))
            if items
        ]
        print(f"{name}: ok" + (f" ({', '.join(said)} above)" if said else ""))
    return 0


def report_config_error(error: ConfigError) -> int:
    print(f"mcp-tasks-proxy: invalid configuration ({error.source}):", file=sys.stderr)
    for problem in error.problems:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_CONFIG_ERROR


def serve(config: Config, path: str | None = None, overrides: dict[str, dict[str, Any]] | None = None) -> int:
    """Run until SIGTERM's drain ends (`proxy/edge/_drain.py`); SIGHUP or a change of `path` reloads the config with
    the same flags (`proxy/config/live.py`). The exit code: 0, or a start failure's own (`proxy/edge/startup.py`)."""
    import asyncio
    import gc

    import structlog

    from proxy.config.live import LiveConfig
    from proxy.edge import startup
    from proxy.edge.app import create_app
    from proxy.edge.serve import serve as serve_app
    from proxy.observe import tracing_setup
    from proxy.observe.logs import configure_logging
    from proxy.tasks.store import StoreError, StoreLockedError

    configure_logging(config.logging)
    startup.descriptor_budget(config)
    live = LiveConfig(config, path, overrides)
    live.subscribe(lambda new: configure_logging(new.logging))
    app = create_app(config, live)

    def loop_factory() -> asyncio.AbstractEventLoop:
        loop = new_event_loop(config.listen.event_loop)
        structlog.get_logger(__name__).info("event_loop", loop=f"{type(loop).__module__}.{type(loop).__name__}")
        return loop

    start_line = startup.start_fields(config, path)
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(serve_app(app, config, start_line))
    except startup.StartFailure as failure:
        return startup.report(failure)
    except StoreLockedError as exc:  # a second proxy on the same SQLite file
        return startup.report(startup.StartFailure(startup.EXIT_STORE_LOCKED, "store_locked", str(exc)))
    except StoreError as exc:  # PostgreSQL down or refusing, a SQLite file that cannot be opened
        return startup.report(startup.StartFailure(startup.EXIT_STORE_UNAVAILABLE, "store_unavailable", str(exc)))
    finally:
        # Everything is closed: the interpreter's last collections need not walk every object the imports made
        # (about 0.3 s of CPU, most of an idle stop).
        gc.freeze()
        tracing_setup.shutdown()  # exports the spans still buffered
    return 0


def new_event_loop(choice: str) -> asyncio.AbstractEventLoop:
    """uvloop's loop when asked for (or, with `auto`, when it is installed), else the standard one."""
    import asyncio

    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise SystemExit("mcp-tasks-proxy: listen.event_loop is uvloop, but uvloop is not installed") from None
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def probe_command(url: str, timeout_seconds: float) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout_seconds) as response:
            ok = response.status == 200
    except (urllib.error.URLError, OSError) as exc:
        print(f"mcp-tasks-proxy: probe {url} failed: {exc}", file=sys.stderr)
        return 1
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "probe":
        return probe_command(args.url, args.timeout)
    if args.command in ("tools", "call", "follow"):
        return client_commands.main(args)
    from proxy.config.loader import ConfigError

    if args.command == "check-config":
        return check_config(args)
    if args.command == "tasks":
        try:
            return operator_cli.tasks_command(args)
        except ConfigError as error:
            return report_config_error(error)
    from proxy.observe import tracing_setup

    overrides = flag_overrides(args)
    try:
        config = effective_config(args.config, overrides)
        tracing_setup.configure()  # from the OTEL_* environment; off when it names no exporter or endpoint
    except ConfigError as error:
        return report_config_error(error)
    except tracing_setup.TracingConfigError as error:  # an unsupported OTEL_* setting stops the start, as config does
        return report_config_error(ConfigError("OTEL_* environment", [str(error)]))
    return serve(config, args.config, overrides)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
