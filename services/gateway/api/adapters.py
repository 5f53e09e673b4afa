"""Adapter uploads (docs/api.md): `POST /api/admin/tenants/{id}/adapters` (platform_admin, any tenant) and
`POST /api/tenant/adapters` (tenant_admin, the caller's tenant).

The multipart body is streamed to files in a private staging directory as it arrives — never held whole
in memory — and refused with 413 the moment it passes the size limit. The version is created by the same
plain function the CLI uses (services.adapters.upload) and the response (202) returns its id at once;
validation and the quality gate continue on the Celery workers.
"""
from __future__ import annotations

import logging
import math
import shutil
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import anyio.to_thread
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from python_multipart.multipart import MultipartParser, parse_options_header

from services.adapters.base_model import ensure_base_model
from services.adapters.config import PipelineConfig
from services.adapters.storage import ObjectStore
from services.adapters.upload import pack_files, upload_adapter
from services.common.errors import InvalidRequestError, NotFoundError, PayloadTooLargeError
from services.gateway.api.auth import actor_of
from services.gateway.auth import SessionPrincipal
from services.gateway.deps import AdapterWriter, GatewayDep, PlatformAdmin, SessionDep
from services.gateway.state import Gateway

log = logging.getLogger("mplex.gateway.adapters")

router = APIRouter(tags=["adapters"])

FIELD_MAX_BYTES = 4096  # name, thresholds
MAX_PARTS = 8
_FILE_FIELDS = ("file", "files", "eval_set")

_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {"multipart/form-data": {"schema": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "description": "the adapter's name (new name = new adapter)"},
                "file": {"type": "string", "format": "binary", "description": "one .tar.gz or .zip"},
                "files": {"type": "array", "items": {"type": "string", "format": "binary"},
                          "description": "adapter_config.json and adapter_model.safetensors"},
                "eval_set": {"type": "string", "format": "binary", "description": "JSONL of {prompt|messages, expected}"},
                "min_margin": {"type": "number"},
                "min_fp8_agreement": {"type": "number"},
            },
        }}},
    }
}
_RESPONSES = {400: {}, 401: {}, 403: {}, 404: {}, 413: {}}


class UploadOut(BaseModel):
    version_id: uuid.UUID
    adapter_id: uuid.UUID
    version: int
    status: str


@dataclass
class _Part:
    name: str
    filename: str | None
    path: Path | None = None  # file parts
    size: int = 0
    data: bytearray = field(default_factory=bytearray)  # plain fields
    out: BinaryIO | None = None


@dataclass
class Received:
    fields: dict[str, str]
    files: dict[str, list[tuple[str, Path]]]  # field -> [(client filename, staged path)]
    sizes: dict[str, int]


