"""policy.py: which tool policy applies (exact name, first matching glob, default) and what a tools/call becomes.

Pure unit tests: configs are built with `TasksConfig.model_validate` from dicts, as the YAML loader would.
"""

from __future__ import annotations

from typing import Any

import pytest

from proxy.config.schema import TaskMode, TaskPolicyConfig, TasksConfig, ToolPolicyConfig
from proxy.policy import SYNC_CALL, Decision, Outcome, Policy, decide, named_tools, policy_for

DEFAULT = {
    "mode": "optional",
    "sync_window_ms": 1500,
    "ttl_ms": 600_000,
    "poll_interval_ms": 2500,
    "on_restart": "fail",
}
DEFAULT_POLICY = Policy(mode="optional", sync_window_ms=1500, ttl_ms=600_000, poll_interval_ms=2500, on_restart="fail")


def tasks_config(tools: dict[str, Any] | None = None, **extra: Any) -> TasksConfig:
    return TasksConfig.model_validate({"default": DEFAULT, "tools": tools or {}, **extra})


# --- lookup order ----------------------------------------------------------------------------------------


def test_unmatched_tool_gets_the_default() -> None:
    config = tasks_config({"batch_*": {"mode": "required"}, "export": {"mode": "forbidden"}})
    assert policy_for(config, "search") == DEFAULT_POLICY


def test_no_tools_section_gives_the_default_to_everyone() -> None:
    assert policy_for(tasks_config(), "anything") == DEFAULT_POLICY


def test_built_in_defaults_apply_when_nothing_is_configured() -> None:
    policy = policy_for(TasksConfig.model_validate({}), "anything")
    assert policy == Policy(
        mode="optional", sync_window_ms=1000, ttl_ms=300_000, poll_interval_ms=1000, on_restart="fail"
    )


def test_exact_name_beats_a_glob_that_also_matches() -> None:
    # The glob comes first in file order; the exact entry still wins.
    config = tasks_config({"batch_*": {"mode": "required"}, "batch_export": {"mode": "forbidden"}})
    assert policy_for(config, "batch_export").mode == "forbidden"
    assert policy_for(config, "batch_import").mode == "required"


def test_exact_name_beats_a_glob_listed_after_it() -> None:
    config = tasks_config({"batch_export": {"mode": "forbidden"}, "batch_*": {"mode": "required"}})
    assert policy_for(config, "batch_export").mode == "forbidden"


def test_first_matching_glob_in_file_order_wins() -> None:
    config = tasks_config(
        {
            "report_*": {"mode": "required", "poll_interval_ms": 111},
            "*_monthly": {"mode": "forbidden", "poll_interval_ms": 222},
            "*": {"poll_interval_ms": 333},
        }
    )
    assert policy_for(config, "report_monthly").poll_interval_ms == 111
    assert policy_for(config, "sales_monthly").poll_interval_ms == 222
    assert policy_for(config, "anything_else").poll_interval_ms == 333


def test_first_matching_glob_wins_in_the_other_order_too() -> None:
    # Same globs, reversed file order: the result follows the order, not some specificity ranking.
    config = tasks_config(
        {
            "*_monthly": {"mode": "forbidden", "poll_interval_ms": 222},
            "report_*": {"mode": "required", "poll_interval_ms": 111},
        }
    )
    assert policy_for(config, "report_monthly").poll_interval_ms == 222


def test_non_matching_globs_are_skipped() -> None:
    config = tasks_config({"a?c": {"poll_interval_ms": 7}, "[xy]*": {"poll_interval_ms": 8}})
    assert policy_for(config, "abc").poll_interval_ms == 7
    assert policy_for(config, "abbc").poll_interval_ms == 2500  # `?` is exactly one character
    assert policy_for(config, "yak").poll_interval_ms == 8
    assert policy_for(config, "zak").poll_interval_ms == 2500


