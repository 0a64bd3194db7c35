"""OpenTelemetry set-up from the OTEL_* environment: the SDK's provider, batch processor and exporter, installed
into `tracing`, and its shutdown. The one module that imports the SDK; imports `tracing` only."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from proxy.observe import tracing

DEFAULT_SERVICE_NAME: Final = "mcp-tasks-proxy"

# Batching when OTEL_BSP_* leave it unsaid: the SDK's queue (2048 spans) fills within a second at a thousand
# calls a second (two spans each) and then drops spans; bigger batches mean fewer export requests.
MAX_QUEUE_SIZE: Final = 16_384
MAX_EXPORT_BATCH_SIZE: Final = 2048

_provider: TracerProvider | None = None


class TracingConfigError(Exception):
    """The OTEL_* environment asks for something this build cannot do."""


def wanted(environ: Mapping[str, str]) -> bool:
    """Tracing is on when an OTLP endpoint or a traces exporter is configured, and the SDK is not disabled."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def _exporter(environ: Mapping[str, str]) -> SpanExporter:
    name = environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={name}: only otlp, console and none are supported")
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip()
    if protocol not in ("", "http/protobuf"):
        raise TracingConfigError(
            f"OTLP protocol {protocol!r} is not supported: this build exports http/protobuf only "
            "(set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf and the collector's HTTP port, usually 4318)"
        )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # endpoint, headers, timeout, compression: from OTEL_EXPORTER_OTLP_*


def _batch_processor(exporter: SpanExporter) -> BatchSpanProcessor:
    environ = os.environ  # where the SDK reads OTEL_BSP_* from
    if environ.get("OTEL_BSP_MAX_QUEUE_SIZE") or environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE"):
        try:
            return BatchSpanProcessor(exporter)  # the operator's sizes, read by the SDK
        except ValueError as error:  # e.g. a batch bigger than the queue
            raise TracingConfigError(f"OTEL_BSP_*: {error}") from error
    return BatchSpanProcessor(exporter, max_queue_size=MAX_QUEUE_SIZE, max_export_batch_size=MAX_EXPORT_BATCH_SIZE)


def configure(environ: Mapping[str, str] | None = None, processor: SpanProcessor | None = None) -> bool:
    """Turn tracing on as the OTEL_* environment says (service name, resource attributes, sampler, batch
    processor and exporter settings are the SDK's own), or with `processor` (tests). Returns whether it is on."""
    global _provider
    environ = os.environ if environ is None else environ
    if processor is None:
        if not wanted(environ):
            return False
        processor = _batch_processor(_exporter(environ))
    attributes: dict[str, str] = {}
    if not environ.get("OTEL_SERVICE_NAME") and "service.name=" not in environ.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        attributes[SERVICE_NAME] = DEFAULT_SERVICE_NAME
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(processor)
    tracing.install(_provider.get_tracer("mcp_tasks_proxy"))
    return True


def shutdown() -> None:
    """Export what is still buffered, then turn tracing off."""
    global _provider
    if _provider is not None:
        _provider.shutdown()
    _provider = None
    tracing.install(None)
