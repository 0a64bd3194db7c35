"""`check-config --probe`: the upstream a configuration names, asked what `serve` asks it at start (`initialize`,
then `tools/list`), and the configuration's tool names held against that list: a policy or a job family's tool
the upstream does not list is reported with the listed name closest to it. A stdio server is started for it and
stopped. Imports the upstream pool and kinds and the tool-name check; runs once and closes what it opened.
"""

from __future__ import annotations

import aiohttp

from proxy.config.schema import Config
from proxy.config.suggest import did_you_mean
from proxy.config.warnings import raw_token_binding
from proxy.errors import ProxyError, UpstreamAuthError
from proxy.tasks.machine.job import JobSpec
from proxy.tasks.services.tool_names import unmatched_policies
from proxy.upstream.http.session import upstream_connector
from proxy.upstream.kinds import session_kind
from proxy.upstream.pool import SessionPool
from proxy.upstream.session import read_tools


async def probe(config: Config) -> tuple[list[str], str | None]:
    """What the upstream's answers say of `config`: (warnings, the problem that stopped the probe or None)."""
    http = aiohttp.ClientSession(connector=upstream_connector(), cookie_jar=aiohttp.DummyCookieJar())
    pool = SessionPool(session_kind(config, http, None))
    try:
        async with pool.use(None) as session:
            listed, _ = await read_tools(session)
    except UpstreamAuthError as exc:
        found = [f"upstream: {exc.message}: it requires credentials, so its tool names are not checked"]
        binding = raw_token_binding(config)
        if binding is not None and config.security.upstream_auth == "detect":
            found.append(f"{binding[0]}: {binding[1]['hint']}")
        return found, None
    except ProxyError as exc:
        return [], f"upstream: {exc.message}"
    finally:
        await pool.close()
        await http.close()
    return tool_warnings(config, set(listed)), None


def tool_warnings(config: Config, names: set[str]) -> list[str]:
    """Each policy and job tool `config` names that the upstream does not list, with the closest listed name."""
    found = [f"tasks.tools.{name}: {detail}" for name, detail in unmatched_policies(config.tasks, names).items()]
    for start, job in config.jobs.items():
        for role, tool in JobSpec(start, job).tools().items():
            if tool not in names:
                found.append(f"jobs.{start}: the upstream lists no {role} tool {tool!r}{did_you_mean(tool, names)}")
    return found