def test_a_tool_named_like_a_glob_is_matched_exactly() -> None:
    config = tasks_config({"weird[1]": {"mode": "required"}, "*": {"mode": "forbidden"}})
    # As a glob "weird[1]" matches only "weird1" (the tool "weird[1]" would fall through to "*"); as an exact
    # key it also matches the tool literally so named.
    assert policy_for(config, "weird[1]").mode == "required"
    assert policy_for(config, "weird1").mode == "required"
    assert policy_for(config, "weird2").mode == "forbidden"


def test_a_literal_star_entry_matches_the_tool_named_star_before_earlier_globs() -> None:
    config = tasks_config({"?": {"mode": "required"}, "*": {"mode": "forbidden"}})
    assert policy_for(config, "*").mode == "forbidden"  # exact, although the earlier glob "?" matches "*"
    assert policy_for(config, "x").mode == "required"  # "?" is first in file order
    assert policy_for(config, "xy").mode == "forbidden"


def test_globs_are_case_sensitive() -> None:
    config = tasks_config({"Batch_*": {"mode": "required"}, "export": {"mode": "forbidden"}})
    assert policy_for(config, "Batch_run").mode == "required"
    assert policy_for(config, "batch_run").mode == "optional"
    assert policy_for(config, "BATCH_RUN").mode == "optional"
    assert policy_for(config, "Export").mode == "optional"  # exact names too


# --- inheritance from `default` --------------------------------------------------------------------------


def test_an_empty_entry_inherits_everything() -> None:
    config = tasks_config({"slow": {}})
    assert policy_for(config, "slow") == DEFAULT_POLICY


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"mode": "required"}, {"mode": "required"}),
        ({"sync_window_ms": 0}, {"sync_window_ms": 0}),
        ({"ttl_ms": 5000}, {"ttl_ms": 5000}),
        ({"poll_interval_ms": 50}, {"poll_interval_ms": 50}),
        ({"on_restart": "rerun"}, {"on_restart": "rerun"}),
        ({"mode": "forbidden", "on_restart": "rerun"}, {"mode": "forbidden", "on_restart": "rerun"}),
    ],
)
def test_a_partial_entry_inherits_every_missing_field(entry: dict[str, Any], expected: dict[str, Any]) -> None:
    config = tasks_config({"tool": entry})
    want = {
        "mode": "optional",
        "sync_window_ms": 1500,
        "ttl_ms": 600_000,
        "poll_interval_ms": 2500,
        "on_restart": "fail",
        **expected,
    }
    assert policy_for(config, "tool") == Policy(**want)


def test_a_glob_entry_inherits_too() -> None:
    config = tasks_config({"batch_*": {"mode": "required"}})
    assert policy_for(config, "batch_x") == Policy(
        mode="required", sync_window_ms=1500, ttl_ms=600_000, poll_interval_ms=2500, on_restart="fail"
    )


def test_explicit_null_ttl_means_unlimited() -> None:
    config = tasks_config({"forever": {"ttl_ms": None}, "inherits": {"mode": "required"}})
    assert policy_for(config, "forever").ttl_ms is None
    assert policy_for(config, "forever").mode == "optional"  # the rest still inherited
    assert policy_for(config, "inherits").ttl_ms == 600_000


def test_explicit_null_ttl_on_a_glob_means_unlimited() -> None:
    config = tasks_config({"long_*": {"ttl_ms": None}})
    assert policy_for(config, "long_job").ttl_ms is None
    assert policy_for(config, "short_job").ttl_ms == 600_000


def test_omitted_ttl_inherits_an_unlimited_default() -> None:
    config = TasksConfig.model_validate({"default": {"ttl_ms": None}, "tools": {"t": {"ttl_ms": 10}, "u": {}}})
    assert policy_for(config, "t").ttl_ms == 10
    assert policy_for(config, "u").ttl_ms is None
    assert policy_for(config, "other").ttl_ms is None


