"""Log format for the gateway and the engine actors (``--log-format``).

    text   2026-11-23 15:30:01,123 INFO cluster.gateway.app [cmpl-3f2a...] message
    json   {"ts": "...", "level": "INFO", "logger": "...", "request_id": "...", "message": "..."}

Every record gets a ``request_id`` from ``REQUEST_ID`` (a contextvar the
gateway sets when it names a request; asyncio tasks copy it, so everything
logged while serving that request carries it) unless the call passed one in
``extra``. The finished-request line (``tandem.request``) adds its phase
timings as ``extra={"fields": {...}}``, which the JSON format writes as
top-level keys and the text format appends as ``key=value``.

The engine actors call ``configure_logging`` with the same format (it
travels in ``EngineConfig.runtime.log_format``), so Ray's forwarded actor logs read
like the gateway's.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

LOG_FORMATS = ("text", "json")

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "tandem_request_id", default=None
)

_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s %(message)s%(field_text)s"


class RequestIdFilter(logging.Filter):
    """Adds ``request_id`` (contextvar unless given), ``request_tag`` and
    ``field_text`` (for the text format) to every record it sees."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        rid = record.request_id
        record.request_tag = f" [{rid}]" if rid else ""
        fields = getattr(record, "fields", None)
        # a list, not a generator: join makes one anyway (the finished-request line's fields
        # are formatted once per request on the event loop)
        record.field_text = (
            "".join([f" {k}={_text_value(v)}" for k, v in fields.items()]) if fields else ""
        )
        return True


def _text_value(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.6f}".rstrip("0").rstrip(".") if value else "0"
    return str(value)


class TextFormatter(logging.Formatter):
    """``logging.Formatter`` whose timestamp text is made once per second: the same
    text, without a ``localtime`` and ``strftime`` per line (one line per request)."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second: int | None = None
        self._second_text = ""

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        if second != self._second:
            self._second_text = time.strftime(self.default_time_format, self.converter(second))
            self._second = second
        return self.default_msec_format % (self._second_text, record.msecs)


class JsonFormatter(logging.Formatter):
    """One JSON object per line; ``fields`` (extra) become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid:
            entry["request_id"] = rid
        fields = getattr(record, "fields", None)
        if fields:
            for key, value in fields.items():
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def make_handler(log_format: str, stream=None) -> logging.Handler:
    """A stream handler (stderr by default) in ``log_format``. Raises
    ``ValueError`` naming ``log_format`` for anything but text or json."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestIdFilter())
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter(_TEXT_FORMAT))
    return handler


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> None:
    """Replace the root logger's handlers with one in ``log_format``."""
    handler = make_handler(log_format)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
