"""OpenTelemetry tracing after the MCP semantic conventions: SERVER and CLIENT spans, a call's background work,
events; and the trace context in and out. A no-op until `tracing_setup` installs a tracer. Never records
arguments, results, answers, header values or credentials. Imports the OpenTelemetry API only, not the SDK."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, MutableMapping
from typing import Any, Final, TypeVar

import structlog
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from proxy.errors import ProxyError
from proxy.observe.span_attributes import (
    NO_REQUEST,
    TASK_ID,
    RequestTarget,
    client_request,
    reply_error_type,
    server_request,
    text,
)
from proxy.wire.trace_context import TRACE_KEYS, parsed

# Also the trace context in and out: a client's (headers, `_meta`), the current one into what goes upstream, and the
# W3C traceparent a task record keeps. Never recorded: argument values, results, question or answer content, header
# values, credentials. Imports the OpenTelemetry API (not the SDK), `errors`, the wire's trace-context parser and
# `span_attributes` (what a span says); nothing of aiohttp, the front, the tasks or the upstream.

_T = TypeVar("_T")

_tracer: trace.Tracer | None = None  # None: tracing is off
# The task id of the call whose background work runs in this context (read when its CLIENT spans end).
_work_task: contextvars.ContextVar[Callable[[], str | None]] = contextvars.ContextVar("mcp_background_task")
# What the current request is about, for spans below it that only see bytes (the legacy pass-through).
_request_target: contextvars.ContextVar[RequestTarget] = contextvars.ContextVar("mcp_request_target")


# --- trace context in and out: a client's (headers, `_meta`), the current one (into what goes upstream), a
# span context as the W3C traceparent a task record keeps and back --------------------------------------------

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


# --- spans ---------------------------------------------------------------------------------------------------


def install(tracer: trace.Tracer | None) -> None:
    """Turn tracing on with `tracer` (`tracing_setup` builds it from the OTEL_* environment), or off with None."""
    global _tracer
    _tracer = tracer


def enabled() -> bool:
    return _tracer is not None


# --- reading requests ----------------------------------------------------------------------------------------


class ServerSpan:
    """The request's SERVER span, for what is learnt while it runs (the answer's outcome)."""

    __slots__ = ("span",)

    def __init__(self, span: Span | None) -> None:
        self.span = span

    def reply(self, message: Mapping[str, Any]) -> None:
        """The answer's JSON-RPC error code, or `tool_error` for a CallToolResult with isError."""
        if self.span is not None and (error_type := reply_error_type(message)) is not None:
            _failed(self.span, error_type)

    def status(self, http_status: int) -> None:
        """A relayed answer's HTTP status (its body is not read): 5xx fails the span."""
        if self.span is not None and http_status >= 500:
            _failed(self.span, str(http_status))


_OFF: Final = ServerSpan(None)
_SERVER_OFF: Final = contextlib.nullcontext(_OFF)  # reusable: tracing off allocates nothing per request


def reply_outcome(message: Mapping[str, Any]) -> None:
    """The outcome of the answer about to leave, on the current (SERVER) span."""
    if _tracer is not None and (span := trace.get_current_span()).is_recording():
        ServerSpan(span).reply(message)


def _failed(span: Span, error_type: str) -> None:
    """The span failed with `error_type`. No description: an error message may quote what the client sent."""
    span.set_attribute("error.type", error_type)
    if error_type.lstrip("-").isdigit():
        span.set_attribute("rpc.response.status_code", error_type)
    span.set_status(Status(StatusCode.ERROR))


def server_span(
    headers: Mapping[str, str],
    message: object,
    *,
    era: str,
    http_method: str = "POST",
    peer: str | None = None,
    start_time: int | None = None,
) -> contextlib.AbstractContextManager[ServerSpan]:
    """The SERVER span of one request (`message` None: no JSON-RPC message was read, the span is named after
    `http_method`), from `start_time` (epoch ns) if given. Its parent is the client's trace context from
    `params._meta` when there is one there (the MCP conventions' carrier), else from the HTTP headers; when
    both are present and differ, the HTTP one becomes a link. `tasks/*` spans carry the task id (`task_read`
    links them to the span that created the task)."""
    if _tracer is None:
        return _SERVER_OFF
    return _server_span(_tracer, headers, message, era, http_method, peer, start_time)


