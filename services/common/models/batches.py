"""The Batch API's rows: tenants' files (inputs, outputs, error files), batches, and one checkpoint row per
input line. A line's row is the exactly-once record: it moves from `pending` once, in the same transaction
as its ledger row (services.batch.checkpoint)."""
from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import CheckConstraint, ForeignKey, ForeignKeyConstraint, Index, Integer, UniqueConstraint, text
from sqlalchemy.orm import Mapped, mapped_column

from services.common.batch_contract import BatchStatus, LineState
from services.common.models.base import Base, created_at, str_enum, uuid_pk


class BatchFile(Base):
    """A file of a tenant (purpose `batch`: an input; `batch_output`: a batch's output or error file)."""

    __tablename__ = "batch_files"
    __table_args__ = (
        UniqueConstraint("id", "tenant_id"),  # batches reference (file, tenant): never another tenant's file
        CheckConstraint("purpose IN ('batch', 'batch_output')", name="purpose_known"),
        CheckConstraint("bytes >= 0 AND line_count >= 0", name="sizes_nonneg"),
        Index("ix_batch_files_tenant_id_created_at", "tenant_id", "created_at"),
    )

    id: Mapped[uuid.UUID] = uuid_pk()
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    purpose: Mapped[str]
    filename: Mapped[str]
    bytes: Mapped[int] = mapped_column(Integer)
    line_count: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str]
    storage_uri: Mapped[str]  # content-addressed in the object store (shared by equal bytes)
    created_at: Mapped[datetime] = created_at()
    deleted_at: Mapped[datetime | None]


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (
        ForeignKeyConstraint(["input_file_id", "tenant_id"], ["batch_files.id", "batch_files.tenant_id"]),
        ForeignKeyConstraint(["output_file_id", "tenant_id"], ["batch_files.id", "batch_files.tenant_id"]),
        ForeignKeyConstraint(["error_file_id", "tenant_id"], ["batch_files.id", "batch_files.tenant_id"]),
        ForeignKeyConstraint(["api_key_id", "tenant_id"], ["api_keys.id", "api_keys.tenant_id"]),
        UniqueConstraint("id", "tenant_id"),
        CheckConstraint("completed >= 0 AND failed >= 0 AND completed + failed <= total", name="counts_add_up"),
        Index("ix_batches_tenant_id_id", "tenant_id", "id"),
        Index("ix_batches_status", "status"),
    )

    id: Mapped[uuid.UUID] = uuid_pk()  # uuid7: ordered by creation, which the list's `after` cursor uses
    tenant_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("tenants.id"))
    api_key_id: Mapped[uuid.UUID | None]
    input_file_id: Mapped[uuid.UUID]
    endpoint: Mapped[str]
    completion_window: Mapped[str]
    status: Mapped[BatchStatus] = mapped_column(str_enum(BatchStatus, "batch_status"))
    batch_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata")
    errors: Mapped[list[Any] | None]
    output_file_id: Mapped[uuid.UUID | None]
    error_file_id: Mapped[uuid.UUID | None]
    total: Mapped[int] = mapped_column(Integer)
    completed: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    failed: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0, server_default=text("0"))
    created_at: Mapped[datetime] = created_at()
    expires_at: Mapped[datetime]
    in_progress_at: Mapped[datetime | None]
    finalizing_at: Mapped[datetime | None]
    completed_at: Mapped[datetime | None]
    failed_at: Mapped[datetime | None]
    expired_at: Mapped[datetime | None]
    cancelling_at: Mapped[datetime | None]
    cancelled_at: Mapped[datetime | None]


class BatchLine(Base):
    """One input line: its request (validated at upload), and once answered its output or error line."""

    __tablename__ = "batch_lines"
    __table_args__ = (
        UniqueConstraint("batch_id", "custom_id"),
        # An answered line's result lives here until it is in a part object (services.batch.parts), then only
        # there: Postgres holds what is not yet in the object store, never the whole output.
        CheckConstraint("CASE WHEN state = 'pending' THEN result IS NULL AND part_seq IS NULL "
                        "ELSE (result IS NULL) = (part_seq IS NOT NULL) END", name="answered_has_result_or_part"),
    )

    batch_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    line_no: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1-based, as in the file
    custom_id: Mapped[str]
    url: Mapped[str]
    # JSON text, not JSONB: a request or an answer may hold U+0000 (a prompt with it, a model that generates
    # byte 0), which JSON allows and JSONB refuses.
    body: Mapped[str]
    state: Mapped[LineState] = mapped_column(str_enum(LineState, "batch_line_state"))
    result: Mapped[str | None]  # the output / error file line, until it is written to a part
    answered_at: Mapped[datetime | None]
    part_seq: Mapped[int | None] = mapped_column(Integer)  # the part object holding its result (batch_parts.seq)


class BatchPart(Base):
    """One object of a batch's results in the object store, written while the batch runs. The batch's output
    (or error) file is its parts of that kind in `seq` order; each answered line is in exactly one part."""

    __tablename__ = "batch_parts"
    __table_args__ = (
        CheckConstraint("kind IN ('output', 'errors')", name="kind_known"),
        CheckConstraint("line_count > 0 AND bytes > 0", name="not_empty"),
    )

    batch_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("batches.id"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1, 2, ... in the order written
    kind: Mapped[str]
    storage_uri: Mapped[str]  # batches/parts/<batch>/<seq>.jsonl (services.batch.parts owns the key)
    line_count: Mapped[int] = mapped_column(Integer)
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = created_at()
