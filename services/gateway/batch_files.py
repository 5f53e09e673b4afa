"""Batch API records: storing a tenant's files (object store + `batch_files` row), creating a batch with
its line checkpoints, and the OpenAI JSON shapes of files and batches. Every query is scoped by the
caller's tenant; an id of another tenant reads exactly like one that does not exist.
"""
from __future__ import annotations

import tempfile
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import orjson
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from services.adapters.storage import ObjectStore
from services.common.batch_contract import (
    BATCH_PREFIX,
    COMPLETION_WINDOWS,
    FILE_PREFIX,
    MAX_FILE_BYTES,
    BatchStatus,
    LineState,
    batch_public_id,
    file_public_id,
    parse_public_id,
)
from services.common.errors import NotFoundError
from services.billing.usage import batch_usage, month_bounds
from services.common.models import Batch, BatchFile, BatchLine, TenantLimits
from services.gateway.batch_input import split_lines


def put_file(store: ObjectStore, session: Session, *, tenant_id: uuid.UUID, data: bytes, filename: str, purpose: str,
             line_count: int) -> BatchFile:
    """Store `data` (content-addressed) and add its row; the caller commits."""
    with tempfile.TemporaryDirectory(prefix="mplex-batch-") as tmp:
        path = Path(tmp) / "file.jsonl"
        path.write_bytes(data)
        return put_path(store, session, tenant_id=tenant_id, path=path, filename=filename, purpose=purpose,
                        line_count=line_count)


def put_path(store: ObjectStore, session: Session, *, tenant_id: uuid.UUID, path: Path, filename: str, purpose: str,
             line_count: int) -> BatchFile:
    stored = store.put_blob(path, "batches", ".jsonl")
    row = BatchFile(tenant_id=tenant_id, purpose=purpose, filename=filename[:255], bytes=stored.size_bytes,
                    line_count=line_count, sha256=stored.sha256, storage_uri=stored.uri)
    session.add(row)
    session.flush()
    return row


def get_file(session: Session, tenant_id: uuid.UUID, public_id: str) -> BatchFile:
    file_id = parse_public_id(public_id, FILE_PREFIX)
    row = None if file_id is None else session.scalar(
        select(BatchFile).where(BatchFile.id == file_id, BatchFile.tenant_id == tenant_id, BatchFile.deleted_at.is_(None)))
    if row is None:
        # The same bytes for any id that is not the caller's: nothing tells "another tenant's" from "none".
        raise NotFoundError("No such File object (or not yours).", param="file_id", code="file_not_found")
    return row


def read_file(store: ObjectStore, row: BatchFile) -> bytes:
    return store.read_bytes(row.storage_uri, max_bytes=max(MAX_FILE_BYTES, row.bytes))


def delete_file(store: ObjectStore, session: Session, row: BatchFile) -> None:
    """Mark the row deleted; remove the object once no other live row (of any tenant) has the same bytes."""
    row.deleted_at = datetime.now(timezone.utc)
    session.flush()
    others = session.scalar(select(func.count()).select_from(BatchFile).where(
        BatchFile.storage_uri == row.storage_uri, BatchFile.deleted_at.is_(None)))
    session.commit()
    if not others:
        store.delete(row.storage_uri)


def get_batch(session: Session, tenant_id: uuid.UUID, public_id: str, *, for_update: bool = False) -> Batch:
    batch_id = parse_public_id(public_id, BATCH_PREFIX)
    q = select(Batch).where(Batch.id == batch_id, Batch.tenant_id == tenant_id)
    row = None if batch_id is None else session.scalar(q.with_for_update() if for_update else q)
    if row is None:
        raise NotFoundError("No such Batch object (or not yours).", param="batch_id", code="batch_not_found")
    return row


def create_batch(session: Session, *, tenant_id: uuid.UUID, api_key_id: uuid.UUID | None, input_file: BatchFile,
                 data: bytes, endpoint: str, completion_window: str, metadata: dict | None) -> Batch:
    """The batch and one `pending` checkpoint row per line, in one transaction (the caller commits)."""
    lines = split_lines(data).lines  # validated at upload; re-split from the stored bytes
    now = datetime.now(timezone.utc)
    batch = Batch(tenant_id=tenant_id, api_key_id=api_key_id, input_file_id=input_file.id, endpoint=endpoint,
                  completion_window=completion_window, status=BatchStatus.VALIDATING, batch_metadata=metadata,
                  total=len(lines), created_at=now, expires_at=now + timedelta(seconds=COMPLETION_WINDOWS[completion_window]))
    session.add(batch)
    session.flush()
    rows = [{"batch_id": batch.id, "line_no": n, "custom_id": line.custom_id, "url": line.url,
             "body": orjson.dumps(line.body).decode(),
             "state": LineState.PENDING} for n, line in enumerate(lines, start=1)]
    for i in range(0, len(rows), 2000):
        session.execute(insert(BatchLine), rows[i:i + 2000])
    return batch


def list_batches(session: Session, tenant_id: uuid.UUID, *, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    """The tenant's batches, newest first, after the cursor `after` (a batch id of the previous page)."""
    q = select(Batch).where(Batch.tenant_id == tenant_id)
    if after:
        after_id = parse_public_id(after, BATCH_PREFIX)
        if after_id is None:
            return [], False
        q = q.where(Batch.id < after_id)
    rows = list(session.scalars(q.order_by(Batch.id.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit


# -- OpenAI shapes -----------------------------------------------------------------------------------------
def _ts(t: datetime | None) -> int | None:
    return int(t.timestamp()) if t is not None else None


def file_object(row: BatchFile) -> dict:
    return {"id": file_public_id(row.id), "object": "file", "bytes": row.bytes, "created_at": _ts(row.created_at),
            "filename": row.filename, "purpose": row.purpose, "status": "processed", "status_details": None,
            "expires_at": None}


def batch_object(b: Batch) -> dict:
    return {
        "id": batch_public_id(b.id), "object": "batch", "endpoint": b.endpoint,
        "errors": {"object": "list", "data": b.errors} if b.errors else None,
        "input_file_id": file_public_id(b.input_file_id), "completion_window": b.completion_window,
        "status": str(b.status),
        "output_file_id": file_public_id(b.output_file_id) if b.output_file_id else None,
        "error_file_id": file_public_id(b.error_file_id) if b.error_file_id else None,
        "created_at": _ts(b.created_at), "in_progress_at": _ts(b.in_progress_at), "expires_at": _ts(b.expires_at),
        "finalizing_at": _ts(b.finalizing_at), "completed_at": _ts(b.completed_at), "failed_at": _ts(b.failed_at),
        "expired_at": _ts(b.expired_at), "cancelling_at": _ts(b.cancelling_at), "cancelled_at": _ts(b.cancelled_at),
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": b.batch_metadata,
        "usage": {"input_tokens": b.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": b.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": b.prompt_tokens + b.completion_tokens},
    }


# -- the batch quota ----------------------------------------------------------------------------------------
def batch_tokens_left(session: Session, tenant_id: uuid.UUID, now: datetime | None = None) -> int | None:
    """Tokens of the tenant's monthly batch budget not yet used by batch lines this UTC month (None:
    unlimited). The live windows are not touched by batch lines, nor this budget by live requests."""
    budget = session.scalar(select(TenantLimits.monthly_batch_token_budget).where(TenantLimits.tenant_id == tenant_id))
    if budget is None:
        return None
    start, end = month_bounds(now or datetime.now(timezone.utc))
    used = batch_usage(session, tenant_id=tenant_id, start=start, end=end)
    return max(0, budget - used["prompt_tokens"] - used["completion_tokens"])