@contextlib.contextmanager
def _server_span(
    tracer: trace.Tracer,
    headers: Mapping[str, str],
    message: object,
    era: str,
    http_method: str,
    peer: str | None,
    start_time: int | None,
) -> Iterator[ServerSpan]:
    decoded: Mapping[str, Any] = message if isinstance(message, dict) else {}
    method = text(decoded.get("method"))
    raw_params = decoded.get("params")
    params: Mapping[str, Any] = raw_params if isinstance(raw_params, dict) else {}
    raw_meta = params.get("_meta")
    meta: Mapping[str, Any] = raw_meta if isinstance(raw_meta, dict) else {}
    from_headers = carried(headers)
    from_meta = carried(meta)
    # Started bare: an unsampled span costs the sampler's decision and the context it carries onwards, nothing
    # more. Its name, attributes and links are worked out only when it records.
    span = tracer.start_span(
        method or http_method,
        context=from_meta or from_headers,
        kind=SpanKind.SERVER,
        start_time=start_time,
        record_exception=False,
        set_status_on_exception=False,
    )
    token = None
    if span.is_recording():
        request = server_request(headers, decoded, method, params, meta, era=era, http_method=http_method, peer=peer)
        if request.target:
            span.update_name(request.name)
        span.set_attributes(request.attributes)
        # The request's own log line (written by the error edge, after this span) names it too.
        context = span.get_span_context()
        structlog.contextvars.bind_contextvars(
            trace_id=format(context.trace_id, "032x"), span_id=format(context.span_id, "016x")
        )
        if era != "modern":  # only a relayed request's CLIENT span (legacy, or another path) copies what it knows
            token = _request_target.set(request.copied())
        if from_meta is not None and from_headers is not None:
            other = trace.get_current_span(from_headers).get_span_context()
            if other != trace.get_current_span(from_meta).get_span_context():
                span.add_link(other, {"mcp.link": "http_trace_context"})
    try:
        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            try:
                yield ServerSpan(span)
            except ProxyError as error:
                _failed(span, str(error.code))
                raise
            except (asyncio.CancelledError, ConnectionResetError):
                span.add_event("client_disconnected")  # the client left (or closed its stream): no failure
                raise
            except BaseException as error:
                _failed(span, type(error).__qualname__)
                raise
    finally:
        if token is not None:
            _request_target.reset(token)


# --- upstream requests ---------------------------------------------------------------------------------------


class ClientSpan:
    """The CLIENT span of one upstream request: what the upstream receives as trace context."""

    __slots__ = ("span",)

    def __init__(self, span: Span | None) -> None:
        self.span = span

    def headers(self, extra: Mapping[str, str] | None) -> Mapping[str, str] | None:
        """HTTP headers for the request: this span's context replaces the client's. Off: `extra` as it is."""
        if self.span is None:
            return extra
        return headers_with_current(extra)

    def params(self, params: Any, *, always: bool) -> Any:
        """Params with this span's context in `_meta` (always for stdio; over HTTP only where the client had put
        its own, so the upstream never sees two parents). Off: `params` as they are."""
        if self.span is None or not isinstance(params, dict):
            return params
        return params_with_current(params, always=always)

    def request(self, request_id: int | str, session_id: str | None = None) -> None:
        if self.span is not None:
            self.span.set_attribute("jsonrpc.request.id", str(request_id))
            if session_id:
                self.span.set_attribute("mcp.session.id", session_id)


_CLIENT_OFF: Final = contextlib.nullcontext(ClientSpan(None))


def client_span(
    method: str | None, params: Any, *, transport: str, protocol_version: str | None = None
) -> contextlib.AbstractContextManager[ClientSpan]:
    """The CLIENT span of one upstream request (`transport`: `tcp` for HTTP, `pipe` for stdio). `method` None:
    the request the current SERVER span relays (the legacy pass-through)."""
    if _tracer is None:
        return _CLIENT_OFF
    current = trace.get_current_span()
    context = current.get_span_context()
    if context.is_valid and not context.trace_flags.sampled and not current.is_recording():
        # Below an unsampled span no sampler the OTEL_* environment can name records a child: the upstream gets
        # the unsampled context as it is, with no span started for it. (A sampled span that has ended, the
        # request that created a task, still parents the upstream requests of the task's work.)
        return contextlib.nullcontext(ClientSpan(current))
    return _client_span(_tracer, method, params, transport, protocol_version)


@contextlib.contextmanager
def _client_span(
    tracer: trace.Tracer, method: str | None, params: Any, transport: str, protocol_version: str | None
) -> Iterator[ClientSpan]:
    span = tracer.start_span(
        method or "POST", kind=SpanKind.CLIENT, record_exception=False, set_status_on_exception=False
    )
    recording = span.is_recording()
    if recording:  # an unsampled span: its context goes upstream, nothing is worked out for it
        request = NO_REQUEST if method is not None else _request_target.get(NO_REQUEST)
        name, attributes = client_request(method, params, transport, protocol_version, request)
        if name is not None:
            span.update_name(name)
        span.set_attributes(attributes)
    with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        try:
            yield ClientSpan(span)
        except BaseException as error:
            _failed(span, type(error).__qualname__)
            raise
        finally:
            if recording and (task_id := _work_task.get(None)) is not None and (known := task_id()) is not None:
                span.set_attribute(TASK_ID, known)


def relayed(
    carrier: MutableMapping[str, str], send: Callable[..., Awaitable[_T]], /, *args: Any, **kwargs: Any
) -> Awaitable[_T]:
    """`send(*args, **kwargs)`, a relayed legacy request whose headers are `carrier`, in a CLIENT span named after
    the current SERVER span's request; the span's context replaces the client's trace headers in `carrier`."""
    if _tracer is None:
        return send(*args, **kwargs)
    return _relayed(carrier, send, args, kwargs)


