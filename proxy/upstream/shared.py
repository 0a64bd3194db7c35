"""What every session of one upstream shares, whatever its kind: the shared state.

The shared state owns background work (a `background.Background`: named, referenced until done, cancelled on
close; upstream/ starts background tasks only through its shared state) and what the upstream said most
recently: serverInfo and the whole InitializeResult (server/discover), the `x-mcp-header` catalog of its tools
with each tool's `execution.taskSupport` (`ToolCatalog`; the pool keeps one per caller when the catalog may not
be shared), when it last answered (readiness), and whether what it said may serve every caller (`auth.py`).
Each kind's shared state (`http/shared.py`, `stdio/shared.py`) adds its transport. Imports the wire,
observability and the auth decision; no aiohttp, no session kind.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Coroutine, Iterator
from typing import Any, Final

from proxy.background import Background
from proxy.errors import UpstreamAuthError, UpstreamError, UpstreamTimeoutError
from proxy.observe.metrics import Metrics, method_label
from proxy.upstream.auth import UpstreamAuth
from proxy.wire import legacy_tasks
from proxy.wire.envelope import ParamHeader
from proxy.wire.jsonrpc import JSON
from proxy.wire.translate import implementation

PARAM_HEADERS_REFRESH_SECONDS: Final = 5.0  # an unknown tool re-reads tools/list at most this often


class ToolCatalog:
    """One read of the upstream's tools/list: each tool's `x-mcp-header` annotations and `execution.taskSupport`.
    Stale once any session heard that the tool list changed (the shared state's `tools_generation` moved on)."""

    def __init__(self) -> None:
        self.headers: dict[str, tuple[ParamHeader, ...]] | None = None
        self.task_support: dict[str, legacy_tasks.TaskSupport | None] = {}
        self.read_at = 0.0
        self.generation = 0

    def known_headers(self, tool: str, generation: int) -> tuple[ParamHeader, ...] | None:
        """The tool's annotations when this catalog can answer (it lists the tool, or was read too recently to
        read again); None when tools/list must be read."""
        if self.headers is None or generation != self.generation:
            return None
        if tool in self.headers:
            return self.headers[tool]
        if time.monotonic() - self.read_at > PARAM_HEADERS_REFRESH_SECONDS:
            return None
        return ()

    def read(
        self,
        headers: dict[str, tuple[ParamHeader, ...]],
        task_support: dict[str, legacy_tasks.TaskSupport | None],
        generation: int,
    ) -> None:
        self.headers = headers
        self.task_support = task_support
        self.read_at = time.monotonic()
        self.generation = generation


class SharedBase:
    """Background work and what the upstream said most recently (see the module doc); every tool catalog goes
    stale when any session hears that the tool list changed."""

    metrics: Metrics | None  # set by each kind's shared state

    def __init__(self) -> None:
        self._background = Background("upstream_background_task_failed")
        self.server_info: JSON | None = None
        self.initialize_result: JSON | None = None
        self.initialized_at = 0.0  # monotonic time of that initialize
        self.catalog = ToolCatalog()  # shared by every caller's sessions (the pool decides when it may serve)
        self.tools_generation = 0  # moves on whenever any session hears that the tool list changed
        self.last_answer_at: float | None = None  # monotonic time of the upstream's latest answer
        self.auth = UpstreamAuth()  # a kind whose upstream can ask for credentials replaces it

    @contextlib.contextmanager
    def measured(self, method: str) -> Iterator[None]:
        """One upstream request in the metrics: how long it took, and a failure by its kind."""
        started = time.perf_counter()
        try:
            yield
        except UpstreamError as exc:
            if self.metrics is not None:
                kind = "timeout" if isinstance(exc, UpstreamTimeoutError) else "unavailable"
                if isinstance(exc, UpstreamAuthError):
                    kind = "refused"  # the caller's credential, not the upstream, was the problem
                self.metrics.upstream_errors.labels(method_label(method), kind).inc()
            raise
        finally:
            if self.metrics is not None:
                self.metrics.upstream_request_done(method_label(method), time.perf_counter() - started)

    def initialized(self, result: JSON) -> None:
        self.server_info = implementation(result)
        self.initialize_result = result
        self.initialized_at = time.monotonic()

    def recent_initialize(self, max_age_ms: int) -> JSON | None:
        """The latest InitializeResult, if it is not older than `max_age_ms`."""
        if self.initialize_result is None or (time.monotonic() - self.initialized_at) * 1000 > max_age_ms:
            return None
        return self.initialize_result

    def known_headers(self, tool: str) -> tuple[ParamHeader, ...] | None:
        """The tool's annotations when the shared catalog can answer; None when tools/list must be read."""
        return self.catalog.known_headers(tool, self.tools_generation)

    def catalog_read(
        self, headers: dict[str, tuple[ParamHeader, ...]], task_support: dict[str, legacy_tasks.TaskSupport | None]
    ) -> None:
        """A fresh tools/list, for every session."""
        self.catalog.read(headers, task_support, self.tools_generation)

    def tools_changed(self) -> None:
        self.tools_generation += 1

    def spawn(self, coroutine: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._background.spawn(coroutine, name)

    async def close(self) -> None:
        await self._background.close()