def test_a_programmatic_entry_without_ttl_inherits() -> None:
    # Built without the field at all (not from YAML): still "omitted", so the default's ttl applies.
    config = TasksConfig(default=TaskPolicyConfig.model_validate(DEFAULT), tools={"t": ToolPolicyConfig()})
    assert policy_for(config, "t").ttl_ms == 600_000


# --- decide() ----------------------------------------------------------------------------------------------
#
# Declared: the server MAY answer a tools/call with a task — only to a request that declared the extension.
# Not declared: never a task to a request that did not declare it (read from this request's own `_meta`).
# Cannot serve: a tool that cannot be served without a task answers -32021 to a non-declaring request
#   (REJECT), unless the operator chose `undeclared_required: wait` (an internal task, answered synchronously:
#   WAIT).
# Shortcut: the immediate-result shortcut — an `optional` tool with a window answers synchronously when the
#   call settles within `sync_window_ms` (WINDOW); with a window of 0 the task is created at once (TASK).

CASES = [
    # (mode, sync_window_ms, declares_tasks, undeclared_required, expected)
    ("forbidden", 1000, True, "reject", Outcome.SYNC),
    ("forbidden", 1000, True, "wait", Outcome.SYNC),
    ("forbidden", 1000, False, "reject", Outcome.SYNC),
    ("forbidden", 1000, False, "wait", Outcome.SYNC),
    ("forbidden", 0, True, "reject", Outcome.SYNC),
    ("forbidden", 0, False, "wait", Outcome.SYNC),
    ("optional", 1000, False, "reject", Outcome.SYNC),  # not declared
    ("optional", 1000, False, "wait", Outcome.SYNC),  # not declared
    ("optional", 0, False, "reject", Outcome.SYNC),  # not declared: even with no window
    ("optional", 0, False, "wait", Outcome.SYNC),
    ("optional", 0, True, "reject", Outcome.TASK),  # declared
    ("optional", 0, True, "wait", Outcome.TASK),
    ("optional", 1000, True, "reject", Outcome.WINDOW),  # shortcut
    ("optional", 1000, True, "wait", Outcome.WINDOW),
    ("optional", 1, True, "reject", Outcome.WINDOW),
    ("required", 1000, True, "reject", Outcome.TASK),  # declared
    ("required", 1000, True, "wait", Outcome.TASK),
    ("required", 0, True, "reject", Outcome.TASK),
    ("required", 1000, False, "reject", Outcome.REJECT),  # cannot serve
    ("required", 0, False, "reject", Outcome.REJECT),
    ("required", 1000, False, "wait", Outcome.WAIT),  # not declared: still no task goes to the client
    ("required", 0, False, "wait", Outcome.WAIT),
]
# `resolve_input_first` (MRTR rounds settled before a task is created) changes only what a declaring client
# gets for a tool that may become a task, and needs a window to resolve input in.
INPUT_FIRST_CASES = [
    # (mode, sync_window_ms, declares_tasks, undeclared_required, expected)
    ("optional", 1000, True, "reject", Outcome.INPUT_FIRST),
    ("required", 1000, True, "reject", Outcome.INPUT_FIRST),
    ("required", 1, True, "wait", Outcome.INPUT_FIRST),
    ("optional", 0, True, "reject", Outcome.TASK),  # no window: nothing to resolve synchronously in
    ("required", 0, True, "reject", Outcome.TASK),
    ("forbidden", 1000, True, "reject", Outcome.SYNC),
    ("optional", 1000, False, "reject", Outcome.SYNC),
    ("required", 1000, False, "reject", Outcome.REJECT),
    ("required", 1000, False, "wait", Outcome.WAIT),
]


@pytest.mark.parametrize(("mode", "window", "declares", "undeclared", "expected"), CASES)
def test_decide(mode: TaskMode, window: int, declares: bool, undeclared: str, expected: Outcome) -> None:
    config = tasks_config({"tool": {"mode": mode, "sync_window_ms": window}}, undeclared_required=undeclared)
    decision = decide(config, "tool", declares_tasks=declares)
    assert isinstance(decision, Decision)
    assert decision.outcome is expected
    assert decision.policy == Policy(
        mode=mode, sync_window_ms=window, ttl_ms=600_000, poll_interval_ms=2500, on_restart="fail"
    )


