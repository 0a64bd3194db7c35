"""Per-tool task policy: which policy applies to a tool, and what one modern `tools/call` becomes.

SANS-IO and pure: `policy_for()` resolves the config (exact name, then the first matching glob in file order,
then `default`), `decide()` maps (policy, this request's declaration, what the upstream said of the tool) to
an Outcome. Imports only the config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from fnmatch import fnmatchcase
from typing import Final

from proxy.config.schema import RestartAction, TaskMode, TasksConfig, ToolPolicyConfig, WithoutTasks

# A legacy upstream's own `execution.taskSupport` for a tool (2025-11-25 Tasks): `optional` and `required` only
# when it declared `tasks.requests.tools.call`; None when it runs no tasks of its own for the tool.
UpstreamTaskSupport = TaskMode | None


@dataclass(frozen=True, slots=True)
class Policy:
    mode: TaskMode
    sync_window_ms: int
    ttl_ms: int | None
    poll_interval_ms: int
    on_restart: RestartAction
    resolve_input_first: bool = False
    max_concurrent: int | None = None  # the tool's own cap on upstream requests at once (None: the upstream's)
    calls_per_minute: int | None = None  # the tool's own quota per caller and minute (None: none)
    without_tasks: WithoutTasks = "hold"  # what a client without the Tasks extension gets: held, or a handle
    # The `tasks.tools` key that named the tool (its name, or a glob; None: the default), for naming its quota;
    # not part of what the policy is (an empty entry is the default policy).
    entry: str | None = field(default=None, compare=False)


class Outcome(StrEnum):
    SYNC = "sync"  # plain synchronous call
    TASK = "task"  # a task at once
    WINDOW = "window"  # synchronous if it settles within the window, else a task continuing the same call
    REJECT = "reject"  # -32021: the tool needs a task and the client did not declare the extension
    WAIT = "wait"  # an internal task; the client's response is held until it settles (poll-to-sync)
    INPUT_FIRST = "input_first"  # MRTR rounds while the call answers within the window, then a task
    HANDLE = "handle"  # held up to `handles.hold_ms`, then a task the client reads through a handle (no Tasks)


@dataclass(frozen=True, slots=True)
class Decision:
    """What one request's call becomes, and how it behaves while a client waits for it.

    The call's lifecycle (`tasks/machine/`) reads every policy choice from here: whether a task record comes
    first, how long a window lasts, how a question reaches a waiting client, and whether even a call that ends
    within its window answers with a task."""

    outcome: Outcome
    policy: Policy | None  # None for prompts/get and resources/read, which have no tool policy
    upstream_task: bool = False  # the upstream runs the call as its own task, which the proxy follows
    job: bool = False  # ... a legacy job (`jobs:`): started by its start tool, followed through its status tool
    hold_ms: int = 0  # how long a HANDLE call is held before its client gets a handle

    @property
    def task_first(self) -> bool:
        """The task record is committed before the upstream call starts (a task at once, or poll-to-sync)."""
        return self.outcome in (Outcome.TASK, Outcome.WAIT)

    @property
    def holds_client(self) -> bool:
        """Poll-to-sync: the client's request is held until the internal task settles, then answered with its
        outcome."""
        return self.outcome is Outcome.WAIT

    @property
    def window_ms(self) -> int | None:
        """How long a waiting client waits before a call still running becomes a task (None: no window)."""
        if self.outcome in (Outcome.WINDOW, Outcome.INPUT_FIRST) and self.policy is not None:
            return self.policy.sync_window_ms
        if self.outcome is Outcome.HANDLE:
            return self.hold_ms
        return None

    @property
    def asks_by_mrtr(self) -> bool:
        """A question asked while the client waits goes to it as an MRTR round (`InputRequiredResult`); for a
        window call it is carried by the task the call becomes instead."""
        return self.outcome in (Outcome.SYNC, Outcome.WAIT, Outcome.INPUT_FIRST)

    @property
    def task_when_done(self) -> bool:
        """A `required` tool with `resolve_input_first`: once its questions are resolved, the answer is a task,
        even when the call ends within the window."""
        return self.outcome is Outcome.INPUT_FIRST and self.policy is not None and self.policy.mode == "required"

    @property
    def may_become_task(self) -> bool:
        """The call may end up as a task, so the proxy asks the upstream for progress (its statusMessage) even
        when the client did not."""
        return self.outcome in (Outcome.TASK, Outcome.WINDOW, Outcome.WAIT, Outcome.INPUT_FIRST, Outcome.HANDLE)

    @property
    def handle(self) -> bool:
        """A client without the Tasks extension gets a handle (a tool result naming the task) for a call still
        running after the hold; the questions it asks go to that task, answered through the task tools."""
        return self.outcome is Outcome.HANDLE


SYNC_CALL: Final = Decision(Outcome.SYNC, None)  # prompts/get and resources/read: synchronous, may ask (MRTR)


_NO_ENTRY: Final = ToolPolicyConfig()  # a tool the policy does not name: the defaults (frozen, made once)


# Resolved policies of the config in force, by tool name: resolving walks the globs and builds a Policy, on every
# call otherwise. One config at a time (a reload brings a new, frozen TasksConfig, and the cache starts afresh);
# at most _CACHED names (a client may name any tool: past that, the cache starts afresh too).
_CACHED: Final = 1024
_resolved: tuple[TasksConfig | None, dict[str, Policy]] = (None, {})


def policy_for(tasks: TasksConfig, tool: str) -> Policy:
    global _resolved
    config, policies = _resolved
    if config is not tasks or len(policies) >= _CACHED:
        policies = {}
        _resolved = (tasks, policies)
    policy = policies.get(tool)
    if policy is None:
        policy = policies[tool] = _resolve(tasks, tool)
    return policy


def _resolve(tasks: TasksConfig, tool: str) -> Policy:
    entry = tasks.tools.get(tool)
    key: str | None = tool
    if entry is None:
        globs = ((pattern, glob_entry) for pattern, glob_entry in tasks.tools.items() if is_glob(pattern))
        key, entry = next(
            ((pattern, glob_entry) for pattern, glob_entry in globs if fnmatchcase(tool, pattern)), (None, None)
        )
    if entry is None:
        return _merged(_NO_ENTRY, tasks, None)
    return _merged(entry, tasks, key)


def is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def named_tools(tasks: TasksConfig) -> frozenset[str]:
    """The tools the policy names exactly (not through a glob): the bounded set of `tool` metric labels."""
    return frozenset(name for name in tasks.tools if not is_glob(name))


def _merged(entry: ToolPolicyConfig, tasks: TasksConfig, key: str | None) -> Policy:
    default = tasks.default
    given = entry.model_fields_set  # `ttl_ms: null` given explicitly means unlimited, not "inherit"
    return Policy(
        mode=entry.mode if entry.mode is not None else default.mode,
        sync_window_ms=entry.sync_window_ms if entry.sync_window_ms is not None else default.sync_window_ms,
        ttl_ms=entry.ttl_ms if "ttl_ms" in given else default.ttl_ms,
        poll_interval_ms=entry.poll_interval_ms if entry.poll_interval_ms is not None else default.poll_interval_ms,
        on_restart=entry.on_restart if entry.on_restart is not None else default.on_restart,
        resolve_input_first=(
            entry.resolve_input_first if entry.resolve_input_first is not None else default.resolve_input_first
        ),
        max_concurrent=entry.max_concurrent,
        calls_per_minute=entry.calls_per_minute_per_principal,
        without_tasks=entry.without_tasks if entry.without_tasks is not None else default.without_tasks,
        entry=key,
    )


def decide(
    tasks: TasksConfig,
    tool: str,
    *,
    declares_tasks: bool,
    upstream_support: UpstreamTaskSupport = None,
    hold_ms: int = 0,
) -> Decision:
    """`declares_tasks` comes from this request's `_meta` only (never an earlier request, never the legacy
    `task` param): a client that did not declare the Tasks extension on this request never gets a task (the
    extension's "Capability Negotiation"), but with `without_tasks: handle` it gets a handle after `hold_ms`
    (`handles.hold_ms`). `resolve_input_first` only changes what a declaring client gets for a tool that may
    become a task.

    `upstream_support` is the upstream's own task support for the tool. A tool the upstream requires as a task
    is at least `required` here too, whatever the policy says (it cannot run otherwise). A call that may become
    a task of a tool the upstream can run as its own task (`optional` or `required`) is sent to the upstream as
    a task, and the proxy follows that task; a synchronous call of an `optional` tool stays a plain call."""
    policy = policy_for(tasks, tool)
    if upstream_support == "required" and policy.mode != "required":
        policy = replace(policy, mode="required")
    decision = _decide(tasks, policy, declares_tasks)
    if decision.handle:
        decision = replace(decision, hold_ms=hold_ms)
    if upstream_support in ("optional", "required") and decision.may_become_task:
        return replace(decision, upstream_task=True)
    return decision


def decide_job(tasks: TasksConfig, tool: str, *, declares_tasks: bool) -> Decision:
    """A `jobs:` start tool: always a task the proxy follows (the job outlives any one request). A client that
    declared the Tasks extension gets the task; any other gets the job's final result on its request
    (poll-to-sync), as it would have by driving the status tool itself."""
    policy = replace(policy_for(tasks, tool), mode="required")
    return Decision(Outcome.TASK if declares_tasks else Outcome.WAIT, policy, upstream_task=True, job=True)


def _decide(tasks: TasksConfig, policy: Policy, declares_tasks: bool) -> Decision:
    if policy.mode == "forbidden":
        return Decision(Outcome.SYNC, policy)
    if not declares_tasks and policy.without_tasks == "handle":
        return Decision(Outcome.HANDLE, policy)
    if declares_tasks and policy.resolve_input_first and policy.sync_window_ms > 0:
        return Decision(Outcome.INPUT_FIRST, policy)
    if policy.mode == "required":
        if declares_tasks:
            return Decision(Outcome.TASK, policy)
        return Decision(Outcome.WAIT if tasks.undeclared_required == "wait" else Outcome.REJECT, policy)
    if not declares_tasks:
        return Decision(Outcome.SYNC, policy)
    return Decision(Outcome.TASK if policy.sync_window_ms == 0 else Outcome.WINDOW, policy)