class _Receiver:
    """python-multipart callbacks writing file parts straight to disk, charging every byte to a cap."""

    def __init__(self, staging: Path, *, max_file_bytes: int, max_eval_bytes: int):
        self.staging = staging
        self.max_file_bytes = max_file_bytes
        self.max_eval_bytes = max_eval_bytes
        self.parts: list[_Part] = []
        self.file_bytes = 0
        self._header_field = b""
        self._header_value = b""
        self._headers: dict[bytes, bytes] = {}

    def callbacks(self) -> dict:
        return {"on_part_begin": self._begin, "on_header_field": self._hfield, "on_header_value": self._hvalue,
                "on_header_end": self._hend, "on_headers_finished": self._headers_done, "on_part_data": self._data,
                "on_part_end": self._end}

    def _begin(self) -> None:
        self._headers = {}

    def _hfield(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def _hvalue(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def _hend(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field, self._header_value = b"", b""

    def _headers_done(self) -> None:
        if len(self.parts) >= MAX_PARTS:
            raise InvalidRequestError(f"at most {MAX_PARTS} form parts are accepted", code="too_many_parts")
        disposition, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        if disposition != b"form-data" or b"name" not in options:
            raise InvalidRequestError("each form part needs a Content-Disposition: form-data header with a name",
                                      code="malformed_multipart")
        name = options[b"name"].decode("utf-8", "replace")
        filename = options[b"filename"].decode("utf-8", "replace") if b"filename" in options else None
        part = _Part(name, filename)
        if name in _FILE_FIELDS:
            part.path = self.staging / f"part-{len(self.parts)}"
            part.out = open(part.path, "xb")
        elif name not in ("name", "min_margin", "min_fp8_agreement"):
            raise InvalidRequestError(f"unknown form field {name!r}", param=name, code="unknown_field")
        self.parts.append(part)

    def _data(self, data: bytes, start: int, end: int) -> None:
        part = self.parts[-1]
        n = end - start
        part.size += n
        if part.out is None:
            if part.size > FIELD_MAX_BYTES:
                raise InvalidRequestError(f"form field {part.name!r} is too long", param=part.name, code="field_too_long")
            part.data += data[start:end]
            return
        if part.name == "eval_set":
            if part.size > self.max_eval_bytes:
                raise PayloadTooLargeError(f"The eval set is larger than the limit of {self.max_eval_bytes} bytes.",
                                           param="eval_set", code="upload_too_large")
        else:
            self.file_bytes += n
            if self.file_bytes > self.max_file_bytes:
                raise PayloadTooLargeError(f"The adapter upload is larger than the limit of {self.max_file_bytes} bytes.",
                                           param=part.name, code="upload_too_large")
        part.out.write(data[start:end])

    def _end(self) -> None:
        part = self.parts[-1]
        if part.out is not None:
            part.out.close()
            part.out = None

    def close(self) -> None:
        for part in self.parts:
            if part.out is not None:
                part.out.close()

    def received(self) -> Received:
        fields: dict[str, str] = {}
        files: dict[str, list[tuple[str, Path]]] = {}
        sizes: dict[str, int] = {}
        for part in self.parts:
            if part.path is not None:
                files.setdefault(part.name, []).append((part.filename or part.name, part.path))
                sizes[part.name] = sizes.get(part.name, 0) + part.size
            else:
                if part.name in fields:
                    raise InvalidRequestError(f"form field {part.name!r} is given twice", param=part.name, code="duplicate_field")
                try:
                    fields[part.name] = part.data.decode("utf-8")
                except UnicodeDecodeError:
                    raise InvalidRequestError(f"form field {part.name!r} is not UTF-8", param=part.name,
                                              code="invalid_encoding") from None
        return Received(fields, files, sizes)


async def receive_multipart(request: Request, staging: Path, *, max_file_bytes: int, max_eval_bytes: int) -> Received:
    ctype, options = parse_options_header(request.headers.get("content-type", ""))
    if ctype != b"multipart/form-data" or not options.get(b"boundary"):
        raise InvalidRequestError("send the adapter as multipart/form-data", code="unsupported_media_type")
    limit = max_file_bytes + max_eval_bytes + 64 * 1024  # the parts plus their headers and the small fields
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLargeError(f"The upload is {int(declared)} bytes; the limit is {max_file_bytes} bytes for the "
                                   f"adapter files.", code="upload_too_large")
    receiver = _Receiver(staging, max_file_bytes=max_file_bytes, max_eval_bytes=max_eval_bytes)
    parser = MultipartParser(options[b"boundary"], receiver.callbacks())
    total = 0
    try:
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise PayloadTooLargeError(f"The upload is larger than the limit of {max_file_bytes} bytes.",
                                           code="upload_too_large")
            if chunk:
                await anyio.to_thread.run_sync(parser.write, chunk)  # file writes happen off the event loop
        parser.finalize()
    except (PayloadTooLargeError, InvalidRequestError):
        raise
    except Exception as exc:  # python-multipart's parse errors: a malformed body, not a server fault
        if type(exc).__module__.startswith("python_multipart"):
            raise InvalidRequestError(f"malformed multipart body: {exc}", code="malformed_multipart") from None
        raise
    finally:
        receiver.close()
    return receiver.received()


def _number(fields: dict[str, str], name: str) -> float | None:
    raw = fields.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        raise InvalidRequestError(f"{name} must be a number", param=name, code="invalid_threshold") from None
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number", param=name, code="invalid_threshold")
    return value


def _archive_from(received: Received, staging: Path) -> Path:
    """The one file the pipeline takes: the uploaded archive, or the loose files packed into a tar."""
    archives, loose = received.files.get("file", []), received.files.get("files", [])
    if archives and loose:
        raise InvalidRequestError("send either `file` (one archive) or `files` (the two PEFT files), not both", param="file",
                                  code="invalid_upload_form")
    if len(archives) > 1:
        raise InvalidRequestError("`file` takes one .tar.gz or .zip archive", param="file", code="invalid_upload_form")
    if archives:
        return archives[0][1]
    if not loose:
        raise InvalidRequestError("the upload needs `file` (a .tar.gz or .zip) or `files` (adapter_config.json and "
                                  "adapter_model.safetensors)", param="file", code="missing_upload")
    packed = pack_files(loose, staging / "files.tar")
    for _, path in loose:  # the tar holds them now: the staging area peaks at twice the upload, not three times
        path.unlink()
    return packed


def _tenant_exists(db, tenant_id: uuid.UUID) -> bool:
    from services.common.models import Tenant

    try:
        return db.get(Tenant, tenant_id) is not None
    finally:
        db.close()  # hold no database connection while the body streams in


async def _upload(request: Request, gw: Gateway, db, user: SessionPrincipal, tenant_id: uuid.UUID) -> JSONResponse:
    config = PipelineConfig.from_env()
    if not await anyio.to_thread.run_sync(_tenant_exists, db, tenant_id):
        raise NotFoundError("Tenant not found.")
    sandbox_root = gw.settings.home / "sandbox"
    sandbox_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="upload-", dir=sandbox_root))
    try:
        received = await receive_multipart(request, staging, max_file_bytes=config.archive.max_upload_bytes,
                                           max_eval_bytes=config.max_eval_set_bytes)
        name = received.fields.get("name", "").strip()
        if not name:
            raise InvalidRequestError("name is required", param="name", code="invalid_name")
        min_margin = _number(received.fields, "min_margin")
        min_fp8 = _number(received.fields, "min_fp8_agreement")
        eval_parts = received.files.get("eval_set", [])
        if len(eval_parts) > 1:
            raise InvalidRequestError("send one eval_set file", param="eval_set", code="invalid_eval_set")
        archive = _archive_from(received, staging)
        actor = actor_of(request, user)

        def create():
            eval_set = eval_parts[0][1].read_bytes() if eval_parts else None
            with gw.session_factory() as s:
                base = ensure_base_model(s, name=gw.settings.base_model_name, model_dir=gw.resolver.default_base.model_dir,
                                         max_lora_rank=config.max_lora_rank)
                result = upload_adapter(s, store=ObjectStore.from_settings(gw.settings), config=config,
                                        sandbox_root=sandbox_root, base=base, tenant_id=tenant_id, name=name,
                                        upload=archive, actor=actor, eval_set=eval_set, min_margin=min_margin,
                                        min_fp8_agreement=min_fp8)
                s.commit()
            from services.adapters.tasks import enqueue_ingest

            enqueue_ingest(result.version_id)
            return result

        result = await anyio.to_thread.run_sync(create)
    finally:
        await anyio.to_thread.run_sync(lambda: shutil.rmtree(staging, ignore_errors=True))
    return JSONResponse(UploadOut(**result.as_response()).model_dump(mode="json"), status_code=202)


@router.post("/api/admin/tenants/{tenant_id}/adapters", status_code=202, response_model=UploadOut, responses=_RESPONSES,
             openapi_extra=_UPLOAD_BODY)
async def admin_upload(tenant_id: uuid.UUID, request: Request, user: PlatformAdmin, gw: GatewayDep, db: SessionDep):
    """Upload an adapter version for any tenant (platform_admin). Returns at once; poll the version."""
    return await _upload(request, gw, db, user, tenant_id)


@router.post("/api/tenant/adapters", status_code=202, response_model=UploadOut, responses=_RESPONSES,
             openapi_extra=_UPLOAD_BODY)
async def tenant_upload(request: Request, user: AdapterWriter, gw: GatewayDep, db: SessionDep):
    """Upload an adapter version for the caller's own tenant (tenant_admin, or an API key with adapters:write)."""
    assert user.tenant_id is not None  # tenant roles and keys always have a tenant
    return await _upload(request, gw, db, user, user.tenant_id)
