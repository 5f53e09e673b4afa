"""Adapter storage hygiene: retention, garbage collection and a per-tenant storage quota.

- adapter_versions.objects_purged_at: when retention removed the version's files (never unset; a purged
  version never becomes ready again — the immutability trigger refuses both).
- adapter_versions.eval_set_bytes: the eval set's size, set once at upload (the quota counts it).
- partial indexes on storage_uri / eval_set_uri of versions that keep their files: the garbage collector
  asks, per object, whether any such version still references it.
- tenant_limits.storage_quota_bytes: a tenant's own quota (NULL = the platform default).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-25
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# 0001's function plus: eval_set_bytes set once; objects_purged_at never unset; a purged version never ready.
ADAPTER_VERSION_FN = """
CREATE OR REPLACE FUNCTION mplex_adapter_version_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'adapter_versions rows are never deleted' USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.adapter_id, NEW.tenant_id, NEW.version, NEW.base_model_id, NEW.content_sha256, NEW.storage_uri,
        NEW.size_bytes, NEW.created_at)
       IS DISTINCT FROM
       (OLD.adapter_id, OLD.tenant_id, OLD.version, OLD.base_model_id, OLD.content_sha256, OLD.storage_uri,
        OLD.size_bytes, OLD.created_at)
    THEN
        RAISE EXCEPTION 'adapter version % is immutable: upload a new version instead', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (OLD.rank IS NOT NULL AND NEW.rank IS DISTINCT FROM OLD.rank)
       OR (OLD.alpha IS NOT NULL AND NEW.alpha IS DISTINCT FROM OLD.alpha)
       OR (OLD.target_modules IS NOT NULL AND NEW.target_modules IS DISTINCT FROM OLD.target_modules)
    THEN
        RAISE EXCEPTION 'adapter version % shape (rank, alpha, target modules) is set once', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.eval_set_bytes IS NOT NULL AND NEW.eval_set_bytes IS DISTINCT FROM OLD.eval_set_bytes THEN
        RAISE EXCEPTION 'adapter version % eval_set_bytes is set once', OLD.id USING ERRCODE = 'restrict_violation';
    END IF;
    IF OLD.objects_purged_at IS NOT NULL AND NEW.objects_purged_at IS DISTINCT FROM OLD.objects_purged_at THEN
        RAISE EXCEPTION 'adapter version % files were removed; that cannot be undone', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF NEW.objects_purged_at IS NOT NULL AND NEW.status = 'ready' AND OLD.status IS DISTINCT FROM 'ready' THEN
        RAISE EXCEPTION 'adapter version % has no files any more and cannot become ready', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$
"""

# 0001's function, restored on downgrade.
PREVIOUS_FN = """
CREATE OR REPLACE FUNCTION mplex_adapter_version_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        RAISE EXCEPTION 'adapter_versions rows are never deleted' USING ERRCODE = 'restrict_violation';
    END IF;
    IF (NEW.adapter_id, NEW.tenant_id, NEW.version, NEW.base_model_id, NEW.content_sha256, NEW.storage_uri,
        NEW.size_bytes, NEW.created_at)
       IS DISTINCT FROM
       (OLD.adapter_id, OLD.tenant_id, OLD.version, OLD.base_model_id, OLD.content_sha256, OLD.storage_uri,
        OLD.size_bytes, OLD.created_at)
    THEN
        RAISE EXCEPTION 'adapter version % is immutable: upload a new version instead', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    IF (OLD.rank IS NOT NULL AND NEW.rank IS DISTINCT FROM OLD.rank)
       OR (OLD.alpha IS NOT NULL AND NEW.alpha IS DISTINCT FROM OLD.alpha)
       OR (OLD.target_modules IS NOT NULL AND NEW.target_modules IS DISTINCT FROM OLD.target_modules)
    THEN
        RAISE EXCEPTION 'adapter version % shape (rank, alpha, target modules) is set once', OLD.id
            USING ERRCODE = 'restrict_violation';
    END IF;
    RETURN NEW;
END
$$
"""


def upgrade() -> None:
    op.add_column("adapter_versions", sa.Column("eval_set_bytes", sa.BigInteger(), nullable=True))
    op.add_column("adapter_versions", sa.Column("objects_purged_at", sa.DateTime(timezone=True), nullable=True))
    op.create_check_constraint(op.f("ck_adapter_versions_eval_set_bytes_nonneg"), "adapter_versions",
                               "eval_set_bytes IS NULL OR eval_set_bytes >= 0")
    op.create_index("ix_adapter_versions_storage_uri_kept", "adapter_versions", ["storage_uri"],
                    postgresql_where=sa.text("objects_purged_at IS NULL"))
    op.create_index("ix_adapter_versions_eval_set_uri_kept", "adapter_versions", ["eval_set_uri"],
                    postgresql_where=sa.text("eval_set_uri IS NOT NULL AND objects_purged_at IS NULL"))
    op.add_column("tenant_limits", sa.Column("storage_quota_bytes", sa.BigInteger(), nullable=True))
    op.create_check_constraint(op.f("ck_tenant_limits_storage_quota_bytes_nonneg"), "tenant_limits",
                               "storage_quota_bytes IS NULL OR storage_quota_bytes >= 0")
    op.execute(ADAPTER_VERSION_FN)


def downgrade() -> None:
    op.execute(PREVIOUS_FN)
    op.drop_constraint(op.f("ck_tenant_limits_storage_quota_bytes_nonneg"), "tenant_limits", type_="check")
    op.drop_column("tenant_limits", "storage_quota_bytes")
    op.drop_index("ix_adapter_versions_eval_set_uri_kept", table_name="adapter_versions")
    op.drop_index("ix_adapter_versions_storage_uri_kept", table_name="adapter_versions")
    op.drop_constraint(op.f("ck_adapter_versions_eval_set_bytes_nonneg"), "adapter_versions", type_="check")
    op.drop_column("adapter_versions", "objects_purged_at")
    op.drop_column("adapter_versions", "eval_set_bytes")