async def _relayed(carrier: MutableMapping[str, str], send: Callable[..., Awaitable[_T]], args: Any, kwargs: Any) -> _T:
    with client_span(None, None, transport="tcp"):
        replace_with_current(carrier)
        return await send(*args, **kwargs)


# --- a call's background work, tasks, events -------------------------------------------------------------------


def background(work: Coroutine[Any, Any, None], task_id: Callable[[], str | None]) -> Coroutine[Any, Any, None]:
    """`work`, a call's upstream request run in the background. Its CLIENT span stays in the trace of the request
    that started it (the background task starts with that request's context), may outlive that request, and
    carries the task id once there is one. No span of its own: one span per hop keeps tracing cheap."""
    if _tracer is None:
        return work
    return _background(work, task_id)


async def _background(work: Coroutine[Any, Any, None], task_id: Callable[[], str | None]) -> None:
    _work_task.set(task_id)  # in the background task's own context: nothing to reset
    await work


def task_created(task_id: str) -> None:
    """The current span created the task: it carries the id (and a `task_created` event)."""
    if _tracer is None:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(TASK_ID, task_id)
        span.add_event("task_created", {TASK_ID: task_id})


def creating_context() -> str | None:
    """The current span's context as a W3C traceparent, stored with the task it creates (whatever
    OTEL_PROPAGATORS says): later spans about the task link to it, on any replica and after a restart, and work
    resumed after a restart goes on in its trace. Unsampled too, so that resumed work stays unsampled."""
    if _tracer is None:
        return None
    context = trace.get_current_span().get_span_context()
    return traceparent_of(context) if context.is_valid else None


def _link_created(span: Span, traceparent: str | None) -> None:
    """A link from `span` to the span that created the task, when that one was sampled (recorded)."""
    created = span_context_of(traceparent)
    if created is not None and created.trace_flags.sampled:
        span.add_link(created, {"mcp.link": "task_created"})


def task_read(traceparent: str | None) -> None:
    """The current request (tasks/get, tasks/update, tasks/cancel) read the record of a task created under
    `traceparent`: its span links to the creating span."""
    if _tracer is None:
        return
    span = trace.get_current_span()
    if span.is_recording():
        _link_created(span, traceparent)


def event(name: str, attributes: Mapping[str, str | int | bool]) -> None:
    """A fact on the current span (a question asked, an answer delivered, an MRTR round, a push): names and
    counts only, never content."""
    if _tracer is None:
        return
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, attributes)


def linked(
    work: Coroutine[Any, Any, None], name: str, task_id: str, traceparent: str | None
) -> Coroutine[Any, Any, None]:
    """`work` done here for a task on another's behalf (a cancel or an answer that reached the task's owner
    through the store, from another replica) inside an INTERNAL span of its own trace, linked to the span that
    created the task (`traceparent`, as stored with it)."""
    if _tracer is None:
        return work
    return _linked(_tracer, work, name, task_id, traceparent)


async def _linked(
    tracer: trace.Tracer, work: Coroutine[Any, Any, None], name: str, task_id: str, traceparent: str | None
) -> None:
    span = tracer.start_span(name, context=Context(), kind=SpanKind.INTERNAL)
    if span.is_recording():
        span.set_attribute(TASK_ID, task_id)
        _link_created(span, traceparent)
    with _current(span):
        await work


def resumed(name: str, task_id: str, traceparent: str | None) -> contextlib.AbstractContextManager[None]:
    """While the work of a task a previous process or a dead replica left is started again here: an INTERNAL
    span `name`, child of the span that created the task (`traceparent`, as stored), so that the task goes on
    in its creating trace and the upstream CLIENT spans of the resumed work are its children. A task stored
    without a context (created with tracing off) starts a trace of its own."""
    if _tracer is None:
        return contextlib.nullcontext()
    return _resumed(_tracer, name, task_id, traceparent)


@contextlib.contextmanager
def _resumed(tracer: trace.Tracer, name: str, task_id: str, traceparent: str | None) -> Iterator[None]:
    created = span_context_of(traceparent)
    parent = Context() if created is None else trace.set_span_in_context(trace.NonRecordingSpan(created), Context())
    span = tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL)
    if span.is_recording():
        span.set_attribute(TASK_ID, task_id)
    with _current(span):
        yield


@contextlib.contextmanager
def _current(span: Span) -> Iterator[None]:
    """`span` current until it ends; a failure names its exception class only (a message may quote content)."""
    with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        try:
            yield
        except asyncio.CancelledError:
            raise  # stopped (a shutdown, a lease lost): no failure of its own
        except BaseException as error:
            _failed(span, type(error).__qualname__)
            raise


# --- logs -------------------------------------------------------------------------------------------------


def add_trace_ids(logger: Any, method_name: str, event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """structlog processor: `trace_id` and `span_id` of the active span, when tracing is on and one is."""
    if _tracer is None:
        return event_dict
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict["trace_id"] = format(context.trace_id, "032x")
        event_dict["span_id"] = format(context.span_id, "016x")
    return event_dict
