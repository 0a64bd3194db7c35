"""The upstream request one client request becomes, built once by the front for both of its paths (the
synchronous `forward` and a call of the runner): the method, the tool or prompt name (the URI for
`resources/read`), the legacy params, the trace headers, and the digest an MRTR retry must match. Pure;
imports the wire's translation and the input rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from proxy.tasks import inputs
from proxy.wire import translate
from proxy.wire.envelope import Caller, ModernRequest
from proxy.wire.jsonrpc import JSON


@dataclass(frozen=True)
class UpstreamRequest:
    request: ModernRequest = field(repr=False)
    method: str
    name: str
    params: JSON
    headers: dict[str, str]

    @classmethod
    def of(cls, request: ModernRequest, caller: Caller) -> UpstreamRequest:
        name = request.params.get("uri") if request.method == "resources/read" else request.params.get("name")
        return cls(
            request,
            request.method,
            str(name),
            translate.upstream_params(request.params),
            translate.trace_headers(request.meta, caller.headers),
        )

    @cached_property
    def digest(self) -> str:
        """Of the client's params: a requestState is bound to the request it was issued for."""
        return inputs.params_digest(self.request.params)