@pytest.mark.parametrize(("mode", "window", "declares", "undeclared", "expected"), INPUT_FIRST_CASES)
def test_decide_with_resolve_input_first(
    mode: TaskMode, window: int, declares: bool, undeclared: str, expected: Outcome
) -> None:
    config = tasks_config(
        {"tool": {"mode": mode, "sync_window_ms": window, "resolve_input_first": True}},
        undeclared_required=undeclared,
    )
    decision = decide(config, "tool", declares_tasks=declares)
    assert decision.outcome is expected
    assert decision.policy is not None
    assert decision.policy.resolve_input_first is True


# What each outcome means for the call's lifecycle: task record first, the client held until the task settles,
# the window, how a question reaches a waiting client, a task even when done in time, progress asked upstream.
PLAN_CASES = [
    # outcome, mode, task_first, holds_client, window_ms, asks_by_mrtr, task_when_done, may_become_task
    (Outcome.SYNC, "optional", False, False, None, True, False, False),
    (Outcome.TASK, "required", True, False, None, False, False, True),
    (Outcome.WINDOW, "optional", False, False, 700, False, False, True),
    (Outcome.WAIT, "required", True, True, None, True, False, True),
    (Outcome.INPUT_FIRST, "optional", False, False, 700, True, False, True),
    (Outcome.INPUT_FIRST, "required", False, False, 700, True, True, True),
]


@pytest.mark.parametrize(
    ("outcome", "mode", "task_first", "holds_client", "window_ms", "asks_by_mrtr", "task_when_done", "progress"),
    PLAN_CASES,
)
def test_a_decision_says_how_the_call_behaves(
    outcome: Outcome,
    mode: TaskMode,
    task_first: bool,
    holds_client: bool,
    window_ms: int | None,
    asks_by_mrtr: bool,
    task_when_done: bool,
    progress: bool,
) -> None:
    policy = Policy(mode, 700, 60_000, 1000, "fail", resolve_input_first=outcome is Outcome.INPUT_FIRST)
    decision = Decision(outcome, policy)
    assert decision.task_first is task_first
    assert decision.holds_client is holds_client
    assert decision.window_ms == window_ms
    assert decision.asks_by_mrtr is asks_by_mrtr
    assert decision.task_when_done is task_when_done
    assert decision.may_become_task is progress


def test_prompts_and_resources_are_plain_synchronous_calls() -> None:
    assert SYNC_CALL.policy is None
    assert (SYNC_CALL.task_first, SYNC_CALL.window_ms, SYNC_CALL.asks_by_mrtr) == (False, None, True)


def test_resolve_input_first_is_inherited_and_overridable() -> None:
    config = TasksConfig.model_validate(
        {"default": {"resolve_input_first": True}, "tools": {"plain": {"resolve_input_first": False}, "other": {}}}
    )
    assert policy_for(config, "other").resolve_input_first is True
    assert policy_for(config, "plain").resolve_input_first is False
    assert decide(config, "other", declares_tasks=True).outcome is Outcome.INPUT_FIRST
    assert decide(config, "plain", declares_tasks=True).outcome is Outcome.WINDOW


# `without_tasks: handle` changes only what a client that did not declare the extension gets: a handle after
# the hold, for `optional` and `required` tools alike (before `undeclared_required`); never for `forbidden`.
HANDLE_CASES = [
    # (mode, declares_tasks, undeclared_required, resolve_input_first, expected)
    ("optional", False, "reject", False, Outcome.HANDLE),
    ("required", False, "reject", False, Outcome.HANDLE),
    ("required", False, "wait", False, Outcome.HANDLE),
    ("optional", False, "reject", True, Outcome.HANDLE),
    ("forbidden", False, "reject", False, Outcome.SYNC),
    ("optional", True, "reject", False, Outcome.WINDOW),
    ("required", True, "reject", False, Outcome.TASK),
    ("optional", True, "reject", True, Outcome.INPUT_FIRST),
]


