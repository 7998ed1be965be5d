"""``--otlp-traces-endpoint`` and ``--log-format``: the observability section
of the serve configuration, turned into a tracer only when tracing is on (the
OpenTelemetry SDK is imported then and never otherwise)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from tandem.cluster.observability.logging_setup import LOG_FORMATS
from tandem.wire.config_fields import option

if TYPE_CHECKING:  # the serve configuration imports this without the metrics stack
    from tandem.cluster.observability.tracing.observer import Tracer


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


@dataclass(frozen=True)
class ObservabilityConfig:
    """Logs and traces (ValueError naming ``log_format`` or ``otlp_traces_endpoint``)."""

    log_format: str = option(
        "text",
        choices=LOG_FORMATS,
        help="gateway and engine logs: text or one JSON object a line",
    )
    otlp_traces_endpoint: str | None = option(
        None,
        default_text="off",
        help="export one OpenTelemetry trace per request over OTLP/HTTP to this URL "
        "(http://collector:4318 gets /v1/traces)",
    )

    def __post_init__(self) -> None:
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"log_format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None:
            if not isinstance(endpoint, str):
                raise ValueError(f"otlp_traces_endpoint must be a URL string, got {endpoint!r}")
            traces_url(endpoint)


def make_tracer(config: ObservabilityConfig) -> Tracer | None:
    """An ``OtelTracer`` exporting to ``otlp_traces_endpoint``; None when unset."""
    endpoint = config.otlp_traces_endpoint
    if not endpoint:
        return None
    from tandem.cluster.observability.tracing.otel import OtelTracer

    return OtelTracer(traces_url(endpoint))
