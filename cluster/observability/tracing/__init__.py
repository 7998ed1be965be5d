"""Where one request's time went: per-request records built in the gateway
from the engines' ``RequestTimings`` (record.py), the histograms they feed
(phase_metrics.py), the finished-request log line, and OpenTelemetry spans
when ``--otlp-traces-endpoint`` is set (otel.py, imported only then)."""
