"""Trace context in and out of the proxy: the context a client's request carries (HTTP headers,
`params._meta`), the current context written into what goes upstream (headers, `_meta`, a relayed request's
headers), a span context as the W3C traceparent a task record keeps and back.
No span is started here and nothing is kept (what a span says is `span_attributes`). Imports the
OpenTelemetry API and the wire's trace-context parser only; `tracing` builds the spans with these.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any, Final

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.wire.trace_context import TRACE_KEYS, parsed

_W3C: Final = TraceContextTextMapPropagator()  # a stored context is W3C, whatever OTEL_PROPAGATORS says


def carried(carrier: Mapping[str, Any]) -> Context | None:
    """The trace context a carrier (HTTP headers or `_meta`) holds, if a valid one: read from what the wire's
    parser kept (W3C Trace Context, W3C Baggage), the same rules as with tracing off."""
    if carrier.get("traceparent") is None:
        return None
    found = propagate.extract(carrier=parsed(carrier))
    return found if trace.get_current_span(found).get_span_context().is_valid else None


def headers_with_current(extra: Mapping[str, str] | None) -> dict[str, str]:
    """`extra` with the current context in place of the trace keys they had."""
    headers = {key: value for key, value in (extra or {}).items() if key.lower() not in TRACE_KEYS}
    propagate.inject(headers)
    return headers


def params_with_current(params: dict[str, Any], *, always: bool) -> dict[str, Any]:
    """`params` with the current context in `_meta` in place of the trace keys it had; unless `always`, only
    where it had some (so that an upstream reached over HTTP never sees two parents)."""
    meta = params.get("_meta")
    if not always and not (isinstance(meta, dict) and any(key in meta for key in TRACE_KEYS)):
        return params
    carrier = {key: value for key, value in (meta or {}).items() if key not in TRACE_KEYS}
    propagate.inject(carrier)
    return {**params, "_meta": carrier}


def replace_with_current(carrier: MutableMapping[str, str]) -> None:
    """The current context in place of every trace key `carrier` (a relayed request's headers) had."""
    for key in TRACE_KEYS:
        if key in carrier:
            del carrier[key]  # every value of it, on a multidict
    propagate.inject(carrier)


def traceparent_of(context: SpanContext) -> str:
    """`context` as a W3C traceparent (what a task record keeps of the span that created it)."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def span_context_of(traceparent: str | None) -> SpanContext | None:
    """The span context a stored W3C traceparent names, if a valid one."""
    if not traceparent:
        return None
    context = trace.get_current_span(_W3C.extract({"traceparent": traceparent})).get_span_context()
    return context if context.is_valid else None
