"""Tracing set-up: which OTEL_* environments turn it on, what it refuses, that every helper is a no-op when it
is off, trace ids in log lines, the log renderer; and the proxy as a process exporting OTLP over HTTP to a
receiver in the test, configured by the environment alone.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy import cli
from proxy.config.schema import LoggingConfig
from proxy.observe import logs, tracing, tracing_setup
from proxy.observe.logs import configure_logging
from tests.support.processes import ProxyProcess, Upstream
from tests.support.wire import modern_body, modern_headers, read_messages


@pytest.fixture(autouse=True)
def tracing_off_after() -> Iterator[None]:
    yield
    tracing_setup.shutdown()


@pytest.mark.parametrize(
    ("environ", "on"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "console"}, True),
    ],
)
def test_tracing_is_on_only_when_an_exporter_is_configured(environ: dict[str, str], on: bool) -> None:
    assert tracing_setup.wanted(environ) is on


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"},
        {"OTEL_TRACES_EXPORTER": "zipkin"},
    ],
)
def test_what_this_build_cannot_export_is_refused(environ: dict[str, str]) -> None:
    with pytest.raises(tracing_setup.TracingConfigError):
        tracing_setup.configure(environ)
    assert not tracing.enabled()


def test_an_unsupported_protocol_stops_the_start_like_a_config_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert cli.main(["serve", "--upstream", "http://127.0.0.1:9/mcp"]) == cli.EXIT_CONFIG_ERROR
    assert "http/protobuf" in capsys.readouterr().err


def test_the_service_is_named_unless_the_environment_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    assert tracing_setup.configure({}, SimpleSpanProcessor(exporter))
    with tracing.client_span("ping", None, transport="tcp"):
        pass
    [span] = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == tracing_setup.DEFAULT_SERVICE_NAME
    tracing_setup.shutdown()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "billing-proxy")
    exporter = InMemorySpanExporter()
    assert tracing_setup.configure({"OTEL_SERVICE_NAME": "billing-proxy"}, SimpleSpanProcessor(exporter))
    with tracing.client_span("ping", None, transport="tcp"):
        pass
    [span] = exporter.get_finished_spans()
    assert span.resource.attributes["service.name"] == "billing-proxy"


async def test_every_helper_passes_through_when_tracing_is_off() -> None:
    assert not tracing.enabled()
    params = {"name": "t", "_meta": {"traceparent": "client"}}
    headers = {"traceparent": "client"}
    with tracing.client_span("tools/call", params, transport="pipe") as traced:
        assert traced.params(params, always=True) is params
        assert traced.headers(headers) is headers
    with tracing.server_span({}, {"method": "tools/call"}, era="modern") as server:
        server.reply({"error": {"code": 1}})

    async def work() -> None:
        return None

    coroutine = work()
    assert tracing.background(coroutine, lambda: None) is coroutine
    assert (
        tracing.linked(coroutine, "x", "task", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01") is coroutine
    )
    await coroutine
    assert tracing.creating_context() is None  # nothing is stored with a task
    tracing.task_read("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    with tracing.resumed("task re-run", "task", None) as nothing:
        assert nothing is None
    assert tracing.add_trace_ids(None, "info", {"event": "x"}) == {"event": "x"}


def test_an_unsampled_request_records_nothing_yet_passes_its_trace_upstream() -> None:
    """Also for a task it creates: the unsampled context is stored with the task, so work resumed after a
    restart stays unsampled (yet passes its trace upstream), and later requests about the task link to nothing
    (the creating span was never recorded)."""
    exporter = InMemorySpanExporter()
    tracing_setup.configure({}, SimpleSpanProcessor(exporter))
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    unsampled = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-00"}  # the client chose not to sample it
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "echo"}}
    with tracing.server_span(unsampled, message, era="modern") as server:
        with tracing.client_span("tools/call", message["params"], transport="tcp") as upstream:
            sent = upstream.headers({"traceparent": "the client's"})
        tracing.task_created("task-1")
        stored = tracing.creating_context()
        server.reply({"error": {"code": -32602}})
    assert sent is not None
    version, sent_trace, _, flags = sent["traceparent"].split("-")
    assert (version, sent_trace, flags) == ("00", trace_id, "00")
    assert exporter.get_finished_spans() == ()
    assert stored is not None
    version, stored_trace, _, flags = stored.split("-")
    assert (version, stored_trace, flags) == ("00", trace_id, "00")

    with (
        tracing.resumed("task re-run", "task-1", stored),
        tracing.client_span("tools/call", message["params"], transport="tcp") as upstream,
    ):
        resent = upstream.headers(None)
    assert resent is not None
    version, resent_trace, _, flags = resent["traceparent"].split("-")
    assert (version, resent_trace, flags) == ("00", trace_id, "00")
    assert exporter.get_finished_spans() == ()

    get = {"jsonrpc": "2.0", "id": 2, "method": "tasks/get", "params": {"taskId": "task-1"}}
    with tracing.server_span({}, get, era="modern"):  # a trace of its own, sampled
        tracing.task_read(stored)
    [read] = exporter.get_finished_spans()
    assert read.name == "tasks/get"
    assert list(read.links) == []


def test_spans_are_exported_in_big_batches_unless_the_environment_sizes_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("OTEL_BSP_MAX_QUEUE_SIZE", raising=False)
    monkeypatch.delenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", raising=False)
    assert tracing_setup.configure({"OTEL_TRACES_EXPORTER": "console"})
    tracing_setup.shutdown()
    processor = tracing_setup._batch_processor(InMemorySpanExporter())
    assert processor._batch_processor._max_queue_size == tracing_setup.MAX_QUEUE_SIZE
    assert processor._batch_processor._max_export_batch_size == tracing_setup.MAX_EXPORT_BATCH_SIZE
    processor.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it unannotated
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64")
    processor = tracing_setup._batch_processor(InMemorySpanExporter())
    assert processor._batch_processor._max_export_batch_size == 64
    processor.shutdown()  # type: ignore[no-untyped-call]  # the SDK leaves it unannotated
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "10")  # smaller than the batch: the SDK refuses it
    with pytest.raises(tracing_setup.TracingConfigError):
        tracing_setup.configure({"OTEL_TRACES_EXPORTER": "console"})


def test_log_lines_carry_the_active_spans_ids() -> None:
    exporter = InMemorySpanExporter()
    tracing_setup.configure({}, SimpleSpanProcessor(exporter))
    assert tracing.add_trace_ids(None, "info", {"event": "outside"}) == {"event": "outside"}
    with tracing.client_span("ping", None, transport="tcp"):
        fields = dict(tracing.add_trace_ids(None, "info", {"event": "inside"}))
    [span] = exporter.get_finished_spans()
    assert span.context is not None
    assert fields["trace_id"] == format(span.context.trace_id, "032x")
    assert fields["span_id"] == format(span.context.span_id, "016x")


@pytest.fixture
def restore_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    saved = structlog.get_config()
    monkeypatch.setattr(logs, "_min_level", logs._min_level)  # what configure_logging sets
    yield
    structlog.configure(**saved)


@pytest.mark.usefixtures("restore_logging")
@pytest.mark.parametrize(
    ("format_", "renderer"),
    [
        ("auto", structlog.processors.JSONRenderer),
        ("json", structlog.processors.JSONRenderer),
        ("console", structlog.dev.ConsoleRenderer),
    ],
)
def test_logs_are_json_unless_a_person_reads_them(format_: str, renderer: type) -> None:
    """Under pytest stderr is no terminal: `auto` renders JSON, as it does in a container."""
    configure_logging(LoggingConfig.model_validate({"format": format_}))
    processors = structlog.get_config()["processors"]
    assert isinstance(processors[-1], renderer)
    assert tracing.add_trace_ids in processors


# --- the proxy as a process, exporting to an OTLP receiver -----------------------------------------------------


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, list[ExportTraceServiceRequest]]]:
    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    yield str(server.make_url("")).rstrip("/"), received
    await server.close()


async def test_the_proxy_exports_spans_when_the_environment_says_where(
    receiver: tuple[str, list[ExportTraceServiceRequest]],
    upstream: Upstream,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    endpoint, received = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "exported-proxy")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    process = ProxyProcess(tmp_path, upstream.url)
    await process.start()
    try:
        async with aiohttp.ClientSession() as http:
            body = modern_body("tools/call", {"name": "echo", "arguments": {"text": "hi"}})
            async with http.post(process.url, json=body, headers=modern_headers("tools/call", "echo")) as response:
                [message] = await read_messages(response)
        assert message["result"]["content"][0]["text"] == "hi"
        assert await process.terminate() == 0  # SIGTERM: what is still buffered is exported before the exit
    finally:
        process.stop()
    spans: dict[str, Any] = {}
    for request in received:
        for resource_spans in request.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}["service.name"]
            assert service == "exported-proxy"
            for scope in resource_spans.scope_spans:
                for span in scope.spans:
                    spans.setdefault(span.name, []).append(span)
    assert {span.kind for span in spans.get("tools/call echo", [])} == {
        Span.SpanKind.SPAN_KIND_SERVER,
        Span.SpanKind.SPAN_KIND_CLIENT,
    }, sorted(spans)
    trace_ids = {span.trace_id.hex() for named in spans.values() for span in named}
    logged = {event.get("trace_id") for event in process.events()} - {None}
    assert logged, "no log line carried a trace id"
    assert logged <= trace_ids
