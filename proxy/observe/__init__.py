"""What the proxy tells about itself: logs and Prometheus metrics, OpenTelemetry tracing, the audit log. Imported by
every layer above the wire; imports nothing of the upstream, the tasks or the edge."""
