"""The `tasks` commands (list, show, stats, cancel, purge) on the store a config names (reading no other file of
it), or the SQLite file `--db` names. Imports only the standard library at module level (`cli.py` builds its
parser from here)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any, Final

from proxy.operators import _views as task_views

# Each opens the store the config names (`store.url`, else `store.path`, relative to the working directory as for
# `serve`), or the SQLite file `--db` names, and refuses in one line (exit 1) when it cannot reach it. Imports only
# the standard library at module level (`cli.py` builds its parser from here); each command imports the store when it
# runs.

if TYPE_CHECKING:
    from proxy.config.schema import StoreConfig, TasksConfig
    from proxy.tasks.store import TaskStore

EXIT_NOT_FOUND: Final = 1  # also: the store cannot be reached
STORE_FILES: Final = ("store.password_file",)  # the one file of the config a `tasks` command reads
_MESSAGE_CHARS: Final = 60  # of a statusMessage in the table (the JSON has all of it)


def add_parser(commands: Any) -> None:
    """The `tasks` command and its subcommands, on `commands` (argparse's subparsers action)."""
    tasks = commands.add_parser(
        "tasks",
        help="look at and steer the task store",
        description="Read the task store the config names (safe while the proxy runs); cancel or purge tasks.",
    )
    sub = tasks.add_subparsers(dest="tasks_command", required=True, metavar="COMMAND")
    listing = sub.add_parser(
        "list", help="tasks, newest first", description="List task records, newest first, one page at a time."
    )
    listing.add_argument("--status", action="append", choices=task_views.STATUSES, help="only this status (repeatable)")
    listing.add_argument("--tool", help="only tasks of this tool")
    listing.add_argument("--principal", metavar="HASH", help="only tasks of this principal hash (as `show` prints)")
    listing.add_argument(
        "--older-than", type=task_views.duration_argument, metavar="DUR", help="created more than DUR ago"
    )
    listing.add_argument(
        "--younger-than", type=task_views.duration_argument, metavar="DUR", help="created less than DUR ago"
    )
    listing.add_argument("--limit", type=int, default=50, help="records per page, 1-1000 (default 50)")
    listing.add_argument("--after", metavar="KEY", help="the page after KEY (printed at the end of a full page)")
    listing.add_argument("--json", action="store_true", help="JSON instead of a table")
    show = sub.add_parser(
        "show", help="one task as JSON", description="Print one task record as JSON (exit 1 if there is none)."
    )
    show.add_argument("task_id", metavar="ID")
    stats = sub.add_parser(
        "stats", help="counts by status", description="Print the number of task records by status as JSON."
    )
    cancel = sub.add_parser(
        "cancel",
        help="cancel a live task",
        description="Settle a live task `cancelled`; the proxy (or replica) running its call stops the upstream "
        "call, as for a client's tasks/cancel. A settled task is left as it is.",
    )
    cancel.add_argument("task_id", metavar="ID")
    purge = sub.add_parser(
        "purge",
        help="delete old settled tasks",
        description="Delete settled (completed, failed, cancelled) records last changed more than DUR ago. "
        "A dry run unless --yes; live tasks are never touched.",
    )
    purge.add_argument("--older-than", type=task_views.duration_argument, metavar="DUR", required=True)
    purge.add_argument("--yes", action="store_true", help="delete them (without it: only count them)")
    url = sub.add_parser(
        "admin-url",
        help="the admin page's sign-in URL",
        description="Print the URL that signs a browser in to the admin page (it holds the admin token).",
    )
    url.add_argument("--config", metavar="FILE", required=True, help="a proxy config file with admin.port set")
    for command in (listing, show, stats, cancel, purge):
        source = command.add_mutually_exclusive_group(required=True)
        source.add_argument("--db", metavar="PATH", help="the SQLite task database")
        source.add_argument("--config", metavar="FILE", help="a proxy config file (its store is read)")


def _store_config(args: argparse.Namespace) -> tuple[StoreConfig, TasksConfig]:
    """The store to open and the task settings: `--db`'s SQLite file (default settings), or the config's store
    as `serve` reads it."""
    from proxy.config.loader import load_config
    from proxy.config.schema import StoreConfig, TasksConfig

    if args.db is not None:
        return StoreConfig(path=str(args.db)), TasksConfig()
    config = load_config(args.config, files=STORE_FILES)  # no other file is read (the admin token, the keys)
    return config.store, config.tasks


def _where(config: StoreConfig) -> str:
    return config.url if config.url is not None else config.path


async def _open(config: StoreConfig, max_records: int, *, write: bool) -> TaskStore:
    from proxy.tasks.store import open_store

    return await open_store(config, max_records=max_records, read_only=not write, operator=write)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _table(rows: list[dict[str, Any]]) -> str:
    header = ("TASK", "STATUS", "TOOL", "AGE", "MESSAGE")
    lines = [
        (
            row["taskId"],
            row["status"],
            row["tool"],
            task_views.age_text(row["ageSeconds"]),
            _one_line(row["statusMessage"] or ""),
        )
        for row in rows
    ]
    widths = [max(len(line[i]) for line in [header, *lines]) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line[:4], widths, strict=True)) + "  " + line[4]
        for line in [header, *lines]
    ).rstrip()


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _MESSAGE_CHARS else flat[: _MESSAGE_CHARS - 1] + "…"