@pytest.mark.parametrize(("mode", "declares", "undeclared", "input_first", "expected"), HANDLE_CASES)
def test_decide_with_handles(
    mode: TaskMode, declares: bool, undeclared: str, input_first: bool, expected: Outcome
) -> None:
    entry = {"mode": mode, "without_tasks": "handle", "resolve_input_first": input_first}
    config = tasks_config({"tool": entry}, undeclared_required=undeclared)
    decision = decide(config, "tool", declares_tasks=declares, hold_ms=20_000)
    assert decision.outcome is expected
    assert decision.handle is (expected is Outcome.HANDLE)
    if decision.handle:
        assert (decision.window_ms, decision.task_first, decision.holds_client) == (20_000, False, False)
        assert (decision.asks_by_mrtr, decision.may_become_task) == (False, True)


def test_without_tasks_is_inherited_and_overridable() -> None:
    config = TasksConfig.model_validate(
        {"default": {"without_tasks": "handle"}, "tools": {"quick": {"without_tasks": "hold"}, "other": {}}}
    )
    assert policy_for(config, "other").without_tasks == "handle"
    assert policy_for(config, "quick").without_tasks == "hold"
    assert policy_for(TasksConfig.model_validate({}), "any").without_tasks == "hold"
    assert config.has_handles
    assert TasksConfig.model_validate({"tools": {"slow": {"without_tasks": "handle"}}}).has_handles
    assert not TasksConfig.model_validate({"tools": {"slow": {"mode": "required"}}}).has_handles


def test_a_tool_the_upstream_requires_as_a_task_gets_a_handle_even_when_forbidden() -> None:
    config = tasks_config({"tool": {"mode": "forbidden", "without_tasks": "handle"}})
    decision = decide(config, "tool", declares_tasks=False, upstream_support="required", hold_ms=5)
    assert (decision.outcome, decision.upstream_task, decision.window_ms) == (Outcome.HANDLE, True, 5)


def test_every_outcome_is_reachable() -> None:
    reached = {case[-1] for case in CASES + INPUT_FIRST_CASES + HANDLE_CASES}
    assert reached == set(Outcome)


def test_decide_uses_the_default_policy_for_unknown_tools() -> None:
    config = tasks_config({"other": {"mode": "forbidden"}})
    decision = decide(config, "unknown", declares_tasks=True)
    assert decision == Decision(Outcome.WINDOW, DEFAULT_POLICY)


def test_decide_uses_the_resolved_policy_of_a_glob() -> None:
    config = tasks_config({"batch_*": {"mode": "required", "poll_interval_ms": 42}}, undeclared_required="wait")
    assert decide(config, "batch_1", declares_tasks=True) == Decision(
        Outcome.TASK,
        Policy(mode="required", sync_window_ms=1500, ttl_ms=600_000, poll_interval_ms=42, on_restart="fail"),
    )
    assert decide(config, "batch_1", declares_tasks=False).outcome is Outcome.WAIT
    assert decide(config, "other", declares_tasks=False).outcome is Outcome.SYNC


def test_a_tool_window_of_zero_overrides_a_non_zero_default() -> None:
    # 0 is a value, not "missing": the tool must not fall back to the default's 1500 ms window.
    config = tasks_config({"now": {"sync_window_ms": 0}})
    assert decide(config, "now", declares_tasks=True).outcome is Outcome.TASK
    assert decide(config, "later", declares_tasks=True).outcome is Outcome.WINDOW


def test_undeclared_required_defaults_to_reject() -> None:
    config = TasksConfig.model_validate({"default": {"mode": "required"}})
    assert decide(config, "x", declares_tasks=False).outcome is Outcome.REJECT


def test_outcome_values_are_stable() -> None:
    # Logged and compared as strings elsewhere.
    assert {outcome.value for outcome in Outcome} == {
        "sync",
        "task",
        "window",
        "reject",
        "wait",
        "input_first",
        "handle",
    }


