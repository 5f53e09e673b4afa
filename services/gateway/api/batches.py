"""The Batch API, as OpenAI's: `/v1/files` (purpose `batch`) and `/v1/batches`. API keys with the inference
scope; everything is the key's own tenant. The batch runs on the Celery `batches` queue (services.batch)."""
from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import datetime, timezone
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from python_multipart.multipart import MultipartParser, parse_options_header

from services.adapters.storage import ObjectStore
from services.common.batch_contract import (
    COMPLETION_WINDOWS,
    ENDPOINTS,
    FILE_PURPOSE,
    LIST_LIMIT_MAX,
    MAX_FILE_BYTES,
    MAX_LINE_ERRORS,
    QUEUE,
    TASK_RUN,
    TERMINAL,
    BatchStatus,
    LineError,
)
from services.common.errors import ConflictError, InsufficientQuotaError, InvalidRequestError, PayloadTooLargeError, PermissionDeniedError
from services.common.keys import SCOPE_INFERENCE
from services.gateway import batch_files as records
from services.gateway.batch_input import check_file, split_lines
from services.gateway.deps import GatewayDep

log = logging.getLogger("mplex.gateway.batches")
router = APIRouter(tags=["batch"])
_FORM_OVERHEAD = 64 * 1024


async def _key(request: Request, gw):
    principal = await gw.key_auth.authenticate(request.headers.get("authorization"))
    if SCOPE_INFERENCE not in principal.scopes:
        raise PermissionDeniedError("This API key may not run inference.", code="missing_scope")
    return principal


def store_of(gw) -> ObjectStore:
    return ObjectStore.from_settings(gw.settings)


# -- files -------------------------------------------------------------------------------------------------
@router.post("/v1/files")
async def upload_file(request: Request, gw: GatewayDep):
    principal = await _key(request, gw)
    fields, filename, data = await _read_form(request)
    if fields.get("purpose") != FILE_PURPOSE:
        raise InvalidRequestError(f"purpose must be '{FILE_PURPOSE}' (the only purpose this server stores)", param="purpose",
                                  code="invalid_purpose")
    if data is None:
        raise InvalidRequestError("send the JSONL as the form part 'file'", param="file", code="missing_file")
    checked = await check_file(data, lambda m: gw.resolver.resolve(principal.tenant_id, m), gw.resolver.builders)
    if checked.errors:
        raise _invalid_lines(checked.errors)

    def store() -> dict:
        with gw.session_factory() as s:
            row = records.put_file(store_of(gw), s, tenant_id=principal.tenant_id, data=data, filename=filename,
                                   purpose=FILE_PURPOSE, line_count=len(checked.lines))
            s.commit()
            return records.file_object(row)

    return await asyncio.to_thread(store)


def _invalid_lines(errors: list[LineError]) -> InvalidRequestError:
    shown = "; ".join(e.describe() for e in errors[:MAX_LINE_ERRORS])
    more = f" (and {len(errors) - MAX_LINE_ERRORS} more)" if len(errors) > MAX_LINE_ERRORS else ""
    first = errors[0]
    return InvalidRequestError(f"{len(errors)} invalid line(s) in the batch file: {shown}{more}",
                               param=f"line {first.line}" + (f": {first.param}" if first.param else ""),
                               code="invalid_batch_line")


async def _read_form(request: Request) -> tuple[dict[str, str], str, bytes | None]:
    """The multipart body, read under the file limit (this route is exempt from the generic body limit)."""
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not options.get(b"boundary"):
        raise InvalidRequestError("send the file as multipart/form-data", code="unsupported_media_type")
    limit = MAX_FILE_BYTES + _FORM_OVERHEAD
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large()
    parts: list[dict[str, Any]] = []
    header: dict[str, bytes] = {"field": b"", "value": b""}

    def on_header_value(data: bytes, start: int, end: int) -> None:
        header["value"] += data[start:end]

    def on_header_end() -> None:
        if header["field"].lower() == b"content-disposition":
            _, opts = parse_options_header(header["value"])
            parts[-1]["name"] = opts.get(b"name", b"").decode("utf-8", "replace")
            parts[-1]["filename"] = opts.get(b"filename", b"").decode("utf-8", "replace")
        header["field"], header["value"] = b"", b""

    parser = MultipartParser(options[b"boundary"], {
        "on_part_begin": lambda: parts.append({"data": bytearray()}),
        "on_header_field": lambda d, s, e: header.__setitem__("field", header["field"] + d[s:e]),
        "on_header_value": on_header_value, "on_header_end": on_header_end,
        "on_part_data": lambda d, s, e: parts[-1]["data"].extend(d[s:e]),
    })
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise _too_large()
            parser.write(chunk)
        parser.finalize()
    except Exception as exc:
        if type(exc).__module__.startswith("python_multipart"):
            raise InvalidRequestError(f"malformed multipart body: {exc}", code="malformed_multipart") from None
        raise
    return _fields_of(parts)


def _fields_of(parts: list[dict[str, Any]]) -> tuple[dict[str, str], str, bytes | None]:
    fields, filename, data = {}, "batch.jsonl", None
    for part in parts:
        name = part.get("name")
        if name == "file":
            if len(part["data"]) > MAX_FILE_BYTES:
                raise _too_large()
            data, filename = bytes(part["data"]), part.get("filename") or filename
        elif name:
            fields[name] = part["data"][:1024].decode("utf-8", "replace")
    return fields, filename, data


