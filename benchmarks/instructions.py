"""Instructions per call in the proxy process, counted by valgrind's callgrind: the same on a quiet machine
and on a loaded one, so a change of a few percent shows where times and CPU seconds drown it in noise.

    python -m benchmarks.instructions [--baseline REF] [--calls N] [--only ROW,...]
    python -m benchmarks.instructions --handles [--calls N]

A lean upstream; first the floor relay (`benchmarks/floor.py`: aiohttp + the lean client, nothing else) under
callgrind, relaying a legacy client's `tools/call`; then a proxy under callgrind, from this tree and from a
`git archive` of REF (default `main`), for each row: a legacy client's `tools/call` on its session through the
pass-through, and a modern synchronous `tools/call`, each with `logging.level: warning` and metrics off (as
the other rows run) and with the defaults (`info`, metrics on); then, on SQLite with the first setting, a
declaring client's task-making `tools/call` counted to its `CreateTaskResult` (`task creation`, the tool
sleeping long after) and to its result committed (`whole task`, the tool answering at once: counting ends
when the store holds every task completed). Each row is printed as instructions per call and as a ratio to the
floor. Counting starts after a warm-up of 300 calls and covers the next N (default 600), at concurrency 4;
what callgrind counts is every instruction of the process, its threads included. Slow (about a minute a
process) and needs `valgrind`; not part of `make bench`. `--handles`: this tree only, a legacy client's
`tools/call` (of a tool without `handle`) and `tools/list` through the pass-through, with task handles off and
on (one tool's policy says `handle`, so the legacy front reads both and rewrites the list's answer).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from benchmarks.baseline import SETTINGS
from benchmarks.harness import (
    ROOT,
    LegacyClient,
    ModernClient,
    baseline_tree,
    free_port,
    measure,
    proxy_config,
    start_upstream,
    wait_for_port,
)

WARM_UP: Final = 300
CONCURRENCY: Final = 4
WARNING: Final = next(iter(SETTINGS))  # `logging.level: warning`, metrics off
LONG_SECONDS: Final = 900.0  # a creation row's tool sleeps past the whole count
SETTLE_SECONDS: Final = 600.0  # how long a whole-task row waits for its tasks to be committed

Call = Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class Kind:
    """One kind of call a row counts: its label, and whether it makes a task that runs on (`sleep` seconds; None:
    not a task) and is counted until it is committed (`whole`)."""

    label: str
    sleep: float | None = None
    whole: bool = False
    lists: bool = False  # a legacy client's tools/list instead of its tools/call


FLOOR: Final = Kind("floor relay, legacy tools/call")
KINDS: Final[dict[str, Kind]] = {
    "pass-through": Kind("pass-through tools/call"),
    "modern": Kind("modern tools/call"),
    "creation": Kind("task creation (tools/call -> CreateTaskResult), SQLite", sleep=LONG_SECONDS),
    "task": Kind("whole task (tools/call -> result committed), SQLite", sleep=0.0, whole=True),
}
LISTING: Final = Kind("pass-through tools/list", lists=True)
HANDLES_ON: Final[dict[str, Any]] = {"tasks": {"tools": {"sleep": {"without_tasks": "handle"}}}}


async def _caller(kind: Kind, url: str) -> tuple[Call, Callable[[], None]]:
    """The call a row makes and how to close its client."""
    if kind is FLOOR or kind is KINDS["pass-through"] or kind.lists:
        legacy = LegacyClient(url)
        await legacy.start()
        return (legacy.list_tools if kind.lists else legacy.echo), legacy.close
    if kind.sleep is None:
        modern = ModernClient(url)
        return modern.echo, modern.close
    tasking, seconds = ModernClient(url, declares_tasks=True), kind.sleep

    async def create() -> None:
        await tasking.create(seconds)

    return create, tasking.close


def _completed(database: Path) -> int:
    """The tasks the proxy's SQLite store holds completed, read beside it (not counted: another process)."""
    with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30) as db:
        (count,) = db.execute("SELECT count(*) FROM tasks WHERE status = 'completed'").fetchone()
        return int(count)


async def _settled(database: Path, count: int) -> None:
    deadline = time.monotonic() + SETTLE_SECONDS
    while await asyncio.to_thread(_completed, database) < count:
        if time.monotonic() > deadline:
            raise RuntimeError(f"fewer than {count} tasks were completed in {SETTLE_SECONDS:g} s")
        await asyncio.sleep(0.5)


def _counted(workdir: Path, out: Path) -> int:
    """The instructions callgrind's last dump to `out` holds (its `totals:` or `summary:` line)."""
    dumps = sorted(workdir.glob(f"{out.name}.*"))
    if not dumps:
        raise RuntimeError("callgrind wrote no dump")
    for line in dumps[-1].read_text().splitlines():
        if line.startswith(("totals:", "summary:")):
            return int(line.split()[1])
    return 0


