"""The check at start that the tools `tasks.tools` and the job families name exist upstream, each missing one
warned about once with the listed tool whose name is closest. Imports the config's shapes, the policy's glob
rule, the job follower and the upstream pool."""

from __future__ import annotations

from collections.abc import Callable, Collection
from fnmatch import fnmatchcase

import structlog

from proxy.config.schema import Config, TasksConfig
from proxy.config.suggest import did_you_mean
from proxy.errors import UpstreamError
from proxy.policy import is_glob
from proxy.tasks.effects.job import JobFollower
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import read_tools

# A policy (or a `max_concurrent` cap) for a tool the upstream's `tools/list` lacks does nothing: usually a typo or a
# renamed tool. The list is read once; each such entry is warned about as `tool_policy_missing` naming the key and the
# tool (the shape of the job families' `job_tool_missing`, checked against the same list); a glob that matches none of
# the listed tools is warned about alike. Imports the config's shapes, the policy's glob rule, the job effect and the
# upstream pool; never the executor, the store or aiohttp.

log = structlog.get_logger(__name__)


async def check_named_tools(pool: SessionPool, config: Callable[[], Config], jobs: JobFollower) -> list[str]:
    """At start: the upstream's tool list is read once, and each tool a policy (of the config in force once the
    list is read) or a job family names that it does not list is warned about; returns those names. An upstream
    that cannot be asked now (down, or it wants the caller's credentials) is only logged."""
    try:
        async with pool.use(None) as session:
            listed, _ = await read_tools(session)
    except UpstreamError as exc:
        tasks = config().tasks
        if tasks.tools:
            log.warning("tool_policies_unchecked", error=exc.message)
        if jobs.specs:
            log.warning("job_tools_unchecked", error=exc.message)
        return []
    return missing_policy_tools(config().tasks, listed.keys()) + jobs.missing_tools(listed.keys())


def unmatched_policies(tasks: TasksConfig, listed: Collection[str]) -> dict[str, str]:
    """The `tasks.tools` keys that name no listed tool (or, for a glob, match none), each with what it means and
    the listed tool its name is closest to (`check-config --probe` prints these; the start logs them)."""
    unmatched = {}
    for name in tasks.tools:
        if is_glob(name):
            if any(fnmatchcase(tool, name) for tool in listed):
                continue
            unmatched[name] = f"no tool the upstream lists matches {name!r}: this policy applies to no call"
        elif name not in listed:
            unmatched[name] = (
                f"the upstream lists no tool {name!r}{did_you_mean(name, listed)}: this policy applies to no call"
            )
    return unmatched


def missing_policy_tools(tasks: TasksConfig, listed: Collection[str]) -> list[str]:
    """The `tasks.tools` keys that name no listed tool (or, for a glob, match none), each warned about."""
    unmatched = unmatched_policies(tasks, listed)
    for name, detail in unmatched.items():
        log.warning(
            "tool_policy_missing",
            key=f"tasks.tools.{name}",
            tool=name,
            fields=sorted(tasks.tools[name].model_fields_set),
            detail=detail,
        )
    return list(unmatched)