def test_named_tools_are_the_exact_names_only() -> None:
    """Metric labels: tools named exactly in the policy; glob patterns are not tool names."""
    config = TasksConfig.model_validate({"tools": {"a": {}, "batch_*": {}, "b?": {}, "c[12]": {}, "d.e": {}}})
    assert named_tools(config) == frozenset({"a", "d.e"})


# --- what the upstream says of a tool it can run as its own task (2025-11-25 Tasks) ------------------------


@pytest.mark.parametrize("mode", ["forbidden", "optional", "required"])
def test_a_tool_the_upstream_requires_as_a_task_is_at_least_required(mode: TaskMode) -> None:
    config = tasks_config({"research": {"mode": mode}})
    declaring = decide(config, "research", declares_tasks=True, upstream_support="required")
    assert declaring.outcome is Outcome.TASK
    assert declaring.policy is not None
    assert declaring.policy.mode == "required"
    assert declaring.upstream_task is True
    rejecting = decide(config, "research", declares_tasks=False, upstream_support="required")
    assert rejecting.outcome is Outcome.REJECT  # -32021, never the upstream's "requires task augmentation"
    waiting = decide(
        tasks_config({"research": {"mode": mode}}, undeclared_required="wait"),
        "research",
        declares_tasks=False,
        upstream_support="required",
    )
    assert (waiting.outcome, waiting.upstream_task) == (Outcome.WAIT, True)  # poll-to-sync on the upstream's task


def test_a_tool_the_upstream_may_run_as_a_task_is_one_when_the_call_may_become_a_task() -> None:
    config = tasks_config({"fast": {"mode": "forbidden"}, "now": {"sync_window_ms": 0}})
    window = decide(config, "anything", declares_tasks=True, upstream_support="optional")
    assert (window.outcome, window.upstream_task) == (Outcome.WINDOW, True)
    task = decide(config, "now", declares_tasks=True, upstream_support="optional")
    assert (task.outcome, task.upstream_task) == (Outcome.TASK, True)
    plain = decide(config, "anything", declares_tasks=False, upstream_support="optional")
    assert (plain.outcome, plain.upstream_task) == (Outcome.SYNC, False)  # a plain call of an optional tool
    forbidden = decide(config, "fast", declares_tasks=True, upstream_support="optional")
    assert (forbidden.outcome, forbidden.upstream_task) == (Outcome.SYNC, False)


@pytest.mark.parametrize("support", [None, "forbidden"])
def test_a_tool_the_upstream_runs_no_task_for_is_decided_as_before(support: Any) -> None:
    config = tasks_config({"slow": {"mode": "required"}})
    for tool, declares in (("slow", True), ("slow", False), ("other", True), ("other", False)):
        with_support = decide(config, tool, declares_tasks=declares, upstream_support=support)
        assert with_support == decide(config, tool, declares_tasks=declares)
        assert with_support.upstream_task is False


def test_a_new_config_brings_its_own_policies_though_the_last_ones_are_kept() -> None:
    """Resolved policies are kept for the config in force only: after a reload (a new TasksConfig) the same
    tool gets the new config's policy, and a config used again after another gets its own once more."""
    before = tasks_config({"report": {"mode": "required"}})
    after = tasks_config({"report": {"mode": "forbidden"}})
    assert policy_for(before, "report").mode == "required"
    assert policy_for(before, "report") is policy_for(before, "report")  # kept, not built per call
    assert policy_for(after, "report").mode == "forbidden"
    assert policy_for(before, "report").mode == "required"


def test_any_number_of_tool_names_keeps_the_answers_right() -> None:
    """A client may name any tool: past the cache's bound every name still gets its own policy."""
    config = tasks_config({"batch_*": {"mode": "required"}})
    for index in range(3000):
        assert policy_for(config, f"batch_{index}").mode == "required"
        assert policy_for(config, f"other_{index}").mode == "optional"
