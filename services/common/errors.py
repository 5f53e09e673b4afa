"""Typed API errors: each maps to one HTTP status and OpenAI's error body
`{"error": {"message", "type", "param", "code"}}`. The gateway and the engine raise these at their boundaries.
"""
from __future__ import annotations

from typing import Any, ClassVar

from services.common.wire import InvalidRequest


class ApiError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = dict(headers or {})
        self.background = None  # a Starlette BackgroundTask the handler runs after sending the error

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.status}, {self.code!r}, {self.message!r})"

    @staticmethod
    def from_invalid_request(exc: InvalidRequest) -> ApiError:
        """The engine's request validation error (services.common.wire) as an API error."""
        if exc.status >= 500:  # failed (not refused) on its own account: a server error, never retried
            return InternalServerError(exc.message, param=exc.param, code=exc.code)
        cls = {400: InvalidRequestError, 404: NotFoundError, 409: ConflictError, 413: PayloadTooLargeError,
               431: HeadersTooLargeError}.get(exc.status, InvalidRequestError)
        return cls(exc.message, param=exc.param, code=exc.code)


class InvalidRequestError(ApiError):
    status = 400
    type = "invalid_request_error"


class AuthenticationError(ApiError):
    status = 401
    type = "authentication_error"
    default_code = "invalid_api_key"


class PermissionDeniedError(ApiError):
    status = 403
    type = "permission_error"
    default_code = "permission_denied"


class NotFoundError(ApiError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    """Unknown model, or another tenant's adapter: the two must be indistinguishable."""

    default_code = "model_not_found"

    def __init__(self, model: str, **kwargs: Any):
        super().__init__(f"The model `{model}` does not exist or you do not have access to it.", param="model", **kwargs)


class ConflictError(ApiError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLargeError(ApiError):
    status = 413
    type = "invalid_request_error"
    default_code = "payload_too_large"


class HeadersTooLargeError(ApiError):
    status = 431
    type = "invalid_request_error"
    default_code = "request_headers_too_large"


class RateLimitError(ApiError):
    """A per-minute or concurrency window is full; `headers` carry Retry-After and x-ratelimit-*."""

    status = 429
    type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class InsufficientQuotaError(ApiError):
    """The monthly token budget is spent; retrying soon will not help (unlike RateLimitError)."""

    status = 429
    type = "insufficient_quota"
    default_code = "insufficient_quota"


class InternalServerError(ApiError):
    status = 500
    type = "server_error"
    default_code = "internal_error"


class BadGatewayError(ApiError):
    """The engine holding the request failed before finishing it; it is not retried (it may be the cause)."""

    status = 502
    type = "server_error"
    default_code = "engine_failed"


class ServiceUnavailableError(ApiError):
    """A dependency we cannot serve without is down (quota store, every engine); the message says which."""

    status = 503
    type = "service_unavailable"
    default_code = "service_unavailable"

