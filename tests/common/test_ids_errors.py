"""Identifiers and the OpenAI-shaped API errors."""
import time
import uuid

import pytest

from services.common import errors
from services.common.ids import base62_decode, base62_encode, new_request_id, random_base62, uuid7
from services.common.wire import InvalidRequest


def test_uuid7_layout():
    before = int(time.time() * 1000)
    u = uuid7()
    after = int(time.time() * 1000)
    assert u.version == 7 and u.variant == uuid.RFC_4122
    assert before <= u.int >> 80 <= after


def test_uuid7_sorts_by_creation_across_milliseconds():
    ids = []
    for _ in range(5):
        ids.append(uuid7())
        t = time.time()
        while time.time() - t < 0.002:  # let the millisecond clock move
            pass
    assert ids == sorted(ids)
    assert len({uuid7() for _ in range(10000)}) == 10000


def test_base62_round_trip_and_bounds():
    for value in (0, 1, 61, 62, 2**32 - 1):
        assert base62_decode(base62_encode(value, 6)) == value
    with pytest.raises(ValueError):
        base62_encode(62**2, 2)
    assert len(random_base62(40)) == 40


def test_request_ids_are_unique_and_prefixed():
    ids = {new_request_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("req_") and len(i) == 36 for i in ids)


@pytest.mark.parametrize(
    ("exc", "status", "type_", "code"),
    [
        (errors.InvalidRequestError("bad", param="max_tokens"), 400, "invalid_request_error", None),
        (errors.AuthenticationError("no key"), 401, "authentication_error", "invalid_api_key"),
        (errors.PermissionDeniedError("admins only"), 403, "permission_error", "permission_denied"),
        (errors.NotFoundError("no such key"), 404, "invalid_request_error", "not_found"),
        (errors.ModelNotFoundError("acme-lora"), 404, "invalid_request_error", "model_not_found"),
        (errors.ConflictError("exists"), 409, "invalid_request_error", "conflict"),
        (errors.PayloadTooLargeError("too big"), 413, "invalid_request_error", "payload_too_large"),
        (errors.RateLimitError("slow down", headers={"Retry-After": "3"}), 429, "rate_limit_error", "rate_limit_exceeded"),
        (errors.InsufficientQuotaError("budget spent"), 429, "insufficient_quota", "insufficient_quota"),
        (errors.ServiceUnavailableError("quota store down", code="quota_unavailable"), 503, "service_unavailable", "quota_unavailable"),
    ],
)
def test_errors_map_to_status_and_openai_body(exc, status, type_, code):
    body = exc.body()
    assert exc.status == status
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == type_ and body["error"]["code"] == code
    assert isinstance(exc, errors.ApiError)


def test_model_not_found_does_not_say_whose_model_it_is():
    body = errors.ModelNotFoundError("other-tenants-adapter").body()["error"]
    assert body["param"] == "model"
    assert body["message"] == "The model `other-tenants-adapter` does not exist or you do not have access to it."


def test_engine_validation_errors_convert():
    err = errors.ApiError.from_invalid_request(InvalidRequest("top_p must be in (0, 1]", "top_p"))
    assert isinstance(err, errors.InvalidRequestError) and err.param == "top_p" and err.status == 400
    assert errors.RateLimitError("x", headers={"Retry-After": "2"}).headers == {"Retry-After": "2"}
