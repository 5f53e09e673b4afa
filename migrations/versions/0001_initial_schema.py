"""Initial schema: tenants, users, keys, adapters, price book, usage ledger, billing, audit log.

Also installs the triggers that make the money and audit tables append-only and adapter versions'
content immutable (see docs/data-model.md).

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# UNIQUE ... NULLS NOT DISTINCT (usage_daily's natural key) needs PostgreSQL 15.
MIN_SERVER_VERSION = 150000

APPEND_ONLY_TABLES = ("usage_events", "statements", "statement_lines", "audit_log")

FORBID_CHANGE_FN = """
CREATE FUNCTION mplex_forbid_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION '% rows are append-only (% refused)', TG_TABLE_NAME, TG_OP
        USING ERRCODE = 'restrict_violation';
END
$$
"""

# Content columns never change; the shape columns that validation fills in may be set once (from NULL).
ADAPTER_VERSION_FN = """
CREATE FUNCTION mplex_adapter_version_immutable() RETURNS trigger LANGUAGE plpgsql AS $$
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


def _check_server_version() -> None:
    version = op.get_bind().execute(sa.text("SHOW server_version_num")).scalar_one()
    if int(version) < MIN_SERVER_VERSION:
        raise RuntimeError(f"Multiplex needs PostgreSQL 15 or newer (server_version_num={version})")


def _install_triggers() -> None:
    op.execute(FORBID_CHANGE_FN)
    for table in APPEND_ONLY_TABLES:
        op.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {table} "
            "FOR EACH ROW EXECUTE FUNCTION mplex_forbid_change()"
        )
    op.execute(ADAPTER_VERSION_FN)
    op.execute(
        "CREATE TRIGGER adapter_versions_immutable BEFORE UPDATE OR DELETE ON adapter_versions "
        "FOR EACH ROW EXECUTE FUNCTION mplex_adapter_version_immutable()"
    )


