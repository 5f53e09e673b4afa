"""Errors of the engine's request endpoints as the gateway reads them, one mapping for both transports (the
per-request HTTP stream's error responses, the streams socket's refusals)."""
from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from services.common.lora_format import AdapterFormatError
from services.common.openai_protocol import error_body, error_of, validation_error_body
from services.common.wire import FAULT_ENGINE, FAULT_HEADER, FAULT_REQUEST, EngineUnavailable, InvalidRequest


def error_parts(exc: Exception) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(HTTP status, headers, OpenAI error body) of a request the engine refused or failed before its first token.
    Every error says whose fault it was (FAULT_HEADER): the gateway retries on another engine only when this engine
    could not serve (EngineUnavailable), never a request that failed on its own. Both transports answer with it."""
    request_fault = {FAULT_HEADER: FAULT_REQUEST}
    if isinstance(exc, InvalidRequest):
        return exc.status, request_fault, error_of(exc)
    if isinstance(exc, RequestValidationError | ValidationError):
        return 400, request_fault, validation_error_body(exc.errors())
    if isinstance(exc, AdapterFormatError):
        return 400, request_fault, error_body(exc.message, "invalid_request_error", exc.field, exc.code)
    if isinstance(exc, EngineUnavailable):
        headers = {FAULT_HEADER: FAULT_ENGINE}
        if exc.retry_after is not None:
            headers["retry-after"] = str(exc.retry_after)
        return exc.status, headers, error_of(exc)
    # Raised while handling this one request (the step loop has its own isolation): its fault.
    return 500, request_fault, error_body(f"the engine failed while handling this request ({type(exc).__name__})",
                                          "server_error", None, "request_failed")