def _too_large() -> PayloadTooLargeError:
    return PayloadTooLargeError(f"A batch file may be at most {MAX_FILE_BYTES} bytes.", param="file", code="file_too_large")


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request, gw: GatewayDep):
    principal = await _key(request, gw)

    return await _in_session(gw, lambda s: records.file_object(records.get_file(s, principal.tenant_id, file_id)))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request, gw: GatewayDep):
    principal = await _key(request, gw)

    body = await _in_session(gw, lambda s: records.read_file(store_of(gw), records.get_file(s, principal.tenant_id, file_id)))
    return Response(body, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request, gw: GatewayDep):
    principal = await _key(request, gw)

    def delete(s) -> dict:
        records.delete_file(store_of(gw), s, records.get_file(s, principal.tenant_id, file_id))
        return {"id": file_id, "object": "file", "deleted": True}

    return await _in_session(gw, delete)


async def _in_session(gw, work):
    """`work(session)` on a worker thread (the database calls block), in a session of its own."""
    def run():
        with gw.session_factory() as s:
            return work(s)

    return await asyncio.to_thread(run)


# -- batches -----------------------------------------------------------------------------------------------
class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(max_length=100)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(default=None, max_length=16)


@router.post("/v1/batches")
async def create_batch(body: BatchCreate, request: Request, gw: GatewayDep):
    principal = await _key(request, gw)
    if body.endpoint not in ENDPOINTS:
        raise InvalidRequestError(f"endpoint must be one of {', '.join(ENDPOINTS)}", param="endpoint", code="invalid_value")
    if body.completion_window not in COMPLETION_WINDOWS:
        raise InvalidRequestError(f"completion_window must be one of {', '.join(COMPLETION_WINDOWS)}",
                                  param="completion_window", code="invalid_value")
    if body.metadata and any(len(k) > 64 or len(v) > 512 or "\x00" in k + v for k, v in body.metadata.items()):
        raise InvalidRequestError("metadata keys are at most 64 characters and values 512, without U+0000",
                                  param="metadata", code="invalid_value")
    created = await asyncio.to_thread(_create, gw, principal, body)
    try:
        await asyncio.to_thread(_enqueue, created["id"])
    except Exception as exc:  # the broker is down: the batch waits for the sweep (services.batch.tasks)
        log.warning("could not enqueue batch %s (%s); the sweep will start it", created["id"], exc.__class__.__name__)
    return created


def _create(gw, principal, body: BatchCreate) -> dict:
    store = store_of(gw)
    with gw.session_factory() as s:
        left = records.batch_tokens_left(s, principal.tenant_id)
        if left is not None and left <= 0:
            raise InsufficientQuotaError("Your monthly batch token budget is spent.", code="batch_quota_exceeded")
        input_file = records.get_file(s, principal.tenant_id, body.input_file_id)
        if input_file.purpose != FILE_PURPOSE:
            raise InvalidRequestError("the input file must have purpose 'batch'", param="input_file_id", code="invalid_file")
        data = records.read_file(store, input_file)
        wrong = [LineError(line=n, param="url", code="endpoint_mismatch",
                           message=f"url {line.url} is not the batch's endpoint {body.endpoint}")
                 for n, line in enumerate(split_lines(data).lines, start=1) if line.url != body.endpoint]
        if wrong:
            raise _invalid_lines(wrong)
        batch = records.create_batch(s, tenant_id=principal.tenant_id, api_key_id=principal.key_id, input_file=input_file,
                                     data=data, endpoint=body.endpoint, completion_window=body.completion_window,
                                     metadata=body.metadata)
        s.commit()
        return records.batch_object(batch)


def _enqueue(public_id: str) -> None:
    from services.common.celery_app import app as celery

    celery.send_task(TASK_RUN, args=[public_id], queue=QUEUE)


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(batch_id: str, request: Request, gw: GatewayDep):
    principal = await _key(request, gw)

    return await _in_session(gw, lambda s: records.batch_object(records.get_batch(s, principal.tenant_id, batch_id)))


@router.get("/v1/batches")
async def list_batches(request: Request, gw: GatewayDep, after: str | None = Query(None, max_length=100),
                       limit: int = Query(20, ge=1, le=LIST_LIMIT_MAX)):
    principal = await _key(request, gw)

    def get() -> dict:
        with gw.session_factory() as s:
            rows, more = records.list_batches(s, principal.tenant_id, after=after, limit=limit)
            data = [records.batch_object(b) for b in rows]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    return await asyncio.to_thread(get)


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, request: Request, gw: GatewayDep):
    principal = await _key(request, gw)
    return await asyncio.to_thread(cancel, gw, principal.tenant_id, batch_id)


def cancel(gw, tenant_id: uuid.UUID, batch_id: str) -> dict:
    """Ask the runner to stop: lines answered so far stay answered (and billed), the rest are skipped."""
    with gw.session_factory() as s:
        batch = records.get_batch(s, tenant_id, batch_id, for_update=True)
        if batch.status in TERMINAL or batch.status == BatchStatus.FINALIZING:
            raise ConflictError(f"The batch is {batch.status}; only a running batch can be cancelled.",
                                code="batch_not_cancellable")
        if batch.status != BatchStatus.CANCELLING:
            batch.status = BatchStatus.CANCELLING
            batch.cancelling_at = datetime.now(timezone.utc)
        s.commit()
        return records.batch_object(batch)
