"""Structured JSON logs: one object per line, with the request ids of the work being logged.

`request_context(request_id=..., client_request_id=...)` binds ids for everything logged inside it
(a contextvar, so concurrent requests on one event loop never mix); `extra={...}` adds fields to one
record. API keys are redacted from every message.
"""
from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

from services.common.keys import redact_keys

_context: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("mplex_log_context", default={})
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime", "taskName"}
# FastAPI's own OpenTelemetry instrumentation, off in both services: our metrics are Prometheus and our logs these
# JSON lines. Left on, FastAPI asked the OpenTelemetry API on every request whether a provider had been configured
# (~9 us a request, before any route ran). Passed as `FastAPI(telemetry=...)`.
FASTAPI_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}


@contextlib.contextmanager
def request_context(**fields: Any) -> Iterator[None]:
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def bind(**fields: Any) -> None:
    """Add fields to the current context (for the rest of this task)."""
    _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": redact_keys(record.getMessage()),
        }
        doc.update(_context.get())
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                doc[key] = value
        if record.exc_info:
            doc["exc"] = redact_keys(self.formatException(record.exc_info))
        return json.dumps(doc, default=str, ensure_ascii=False)


def configure(service: str, level: str = "info") -> dict:
    """Send every logger (uvicorn's included) through the JSON formatter on stderr. Returns a
    uvicorn `log_config` doing the same, so uvicorn does not install its own text handlers."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter, "service": service}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}},
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": ["default"], "level": level.upper(), "propagate": False},
        },
    }