def upgrade() -> None:
    _check_server_version()
    op.create_table('base_models',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('uri', sa.Text(), nullable=False),
    sa.Column('params', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('max_lora_rank', sa.Integer(), server_default=sa.text('64'), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('retired_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_base_models')),
    sa.UniqueConstraint('name', name=op.f('uq_base_models_name'))
    )
    op.create_table('engine_types',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('effective_from', sa.DateTime(timezone=True), nullable=False),
    sa.Column('price_per_hour_micros', sa.BigInteger(), nullable=False),
    sa.Column('description', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('price_per_hour_micros >= 0', name=op.f('ck_engine_types_price_nonneg')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_engine_types')),
    sa.UniqueConstraint('name', 'effective_from', name=op.f('uq_engine_types_name_effective_from'))
    )
    op.create_table('engine_usage_reports',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('engine_id', sa.Text(), nullable=False),
    sa.Column('engine_type', sa.Text(), nullable=False),
    sa.Column('base_model', sa.Text(), nullable=True),
    sa.Column('window_start', sa.DateTime(timezone=True), nullable=False),
    sa.Column('window_end', sa.DateTime(timezone=True), nullable=False),
    sa.Column('busy_us', sa.BigInteger(), nullable=False),
    sa.Column('idle_us', sa.BigInteger(), nullable=False),
    sa.Column('recorded_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('busy_us >= 0 AND idle_us >= 0', name=op.f('ck_engine_usage_reports_durations_nonneg')),
    sa.CheckConstraint('window_end > window_start', name=op.f('ck_engine_usage_reports_window_order')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_engine_usage_reports')),
    sa.UniqueConstraint('engine_id', 'window_start', name=op.f('uq_engine_usage_reports_engine_id_window_start'))
    )
    op.create_index('ix_engine_usage_reports_window_start', 'engine_usage_reports', ['window_start'], unique=False)
    op.create_table('tenants',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('slug', sa.Text(), nullable=False),
    sa.Column('status', sa.String(length=32), server_default='active', nullable=False),
    sa.Column('plan', sa.Text(), server_default='default', nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint("slug ~ '^[a-z0-9][a-z0-9-]{1,62}$'", name=op.f('ck_tenants_slug_format')),
    sa.CheckConstraint("status IN ('active', 'suspended')", name=op.f('ck_tenants_tenant_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenants')),
    sa.UniqueConstraint('slug', name=op.f('uq_tenants_slug'))
    )
    op.create_table('tenant_limits',
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('tokens_per_min', sa.BigInteger(), nullable=True),
    sa.Column('requests_per_min', sa.Integer(), nullable=True),
    sa.Column('concurrent_requests', sa.Integer(), nullable=True),
    sa.Column('monthly_token_budget', sa.BigInteger(), nullable=True),
    sa.CheckConstraint('concurrent_requests IS NULL OR concurrent_requests >= 0', name=op.f('ck_tenant_limits_concurrent_requests_nonneg')),
    sa.CheckConstraint('monthly_token_budget IS NULL OR monthly_token_budget >= 0', name=op.f('ck_tenant_limits_monthly_token_budget_nonneg')),
    sa.CheckConstraint('requests_per_min IS NULL OR requests_per_min >= 0', name=op.f('ck_tenant_limits_requests_per_min_nonneg')),
    sa.CheckConstraint('tokens_per_min IS NULL OR tokens_per_min >= 0', name=op.f('ck_tenant_limits_tokens_per_min_nonneg')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_tenant_limits_tenant_id_tenants'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('tenant_id', name=op.f('pk_tenant_limits'))
    )
    op.create_table('users',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('email', sa.Text(), nullable=False),
    sa.Column('password_hash', sa.Text(), nullable=False),
    sa.Column('role', sa.String(length=32), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=True),
    sa.Column('display_name', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_login_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('disabled_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("(role IN ('tenant_member', 'tenant_admin')) = (tenant_id IS NOT NULL)", name=op.f('ck_users_tenant_matches_role')),
    sa.CheckConstraint("email = lower(email) AND position('@' in email) > 1", name=op.f('ck_users_email_normalized')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_users_tenant_id_tenants')),
    sa.CheckConstraint("role IN ('tenant_member', 'tenant_admin', 'platform_admin', 'finance')", name=op.f('ck_users_user_role')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_users')),
    sa.UniqueConstraint('email', name=op.f('uq_users_email'))
    )
    op.create_index('ix_users_tenant_id', 'users', ['tenant_id'], unique=False)
    op.create_table('adapters',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('description', sa.Text(), nullable=True),
    sa.Column('base_model_id', sa.Uuid(), nullable=False),
    sa.Column('active_version_id', sa.Uuid(), nullable=True),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("name ~ '^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$'", name=op.f('ck_adapters_name_format')),
    sa.ForeignKeyConstraint(['base_model_id'], ['base_models.id'], name=op.f('fk_adapters_base_model_id_base_models')),
    sa.ForeignKeyConstraint(['created_by'], ['users.id'], name=op.f('fk_adapters_created_by_users')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_adapters_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapters')),
    sa.UniqueConstraint('id', 'tenant_id', name=op.f('uq_adapters_id_tenant_id'))
    )
    op.create_index('uq_adapters_tenant_id_name_live', 'adapters', ['tenant_id', 'name'], unique=True, postgresql_where=sa.text('deleted_at IS NULL'))
    op.create_table('api_keys',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('prefix', sa.Text(), nullable=False),
    sa.Column('key_hash', sa.Text(), nullable=False),
    sa.Column('name', sa.Text(), nullable=False),
    sa.Column('scopes', postgresql.ARRAY(sa.Text()), server_default=sa.text("ARRAY['inference']::text[]"), nullable=False),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('last_used_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('tokens_per_min', sa.BigInteger(), nullable=True),
    sa.Column('requests_per_min', sa.Integer(), nullable=True),
    sa.Column('concurrent_requests', sa.Integer(), nullable=True),
    sa.Column('monthly_token_budget', sa.BigInteger(), nullable=True),
    sa.CheckConstraint("key_hash ~ '^[0-9a-f]{64}$'", name=op.f('ck_api_keys_key_hash_sha256')),
    sa.CheckConstraint('concurrent_requests IS NULL OR concurrent_requests >= 0', name=op.f('ck_api_keys_concurrent_requests_nonneg')),
    sa.CheckConstraint('length(prefix) = 8', name=op.f('ck_api_keys_prefix_length')),
    sa.CheckConstraint('monthly_token_budget IS NULL OR monthly_token_budget >= 0', name=op.f('ck_api_keys_monthly_token_budget_nonneg')),
    sa.CheckConstraint('requests_per_min IS NULL OR requests_per_min >= 0', name=op.f('ck_api_keys_requests_per_min_nonneg')),
    sa.CheckConstraint('tokens_per_min IS NULL OR tokens_per_min >= 0', name=op.f('ck_api_keys_tokens_per_min_nonneg')),
    sa.ForeignKeyConstraint(['created_by'], ['users.id'], name=op.f('fk_api_keys_created_by_users')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_api_keys_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_api_keys')),
    sa.UniqueConstraint('id', 'tenant_id', name=op.f('uq_api_keys_id_tenant_id')),
    sa.UniqueConstraint('key_hash', name=op.f('uq_api_keys_key_hash')),
    sa.UniqueConstraint('prefix', name=op.f('uq_api_keys_prefix'))
    )
    op.create_index('ix_api_keys_tenant_id', 'api_keys', ['tenant_id'], unique=False)
    op.create_table('audit_log',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('actor_user_id', sa.Uuid(), nullable=True),
    sa.Column('tenant_id', sa.Uuid(), nullable=True),
    sa.Column('action', sa.Text(), nullable=False),
    sa.Column('target_type', sa.Text(), nullable=True),
    sa.Column('target_id', sa.Text(), nullable=True),
    sa.Column('details', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('request_id', sa.Text(), nullable=True),
    sa.Column('ip', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['actor_user_id'], ['users.id'], name=op.f('fk_audit_log_actor_user_id_users')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_audit_log_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_log'))
    )
    op.create_index('ix_audit_log_at', 'audit_log', ['at'], unique=False)
    op.create_index('ix_audit_log_tenant_id_at', 'audit_log', ['tenant_id', 'at'], unique=False)
    op.create_table('prices',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('base_model', sa.Text(), nullable=False),
    sa.Column('plan', sa.Text(), nullable=False),
    sa.Column('effective_from', sa.DateTime(timezone=True), nullable=False),
    sa.Column('input_per_mtok_micros', sa.BigInteger(), nullable=False),
    sa.Column('cached_input_per_mtok_micros', sa.BigInteger(), nullable=False),
    sa.Column('output_per_mtok_micros', sa.BigInteger(), nullable=False),
    sa.Column('adapter_surcharge_per_mtok_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('adapter_surcharge_per_mtok_micros >= 0', name=op.f('ck_prices_surcharge_nonneg')),
    sa.CheckConstraint('cached_input_per_mtok_micros >= 0', name=op.f('ck_prices_cached_input_nonneg')),
    sa.CheckConstraint('input_per_mtok_micros >= 0', name=op.f('ck_prices_input_nonneg')),
    sa.CheckConstraint('output_per_mtok_micros >= 0', name=op.f('ck_prices_output_nonneg')),
    sa.ForeignKeyConstraint(['base_model'], ['base_models.name'], name=op.f('fk_prices_base_model_base_models'), onupdate='CASCADE'),
    sa.ForeignKeyConstraint(['created_by'], ['users.id'], name=op.f('fk_prices_created_by_users')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_prices')),
    sa.UniqueConstraint('base_model', 'plan', 'effective_from', name=op.f('uq_prices_base_model_plan_effective_from'))
    )
    op.create_table('statements',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('period', sa.Date(), nullable=False),
    sa.Column('revision', sa.Integer(), nullable=False),
    sa.Column('currency', sa.Text(), server_default='USD', nullable=False),
    sa.Column('discount_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('total_micros', sa.BigInteger(), nullable=False),
    sa.Column('ledger_digest', sa.Text(), nullable=True),
    sa.Column('issued_by', sa.Uuid(), nullable=True),
    sa.Column('issued_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('requests', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('cached_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('compute_us', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('amount_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('compute_cost_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.CheckConstraint('extract(day from period) = 1', name=op.f('ck_statements_period_is_month_start')),
    sa.CheckConstraint('revision >= 1', name=op.f('ck_statements_revision_positive')),
    sa.CheckConstraint('total_micros = amount_micros - discount_micros', name=op.f('ck_statements_total_adds_up')),
    sa.ForeignKeyConstraint(['issued_by'], ['users.id'], name=op.f('fk_statements_issued_by_users')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_statements_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_statements')),
    sa.UniqueConstraint('tenant_id', 'period', 'revision', name=op.f('uq_statements_tenant_id_period_revision'))
    )
    op.create_table('tenant_price_overrides',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('base_model', sa.Text(), nullable=True),
    sa.Column('effective_from', sa.DateTime(timezone=True), nullable=False),
    sa.Column('effective_to', sa.DateTime(timezone=True), nullable=True),
    sa.Column('discount_bps', sa.Integer(), nullable=True),
    sa.Column('input_per_mtok_micros', sa.BigInteger(), nullable=True),
    sa.Column('cached_input_per_mtok_micros', sa.BigInteger(), nullable=True),
    sa.Column('output_per_mtok_micros', sa.BigInteger(), nullable=True),
    sa.Column('adapter_surcharge_per_mtok_micros', sa.BigInteger(), nullable=True),
    sa.Column('note', sa.Text(), nullable=True),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('adapter_surcharge_per_mtok_micros IS NULL OR adapter_surcharge_per_mtok_micros >= 0', name=op.f('ck_tenant_price_overrides_surcharge_nonneg')),
    sa.CheckConstraint('cached_input_per_mtok_micros IS NULL OR cached_input_per_mtok_micros >= 0', name=op.f('ck_tenant_price_overrides_cached_input_nonneg')),
    sa.CheckConstraint('discount_bps IS NOT NULL OR input_per_mtok_micros IS NOT NULL OR cached_input_per_mtok_micros IS NOT NULL OR output_per_mtok_micros IS NOT NULL OR adapter_surcharge_per_mtok_micros IS NOT NULL', name=op.f('ck_tenant_price_overrides_says_something')),
    sa.CheckConstraint('discount_bps IS NULL OR discount_bps BETWEEN 0 AND 10000', name=op.f('ck_tenant_price_overrides_discount_range')),
    sa.CheckConstraint('effective_to IS NULL OR effective_to > effective_from', name=op.f('ck_tenant_price_overrides_period_order')),
    sa.CheckConstraint('input_per_mtok_micros IS NULL OR input_per_mtok_micros >= 0', name=op.f('ck_tenant_price_overrides_input_nonneg')),
    sa.CheckConstraint('output_per_mtok_micros IS NULL OR output_per_mtok_micros >= 0', name=op.f('ck_tenant_price_overrides_output_nonneg')),
    sa.ForeignKeyConstraint(['base_model'], ['base_models.name'], name=op.f('fk_tenant_price_overrides_base_model_base_models'), onupdate='CASCADE'),
    sa.ForeignKeyConstraint(['created_by'], ['users.id'], name=op.f('fk_tenant_price_overrides_created_by_users')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_tenant_price_overrides_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_tenant_price_overrides')),
    sa.UniqueConstraint('tenant_id', 'base_model', 'effective_from', name=op.f('uq_tenant_price_overrides_tenant_id_base_model_effective_from'), postgresql_nulls_not_distinct=True)
    )
    op.create_table('web_sessions',
    sa.Column('id', sa.Text(), nullable=False),
    sa.Column('user_id', sa.Uuid(), nullable=False),
    sa.Column('csrf_token_hash', sa.Text(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('last_seen_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('user_agent', sa.Text(), nullable=True),
    sa.Column('ip', sa.Text(), nullable=True),
    sa.CheckConstraint('length(id) = 64', name=op.f('ck_web_sessions_id_is_sha256')),
    sa.ForeignKeyConstraint(['user_id'], ['users.id'], name=op.f('fk_web_sessions_user_id_users'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_web_sessions'))
    )
    op.create_index('ix_web_sessions_expires_at', 'web_sessions', ['expires_at'], unique=False)
    op.create_index('ix_web_sessions_user_id', 'web_sessions', ['user_id'], unique=False)
    op.create_table('adapter_versions',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('adapter_id', sa.Uuid(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('version', sa.Integer(), nullable=False),
    sa.Column('base_model_id', sa.Uuid(), nullable=False),
    sa.Column('content_sha256', sa.Text(), nullable=False),
    sa.Column('storage_uri', sa.Text(), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('rank', sa.Integer(), nullable=True),
    sa.Column('alpha', sa.Float(), nullable=True),
    sa.Column('target_modules', postgresql.ARRAY(sa.Text()), nullable=True),
    sa.Column('status', sa.String(length=32), server_default='uploaded', nullable=False),
    sa.Column('status_reasons', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('progress_percent', sa.SmallInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('progress_step', sa.Text(), nullable=True),
    sa.Column('eval_set_uri', sa.Text(), nullable=True),
    sa.Column('gate_config', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('eval_summary', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
    sa.Column('override_by', sa.Uuid(), nullable=True),
    sa.Column('override_reason', sa.Text(), nullable=True),
    sa.Column('override_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('created_by', sa.Uuid(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('ready_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("content_sha256 ~ '^[0-9a-f]{64}$'", name=op.f('ck_adapter_versions_content_sha256_hex')),
    sa.CheckConstraint("status <> 'ready' OR ready_at IS NOT NULL", name=op.f('ck_adapter_versions_ready_has_ready_at')),
    sa.CheckConstraint('(override_at IS NULL) = (override_reason IS NULL) AND (override_reason IS NULL OR length(override_reason) > 0)', name=op.f('ck_adapter_versions_override_has_reason')),
    sa.CheckConstraint('progress_percent BETWEEN 0 AND 100', name=op.f('ck_adapter_versions_progress_range')),
    sa.CheckConstraint('rank IS NULL OR rank > 0', name=op.f('ck_adapter_versions_rank_positive')),
    sa.CheckConstraint('size_bytes >= 0', name=op.f('ck_adapter_versions_size_nonneg')),
    sa.CheckConstraint('version >= 1', name=op.f('ck_adapter_versions_version_positive')),
    sa.ForeignKeyConstraint(['adapter_id', 'tenant_id'], ['adapters.id', 'adapters.tenant_id'], name=op.f('fk_adapter_versions_adapter_id_tenant_id_adapters')),
    sa.ForeignKeyConstraint(['base_model_id'], ['base_models.id'], name=op.f('fk_adapter_versions_base_model_id_base_models')),
    sa.ForeignKeyConstraint(['created_by'], ['users.id'], name=op.f('fk_adapter_versions_created_by_users')),
    sa.ForeignKeyConstraint(['override_by'], ['users.id'], name=op.f('fk_adapter_versions_override_by_users')),
    sa.CheckConstraint("status IN ('uploaded', 'validating', 'evaluating', 'ready', 'rejected')", name=op.f('ck_adapter_versions_adapter_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_adapter_versions')),
    sa.UniqueConstraint('adapter_id', 'version', name=op.f('uq_adapter_versions_adapter_id_version')),
    sa.UniqueConstraint('id', 'adapter_id', name=op.f('uq_adapter_versions_id_adapter_id')),
    sa.UniqueConstraint('id', 'tenant_id', name=op.f('uq_adapter_versions_id_tenant_id'))
    )
    op.create_index('ix_adapter_versions_content_sha256', 'adapter_versions', ['content_sha256'], unique=False)
    op.create_index('ix_adapter_versions_tenant_id_status', 'adapter_versions', ['tenant_id', 'status'], unique=False)
    # Created after adapter_versions exists: the two tables reference each other.
    op.create_foreign_key('fk_adapters_active_version_own', 'adapters', 'adapter_versions', ['active_version_id', 'id'], ['id', 'adapter_id'])
    op.create_table('eval_runs',
    sa.Column('id', sa.Uuid(), server_default=sa.text('gen_random_uuid()'), nullable=False),
    sa.Column('adapter_version_id', sa.Uuid(), nullable=False),
    sa.Column('attempt', sa.Integer(), server_default=sa.text('1'), nullable=False),
    sa.Column('status', sa.String(length=32), server_default='running', nullable=False),
    sa.Column('metrics', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'{}'::jsonb"), nullable=False),
    sa.Column('examples', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('decision', sa.String(length=32), nullable=True),
    sa.Column('reasons', postgresql.JSONB(astext_type=sa.Text()), server_default=sa.text("'[]'::jsonb"), nullable=False),
    sa.Column('task_id', sa.Text(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint("(status = 'finished') = (decision IS NOT NULL)", name=op.f('ck_eval_runs_decision_iff_finished')),
    sa.CheckConstraint("(status = 'running') = (finished_at IS NULL)", name=op.f('ck_eval_runs_finished_iff_not_running')),
    sa.CheckConstraint('attempt >= 1', name=op.f('ck_eval_runs_attempt_positive')),
    sa.ForeignKeyConstraint(['adapter_version_id'], ['adapter_versions.id'], name=op.f('fk_eval_runs_adapter_version_id_adapter_versions')),
    sa.CheckConstraint("status IN ('running', 'finished', 'failed')", name=op.f('ck_eval_runs_eval_run_status')),
    sa.CheckConstraint("decision IN ('pass', 'fail')", name=op.f('ck_eval_runs_gate_decision')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_eval_runs')),
    sa.UniqueConstraint('adapter_version_id', 'attempt', name=op.f('uq_eval_runs_adapter_version_id_attempt'))
    )
    op.create_table('statement_lines',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('statement_id', sa.Uuid(), nullable=False),
    sa.Column('line_no', sa.Integer(), nullable=False),
    sa.Column('model', sa.Text(), nullable=False),
    sa.Column('base_model', sa.Text(), nullable=False),
    sa.Column('adapter_version_id', sa.Uuid(), nullable=True),
    sa.Column('description', sa.Text(), nullable=False),
    sa.Column('requests', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('cached_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('compute_us', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('amount_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('compute_cost_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.ForeignKeyConstraint(['adapter_version_id'], ['adapter_versions.id'], name=op.f('fk_statement_lines_adapter_version_id_adapter_versions')),
    sa.ForeignKeyConstraint(['statement_id'], ['statements.id'], name=op.f('fk_statement_lines_statement_id_statements')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_statement_lines')),
    sa.UniqueConstraint('statement_id', 'line_no', name=op.f('uq_statement_lines_statement_id_line_no'))
    )
    op.create_table('usage_daily',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('day', sa.Date(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('model', sa.Text(), nullable=False),
    sa.Column('base_model', sa.Text(), nullable=False),
    sa.Column('adapter_version_id', sa.Uuid(), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('requests', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('prompt_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('cached_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('completion_tokens', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('compute_us', sa.BigInteger(), server_default='0', nullable=False),
    sa.Column('amount_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('compute_cost_micros', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.ForeignKeyConstraint(['adapter_version_id', 'tenant_id'], ['adapter_versions.id', 'adapter_versions.tenant_id'], name=op.f('fk_usage_daily_adapter_version_id_tenant_id_adapter_versions')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_daily_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_daily')),
    sa.UniqueConstraint('day', 'tenant_id', 'model', 'adapter_version_id', name=op.f('uq_usage_daily_day_tenant_id_model_adapter_version_id'), postgresql_nulls_not_distinct=True)
    )
    op.create_index('ix_usage_daily_tenant_id_day', 'usage_daily', ['tenant_id', 'day'], unique=False)
    op.create_table('usage_events',
    sa.Column('id', sa.BigInteger(), sa.Identity(always=False), nullable=False),
    sa.Column('request_id', sa.Text(), nullable=False),
    sa.Column('tenant_id', sa.Uuid(), nullable=False),
    sa.Column('api_key_id', sa.Uuid(), nullable=True),
    sa.Column('model', sa.Text(), nullable=False),
    sa.Column('base_model', sa.Text(), nullable=False),
    sa.Column('adapter_version_id', sa.Uuid(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('cached_tokens', sa.Integer(), server_default=sa.text('0'), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('http_status', sa.SmallInteger(), nullable=False),
    sa.Column('error_code', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_ms', sa.Integer(), nullable=True),
    sa.Column('first_token_ms', sa.Integer(), nullable=True),
    sa.Column('finished_ms', sa.Integer(), nullable=True),
    sa.Column('engine_id', sa.Text(), nullable=True),
    sa.Column('compute_us', sa.BigInteger(), server_default=sa.text('0'), nullable=False),
    sa.Column('recorded_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.CheckConstraint('cached_tokens BETWEEN 0 AND prompt_tokens', name=op.f('ck_usage_events_cached_within_prompt')),
    sa.CheckConstraint('compute_us >= 0', name=op.f('ck_usage_events_compute_nonneg')),
    sa.CheckConstraint('prompt_tokens >= 0 AND completion_tokens >= 0', name=op.f('ck_usage_events_tokens_nonneg')),
    sa.ForeignKeyConstraint(['adapter_version_id', 'tenant_id'], ['adapter_versions.id', 'adapter_versions.tenant_id'], name=op.f('fk_usage_events_adapter_version_id_tenant_id_adapter_versions')),
    sa.ForeignKeyConstraint(['api_key_id', 'tenant_id'], ['api_keys.id', 'api_keys.tenant_id'], name=op.f('fk_usage_events_api_key_id_tenant_id_api_keys')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_events_tenant_id_tenants')),
    sa.CheckConstraint("status IN ('ok', 'cancelled', 'error')", name=op.f('ck_usage_events_usage_status')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_events')),
    sa.UniqueConstraint('request_id', name=op.f('uq_usage_events_request_id'))
    )
    op.create_index('ix_usage_events_created_at', 'usage_events', ['created_at'], unique=False)
    op.create_index('ix_usage_events_recorded_at', 'usage_events', ['recorded_at'], unique=False)
    op.create_index('ix_usage_events_tenant_id_created_at', 'usage_events', ['tenant_id', 'created_at'], unique=False)

    _install_triggers()

def downgrade() -> None:
    # Dropping a table drops its triggers; the functions go last.
    op.drop_index('ix_usage_events_tenant_id_created_at', table_name='usage_events')
    op.drop_index('ix_usage_events_recorded_at', table_name='usage_events')
    op.drop_index('ix_usage_events_created_at', table_name='usage_events')
    op.drop_table('usage_events')
    op.drop_index('ix_usage_daily_tenant_id_day', table_name='usage_daily')
    op.drop_table('usage_daily')
    op.drop_table('statement_lines')
    op.drop_table('eval_runs')
    op.drop_constraint('fk_adapters_active_version_own', 'adapters', type_='foreignkey')
    op.drop_index('ix_adapter_versions_tenant_id_status', table_name='adapter_versions')
    op.drop_index('ix_adapter_versions_content_sha256', table_name='adapter_versions')
    op.drop_table('adapter_versions')
    op.drop_index('ix_web_sessions_user_id', table_name='web_sessions')
    op.drop_index('ix_web_sessions_expires_at', table_name='web_sessions')
    op.drop_table('web_sessions')
    op.drop_table('tenant_price_overrides')
    op.drop_table('statements')
    op.drop_table('prices')
    op.drop_index('ix_audit_log_tenant_id_at', table_name='audit_log')
    op.drop_index('ix_audit_log_at', table_name='audit_log')
    op.drop_table('audit_log')
    op.drop_index('ix_api_keys_tenant_id', table_name='api_keys')
    op.drop_table('api_keys')
    op.drop_index('uq_adapters_tenant_id_name_live', table_name='adapters', postgresql_where=sa.text('deleted_at IS NULL'))
    op.drop_table('adapters')
    op.drop_index('ix_users_tenant_id', table_name='users')
    op.drop_table('users')
    op.drop_table('tenant_limits')
    op.drop_table('tenants')
    op.drop_index('ix_engine_usage_reports_window_start', table_name='engine_usage_reports')
    op.drop_table('engine_usage_reports')
    op.drop_table('engine_types')
    op.drop_table('base_models')
    op.execute("DROP FUNCTION mplex_adapter_version_immutable()")
    op.execute("DROP FUNCTION mplex_forbid_change()")
