"""``--otlp-traces-endpoint`` and ``--log-format``: checked with the other
serve settings, turned into a tracer only when tracing is on (the
OpenTelemetry SDK is imported then and never otherwise)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from cluster.observability.logging_setup import LOG_FORMATS
from cluster.observability.tracing.observer import Tracer


def traces_url(endpoint: str) -> str:
    """``endpoint`` as the OTLP/HTTP traces URL: ``http(s)://host:port`` gets
    the standard path ``/v1/traces``; a URL with a path is used as is. Raises
    ``ValueError`` naming ``otlp_traces_endpoint`` when it is not such a URL."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"otlp_traces_endpoint must be an http(s):// URL (OTLP/HTTP), got {endpoint!r}"
        )
    if parts.path in ("", "/"):
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def check_settings(settings: dict[str, Any]) -> None:
    """ValueError naming ``log_format`` or ``otlp_traces_endpoint``."""
    log_format = settings.get("log_format", "text")
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    endpoint = settings.get("otlp_traces_endpoint")
    if endpoint is not None:
        if not isinstance(endpoint, str):
            raise ValueError(f"otlp_traces_endpoint must be a URL string, got {endpoint!r}")
        traces_url(endpoint)


def make_tracer(settings: dict[str, Any]) -> Tracer | None:
    """An ``OtelTracer`` exporting to ``otlp_traces_endpoint``; None when unset."""
    endpoint = settings.get("otlp_traces_endpoint")
    if not endpoint:
        return None
    from cluster.observability.tracing.otel import OtelTracer

    return OtelTracer(traces_url(endpoint))