async def _list(store: TaskStore, args: argparse.Namespace) -> dict[str, Any]:
    now_ms = _now_ms()
    query = task_views.query(
        now_ms,
        statuses=args.status or (),
        tool=args.tool,
        principal=args.principal,
        older_than_seconds=args.older_than,
        younger_than_seconds=args.younger_than,
        limit=args.limit,
        after=args.after,
    )
    return task_views.page(await store.operators.list_tasks(query), query, now_ms)


async def _show(store: TaskStore, task_id: str) -> dict[str, Any] | None:
    from proxy.wire.jsonrpc import RawJSON
    from proxy.wire.tasks import detailed_task

    record = await store.records.get(task_id)
    if record is None:
        return None
    task = detailed_task(record)
    if isinstance(task.get("result"), RawJSON):
        task["result"] = task["result"].value()  # shown indented, like the rest
    return {
        **task,
        "tool": record.tool,
        "owner": record.owner,
        "onRestart": record.on_restart,
        "principalHash": record.principal,
        "inputsIssued": record.inputs_issued,
    }


async def _run(args: argparse.Namespace, config: StoreConfig, tasks: TasksConfig) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of one command against the open store."""
    import json

    command = args.tasks_command
    store = await _open(config, tasks.max_records, write=command in ("cancel", "purge"))
    try:
        if command == "list":
            page = await _list(store, args)
            if args.json:
                return 0, json.dumps(page, indent=2, ensure_ascii=False), ""
            more = f"more: --after {page['next']}" if page["next"] else ""
            return 0, _table(page["tasks"]), more
        if command == "show":
            shown = await _show(store, args.task_id)
            if shown is None:
                return EXIT_NOT_FOUND, "", f"mcp-tasks-proxy: no task {args.task_id!r} in {_where(config)}"
            return 0, json.dumps(shown, indent=2, ensure_ascii=False), ""
        if command == "stats":
            counts = await store.operators.stats()
            size = await store.operators.size_bytes()
            return 0, json.dumps({"database": _where(config), "sizeBytes": size, **counts}, indent=2), ""
        if command == "cancel":
            return await _cancel(store, args.task_id, _where(config))
        now_ms = _now_ms()
        tombstone_at_ms = now_ms if tasks.tombstone_seconds > 0 else None  # a client asking later learns why
        matched = await store.operators.purge_settled(
            now_ms - int(args.older_than * 1000), dry_run=not args.yes, tombstone_at_ms=tombstone_at_ms
        )
        note = "" if args.yes else "dry run: nothing deleted (add --yes to delete them)"
        return (
            0,
            json.dumps(
                {"settledOlderThanSeconds": args.older_than, "matched": matched, "deleted": matched if args.yes else 0}
            ),
            note,
        )
    finally:
        await store.close()


async def _cancel(store: TaskStore, task_id: str, where: str) -> tuple[int, str, str]:
    import json

    cancelled = await store.operators.cancel_task(task_id, task_views.OPERATOR_CANCEL_MESSAGE, now_ms=_now_ms())
    if cancelled is not None:
        return 0, json.dumps({"taskId": task_id, "status": cancelled.status.value, "owner": cancelled.owner}), ""
    record = await store.records.get(task_id)
    if record is None:
        return EXIT_NOT_FOUND, "", f"mcp-tasks-proxy: no task {task_id!r} in {where}"
    shown = json.dumps({"taskId": task_id, "status": record.status.value})
    return 0, shown, f"task {task_id} was already {record.status.value}: left as it is"


def _admin_url(path: str) -> int:
    from proxy.config.keyfiles import read_token
    from proxy.config.loader import load_config
    from proxy.operators.admin import admin_url

    admin = load_config(path, files=("admin.token_file",)).admin
    if admin.port is None or admin.token_file is None:
        print(f"mcp-tasks-proxy: {path} sets no admin.port: there is no admin listener", file=sys.stderr)
        return EXIT_NOT_FOUND
    print(admin_url(admin, read_token(admin.token_file)))
    return 0


def tasks_command(args: argparse.Namespace) -> int:
    """Run one `tasks` command; its exit code. ConfigError (an unusable `--config`) propagates."""
    import asyncio

    from proxy.tasks.store import StoreError

    if args.tasks_command == "admin-url":
        return _admin_url(args.config)
    config, tasks = _store_config(args)  # ConfigError: the caller reports it, as for every command
    try:
        code, out, err = asyncio.run(_run(args, config, tasks))
    except (StoreError, ValueError) as error:
        lines = str(error).strip().splitlines() or [type(error).__name__]
        print(f"mcp-tasks-proxy: {lines[0]}", file=sys.stderr)  # one line: libpq's errors run over several
        return EXIT_NOT_FOUND
    if out:
        print(out)
    if err:
        print(err, file=sys.stderr)
    return code
