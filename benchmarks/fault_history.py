"""The history of a randomized fault run (`benchmarks/faults.py`) and its checker: what each request got and how
long it took, what each task was seen as, which faults happened when, what the replicas logged and what the
store and the upstreams hold at the end; `check` turns it into figures and violations of what must hold.

What must hold: every request answered within 15 s; every 503 of an unavailable store within the store's
deadline (+20 ms) and with `Retry-After`; no terminal state ever changes; every completed task has its own
result; no key ran twice; no take-over of a replica that could reach the store and was alive; no key left
claimed with no request behind it; no HTTP 500. Imports nothing of the proxy.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Final

ANSWER_SECONDS: Final = 15.0
STORE_DEADLINE_MARGIN_SECONDS: Final = 0.02
TAKEN_OVER: Final = "interrupted: the replica running it was lost"


@dataclass
class Request:
    """One HTTP request of the load: what it asked and what it got."""

    kind: str  # "call" (keyed or not) or "get"
    replica: int
    started: float  # seconds since the run's start
    seconds: float
    status: int | None  # None: no HTTP answer (`error` says why)
    error: str = ""  # the JSON-RPC error's message, or the transport error
    retry_after: str | None = None
    key: str | None = None
    task_id: str | None = None


@dataclass
class Fault:
    kind: str  # kill, term, stop, freeze, cut
    started: float
    healed: float = 0.0
    replica: int | None = None  # the replica it hit (kill, term, cut)
    replica_id: str | None = None  # that replica's id in the store, when it hit one
    lasted: float = 0.0


@dataclass
class Task:
    task_id: str
    tool: str
    expected: str  # the text its result must have
    key: str | None
    seen: list[tuple[str, str]] = field(default_factory=list)  # (status, result or error text), in order


@dataclass
class History:
    seed: int
    seconds: float
    store_timeout: float
    requests: list[Request] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    tasks: dict[str, Task] = field(default_factory=dict)
    keys: dict[str, list[Request]] = field(default_factory=dict)  # every attempt of each key
    events: list[dict[str, Any]] = field(default_factory=list)  # every replica's log lines
    replicas: dict[str, str] = field(default_factory=dict)  # replica id → how its process ended (or "alive")
    runs_per_key: dict[str, int] = field(default_factory=dict)  # executions over all upstreams
    claims_left: list[dict[str, Any]] = field(default_factory=list)  # key rows with no outcome at the end

    def add(self, request: Request) -> None:
        self.requests.append(request)
        if request.key is not None:
            self.keys.setdefault(request.key, []).append(request)


def _when(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()


def _take_over_cause(history: History, event: dict[str, Any], epoch: float) -> str:
    """Why a take-over was right, or "LIVE" when the replica taken over was alive and reached the store."""
    replica_id = event.get("replica")
    at = _when(event) - epoch
    ended = history.replicas.get(str(replica_id), "unknown")
    for fault in history.faults:
        if fault.replica_id == replica_id and fault.kind == "cut" and fault.started <= at <= fault.healed + 30:
            return f"cut off at {fault.started:.1f} s"
    if ended.startswith(("killed", "terminated")):
        return ended
    return "LIVE"


def _before_answer(attempts: list[Request]) -> int:
    """Attempts of one key before the first that was answered with its task."""
    for index, request in enumerate(attempts):
        if request.status == 200:
            return index
    return len(attempts)


def check(
    history: History, epoch: float, deadline_margin: float = STORE_DEADLINE_MARGIN_SECONDS
) -> tuple[dict[str, Any], list[str]]:
    """The figures of a run, and what did not hold (empty: everything held). `epoch`: the run's start (wall
    clock); `deadline_margin`: how late past the store's deadline a 503 may come."""
    violations: list[str] = []
    calls = [r for r in history.requests if r.kind == "call"]
    statuses = Counter(str(r.status) if r.status is not None else r.error.split(":")[0] for r in history.requests)
    for request in history.requests:
        if request.status is None and request.error.startswith("timeout"):
            violations.append(f"unanswered within {ANSWER_SECONDS:g} s: {request}")
    store_503 = [r for r in history.requests if r.status == 503 and "task store is unavailable" in r.error]
    deadline = history.store_timeout + deadline_margin
    slow_503 = [r for r in store_503 if r.seconds > deadline]
    for request in history.requests:
        if request.status == 503 and not (request.retry_after or "").isdigit():
            violations.append(f"503 without Retry-After: {request}")
    if slow_503:
        worst = max(r.seconds for r in slow_503)
        violations.append(f"{len(slow_503)} store 503s later than {deadline:.2f} s (the slowest {worst:.3f} s)")
    for request in history.requests:
        if request.status == 500:
            violations.append(f"HTTP 500: {request}")
    completed = 0
    for task in history.tasks.values():
        terminal = [seen for seen in task.seen if seen[0] in {"completed", "failed", "cancelled"}]
        if terminal and any(seen != terminal[0] for seen in terminal):
            violations.append(f"terminal state changed: {task.task_id} {terminal}")
        if terminal and terminal[0][0] == "completed":
            completed += 1
            if terminal[0][1] != task.expected:
                violations.append(f"not its own result: {task.task_id} {terminal[0][1]!r} != {task.expected!r}")
        if not terminal:
            violations.append(f"never settled: {task.task_id} ({task.seen[-1:]})")
    for key, runs in history.runs_per_key.items():
        if runs > 1:
            violations.append(f"key ran {runs} times: {key}")
    for key, attempts in history.keys.items():
        answered = {r.task_id for r in attempts if r.status == 200}
        if len(answered) > 1:
            violations.append(f"one key, several tasks: {key} {sorted(str(each) for each in answered)}")
        if not answered:
            violations.append(f"a keyed call never answered with its task: {key} ({len(attempts)} attempts)")
    takeovers = [event for event in history.events if event.get("event") == "replica_taken_over"]
    causes = []
    for event in takeovers:
        cause = _take_over_cause(history, event, epoch)
        causes.append({"replica": event.get("replica"), "tasks": event.get("tasks"), "cause": cause})
        if cause == "LIVE":
            violations.append(f"take-over of a live replica: {event}")
    for row in history.claims_left:
        owner_end = history.replicas.get(str(row["owner"]), "unknown")
        attempts = history.keys.get(str(row["key"]), [])
        refused_only = attempts and all(r.status != 200 for r in attempts)
        if owner_end == "alive" or refused_only:
            violations.append(f"key left claimed (owner {owner_end}, attempts {len(attempts)}): {row}")
    interrupted = [t for t in history.tasks.values() if t.seen and t.seen[-1] == ("failed", TAKEN_OVER)]
    faults = Counter(fault.kind for fault in history.faults)
    figures = {
        "seed": history.seed,
        "seconds": history.seconds,
        "requests": len(history.requests),
        "calls": len(calls),
        "keyed calls": sum(1 for r in calls if r.key is not None),
        "keys": len(history.keys),
        "keyed retries before an answer": sum(_before_answer(attempts) for attempts in history.keys.values()),
        "duplicate deliveries (answered again)": sum(
            max(0, sum(1 for r in attempts if r.status == 200) - 1) for attempts in history.keys.values()
        ),
        "answers": dict(sorted(statuses.items())),
        "tasks": len(history.tasks),
        "completed": completed,
        "failed as taken over": len(interrupted),
        "faults": dict(sorted(faults.items())),
        "fault lengths": [f"{fault.kind} {fault.lasted:.1f} s" for fault in history.faults],
        "store 503s": len(store_503),
        "slowest store 503 s": round(max((r.seconds for r in store_503), default=0.0), 3),
        "results written late": sum(1 for e in history.events if e.get("event") == "settlement_written_late"),
        "settlements refused": dict(
            Counter(str(e.get("reason")) for e in history.events if e.get("event") == "settlement_refused")
        ),
        "take-overs": causes,
        "keys run (sum over upstreams)": dict(Counter(history.runs_per_key.values())),
        "claims left without outcome": len(history.claims_left),
    }
    return figures, violations


def report(figures: dict[str, Any], violations: list[str]) -> str:
    lines = [json.dumps(figures, indent=2)]
    lines.append(f"violations: {len(violations)}")
    lines.extend(f"  - {violation}" for violation in violations[:50])
    return "\n".join(lines)