def _under_callgrind(tree: Path, arguments: list[str], out: Path) -> subprocess.Popen[Any]:
    """`python arguments` from `tree`, run by callgrind with its instrumentation off until switched on."""
    return subprocess.Popen(
        [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={out}",
            sys.executable,
            *arguments,
        ],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _control(process: subprocess.Popen[Any], command: str) -> None:
    subprocess.run(["callgrind_control", command, str(process.pid)], check=True, capture_output=True)


async def _count(
    process: subprocess.Popen[Any], port: int, kind: Kind, calls: int, workdir: Path, out: Path, db: Path | None
) -> float:
    """The warm-up, then `calls` calls with the instrumentation switched on (and, for a whole task, until the
    store holds them completed): instructions per call."""
    try:
        await wait_for_port(port, process, timeout_seconds=600)
        call, close = await _caller(kind, f"http://127.0.0.1:{port}/mcp")
        try:
            await measure(call, WARM_UP, CONCURRENCY)
            if kind.whole and db is not None:
                await _settled(db, WARM_UP)
            await asyncio.to_thread(_control, process, "--instr=on")
            await measure(call, calls, CONCURRENCY)
            if kind.whole and db is not None:
                await _settled(db, WARM_UP + calls)
            await asyncio.to_thread(_control, process, "--dump")
        finally:
            close()
        return await asyncio.to_thread(_counted, workdir, out) / calls
    finally:
        process.terminate()
        try:
            await asyncio.to_thread(process.wait, 60)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)


async def floor_per_call(upstream_url: str, calls: int, workdir: Path) -> float:
    """The floor relay (this tree's) under callgrind."""
    port = free_port()
    out = workdir / f"callgrind-floor-{port}.out"
    process = _under_callgrind(ROOT, ["-m", "benchmarks.floor", "--relay", upstream_url, "--port", str(port)], out)
    return await _count(process, port, FLOOR, calls, workdir, out, None)


async def instructions_per_call(
    upstream_url: str, tree: Path, kind: Kind, sections: dict[str, Any], calls: int, workdir: Path
) -> float:
    """The proxy of `tree` under callgrind, its instrumentation switched on for `calls` calls only."""
    port = free_port()
    name = f"callgrind-{port}"
    db = workdir / f"{name}.db"
    config = proxy_config(upstream_url, workdir, name, port, {"path": str(db)}, tree, **sections)
    out = workdir / f"{name}.out"
    process = _under_callgrind(tree, ["-m", "proxy", "serve", "--config", str(config)], out)
    return await _count(process, port, kind, calls, workdir, out, db)


def _rows(only: frozenset[str]) -> list[tuple[Kind, str]]:
    """(kind, setting) of each row asked for: both settings for the calls, the first for the tasks."""
    rows = []
    for name, kind in KINDS.items():
        if only and name not in only:
            continue
        settings = [WARNING] if kind.sleep is not None else list(SETTINGS)
        rows += [(kind, setting) for setting in settings]
    return rows


async def run(baseline: str, calls: int, only: frozenset[str] = frozenset()) -> list[str]:
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-instructions-"))
    tree = baseline_tree(baseline, workdir)
    if tree is None:
        raise SystemExit(f"{baseline} cannot be read from git")
    upstream = await start_upstream()
    lines = []

    def say(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    try:
        floor = await floor_per_call(upstream.url, calls, workdir)
        say(f"{FLOOR.label}: {floor:,.0f} instructions per call (1.00x)")
        for kind, setting in _rows(only):
            mine = await instructions_per_call(upstream.url, ROOT, kind, SETTINGS[setting], calls, workdir)
            theirs = await instructions_per_call(upstream.url, tree, kind, SETTINGS[setting], calls, workdir)
            say(
                f"{kind.label}, {setting}: {mine:,.0f} instructions per call ({mine / floor:.2f}x the floor);"
                f" {baseline} {theirs:,.0f} ({theirs / floor:.2f}x); {mine / theirs - 1:+.1%}"
            )
    finally:
        upstream.stop()
    return lines


async def run_handles(calls: int) -> list[str]:
    """A legacy client's tools/call and tools/list through the pass-through, task handles off and on."""
    workdir = Path(tempfile.mkdtemp(prefix="mcp-tasks-proxy-bench-instructions-"))
    upstream = await start_upstream()
    lines = []
    try:
        for kind in (KINDS["pass-through"], LISTING):
            for setting, sections in SETTINGS.items():
                off = await instructions_per_call(upstream.url, ROOT, kind, sections, calls, workdir)
                on = await instructions_per_call(upstream.url, ROOT, kind, {**sections, **HANDLES_ON}, calls, workdir)
                line = (
                    f"{kind.label}, {setting}: handles off {off:,.0f} instructions per call, on {on:,.0f}"
                    f" ({on / off - 1:+.1%})"
                )
                print(line, flush=True)
                lines.append(line)
    finally:
        upstream.stop()
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="main", help="git ref whose proxy is counted beside this one")
    parser.add_argument("--calls", type=int, default=600, help="calls counted per proxy (after the warm-up)")
    parser.add_argument(
        "--only", default="", help=f"a comma-separated subset of the rows: {', '.join(KINDS)} (default: all)"
    )
    parser.add_argument("--handles", action="store_true", help="this tree's legacy calls, task handles off and on")
    args = parser.parse_args()
    only = frozenset(name for name in args.only.split(",") if name)
    if unknown := only - KINDS.keys():
        parser.error(f"unknown rows: {', '.join(sorted(unknown))}")
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    asyncio.run(run_handles(args.calls) if args.handles else run(args.baseline, args.calls, only))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
