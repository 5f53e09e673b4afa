"""Database-enforced invariants: ledger idempotency, immutable statements and adapter versions,
tenant consistency of foreign keys, natural keys of roll-ups."""
from datetime import date, datetime, timedelta, timezone

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.exc import DBAPIError, IntegrityError

from factories import (
    make_adapter,
    make_adapter_version,
    make_api_key,
    make_base_model,
    make_tenant,
    make_usage_event,
    make_user,
)
from services.common.ids import new_request_id
from services.common.models import (
    AdapterStatus,
    AuditLog,
    Role,
    Statement,
    StatementLine,
    Tenant,
    UsageDaily,
    UsageEvent,
    UsageStatus,
    User,
)


def refused(db, fn) -> Exception:
    with pytest.raises((IntegrityError, DBAPIError)) as info:
        fn()
        db.flush()
    db.rollback()
    return info.value


def ledger_row(tenant, request_id: str, **kw) -> dict:
    return dict(request_id=request_id, tenant_id=tenant.id, model="mplex-demo", base_model="mplex-demo",
                prompt_tokens=kw.get("prompt_tokens", 7), cached_tokens=0, completion_tokens=3, status="ok",
                http_status=200, created_at=datetime.now(timezone.utc))


# ------------------------------------------------------------------------------------------------ ledger


def test_ledger_request_id_is_unique(db):
    tenant = make_tenant(db)
    event = make_usage_event(db, tenant=tenant)
    refused(db, lambda: db.add(UsageEvent(**ledger_row(tenant, event.request_id))))
    assert db.scalar(select(UsageEvent).where(UsageEvent.request_id == event.request_id)).prompt_tokens == 10


def test_ledger_idempotent_insert_lands_exactly_once(db):
    tenant = make_tenant(db)
    rid = new_request_id()
    stmt = insert(UsageEvent).on_conflict_do_nothing(index_elements=["request_id"])
    first = db.execute(stmt.returning(UsageEvent.id), [ledger_row(tenant, rid)]).all()
    again = db.execute(stmt.returning(UsageEvent.id), [ledger_row(tenant, rid, prompt_tokens=999)]).all()
    db.commit()
    assert len(first) == 1 and again == []
    rows = db.scalars(select(UsageEvent).where(UsageEvent.request_id == rid)).all()
    assert [r.prompt_tokens for r in rows] == [7]


def test_ledger_rows_are_append_only(db):
    tenant = make_tenant(db)
    event = make_usage_event(db, tenant=tenant)
    err = refused(db, lambda: db.execute(update(UsageEvent).where(UsageEvent.id == event.id).values(completion_tokens=0)))
    assert "append-only" in str(err)
    refused(db, lambda: db.execute(text("DELETE FROM usage_events WHERE id = :id"), {"id": event.id}))


def test_ledger_token_counts_are_sane(db):
    tenant = make_tenant(db)
    refused(db, lambda: db.add(UsageEvent(**{**ledger_row(tenant, new_request_id()), "cached_tokens": 8})))
    refused(db, lambda: db.add(UsageEvent(**{**ledger_row(tenant, new_request_id()), "completion_tokens": -1})))


def test_ledger_timestamps_are_utc_aware(db):
    tenant = make_tenant(db)
    local = datetime(2026, 3, 1, 9, 30, tzinfo=timezone(timedelta(hours=2)))
    event = make_usage_event(db, tenant=tenant, created_at=local)
    db.expire_all()
    stored = db.get(UsageEvent, event.id)
    assert stored.created_at == local and stored.created_at.utcoffset() == timedelta(0)
    assert stored.recorded_at.tzinfo is not None


def test_ledger_refuses_another_tenants_key_or_adapter(db):
    mine, theirs = make_tenant(db), make_tenant(db)
    their_key = make_api_key(db, tenant=theirs).row
    their_version = make_adapter_version(db, adapter=make_adapter(db, tenant=theirs))
    err = refused(db, lambda: db.add(UsageEvent(**ledger_row(mine, new_request_id()), api_key_id=their_key.id)))
    assert "fk_usage_events_api_key_id_tenant_id_api_keys" in str(err)
    err = refused(db, lambda: db.add(UsageEvent(**ledger_row(mine, new_request_id()), adapter_version_id=their_version.id)))
    assert "fk_usage_events_adapter_version_id_tenant_id_adapter_versions" in str(err)
    ok = make_usage_event(db, tenant=theirs, api_key=their_key, adapter_version=their_version)
    assert ok.id is not None


# --------------------------------------------------------------------------------------------- billing


def make_statement(tenant, period: date, revision: int, total: int = 100) -> Statement:
    return Statement(tenant_id=tenant.id, period=period, revision=revision, amount_micros=total, total_micros=total)


def test_statement_revisions_are_unique_per_tenant_and_period(db):
    tenant, other = make_tenant(db), make_tenant(db)
    db.add_all([make_statement(tenant, date(2026, 1, 1), 1), make_statement(tenant, date(2026, 1, 1), 2),
                make_statement(tenant, date(2026, 2, 1), 1), make_statement(other, date(2026, 1, 1), 1)])
    db.commit()
    refused(db, lambda: db.add(make_statement(tenant, date(2026, 1, 1), 2, total=5)))
    revisions = db.scalars(select(Statement.revision).where(Statement.tenant_id == tenant.id, Statement.period == date(2026, 1, 1)))
    assert sorted(revisions) == [1, 2]


def test_statements_and_their_lines_are_immutable(db):
    tenant = make_tenant(db)
    st = make_statement(tenant, date(2026, 3, 1), 1)
    db.add(st)
    db.flush()
    db.add(StatementLine(statement_id=st.id, line_no=1, model="mplex-demo", base_model="mplex-demo", description="base"))
    db.commit()
    refused(db, lambda: db.execute(update(Statement).where(Statement.id == st.id).values(total_micros=1, amount_micros=1)))
    refused(db, lambda: db.execute(update(StatementLine).where(StatementLine.statement_id == st.id).values(amount_micros=1)))
    refused(db, lambda: db.execute(text("DELETE FROM statements WHERE id = :id"), {"id": st.id}))


def test_statement_period_and_totals_are_checked(db):
    tenant = make_tenant(db)
    assert "period_is_month_start" in str(refused(db, lambda: db.add(make_statement(tenant, date(2026, 3, 15), 1))))
    refused(db, lambda: db.add(Statement(tenant_id=tenant.id, period=date(2026, 4, 1), revision=1,
                                         amount_micros=100, discount_micros=10, total_micros=100)))


def test_daily_rollup_natural_key_upserts_including_base_model_rows(db):
    tenant = make_tenant(db)
    version = make_adapter_version(db, adapter=make_adapter(db, tenant=tenant))
    day = date(2026, 5, 4)

    def upsert(adapter_version_id, tokens: int) -> None:
        stmt = insert(UsageDaily).values(day=day, tenant_id=tenant.id, model="m", base_model="mplex-demo",
                                         adapter_version_id=adapter_version_id, requests=1, prompt_tokens=tokens)
        db.execute(stmt.on_conflict_do_update(
            constraint="uq_usage_daily_natural_key",
            set_={"prompt_tokens": stmt.excluded.prompt_tokens}))
        db.commit()

    for adapter_version_id in (None, version.id):  # NULL adapter (base model) must upsert, not duplicate
        upsert(adapter_version_id, 5)
        upsert(adapter_version_id, 9)
    rows = db.scalars(select(UsageDaily).where(UsageDaily.tenant_id == tenant.id)).all()
    assert sorted((r.adapter_version_id is None, r.prompt_tokens) for r in rows) == [(False, 9), (True, 9)]


# -------------------------------------------------------------------------------------------- adapters


def test_adapter_version_content_is_immutable_but_status_moves(db):
    version = make_adapter_version(db, adapter=make_adapter(db, tenant=make_tenant(db)))
    version.status = AdapterStatus.VALIDATING
    version.progress_percent = 40
    version.rank, version.alpha, version.target_modules = 8, 16.0, ["q_proj", "v_proj"]  # set once by validation
    db.commit()
    for change in ({"content_sha256": "0" * 64}, {"storage_uri": "file:///elsewhere"}, {"version": 7}, {"rank": 16}):
        err = refused(db, lambda c=change: db.execute(update(type(version)).where(type(version).id == version.id).values(**c)))
        assert "immutable" in str(err) or "set once" in str(err)
    refused(db, lambda: db.execute(text("DELETE FROM adapter_versions WHERE id = :id"), {"id": version.id}))


def test_adapter_version_numbers_are_unique_and_ready_needs_ready_at(db):
    adapter = make_adapter(db, tenant=make_tenant(db))
    make_adapter_version(db, adapter=adapter, version=1)
    err = refused(db, lambda: make_adapter_version(db, adapter=adapter, version=1))
    assert "uq_adapter_versions_adapter_id_version" in str(err)
    v2 = make_adapter_version(db, adapter=adapter)
    assert v2.version == 2
    v2.status = AdapterStatus.READY
    assert "ck_adapter_versions_ready_has_ready_at" in str(refused(db, db.flush))


def test_override_requires_a_reason(db):
    version = make_adapter_version(db, adapter=make_adapter(db, tenant=make_tenant(db)))
    version.override_at = datetime.now(timezone.utc)
    assert "ck_adapter_versions_override_has_reason" in str(refused(db, db.flush))
    version = db.get(type(version), version.id)
    version.override_at, version.override_reason = datetime.now(timezone.utc), "gate metric noisy on tiny eval set"
    db.commit()


def test_active_version_must_belong_to_the_adapter(db):
    tenant = make_tenant(db)
    a, b = make_adapter(db, tenant=tenant), make_adapter(db, tenant=tenant)
    make_adapter_version(db, adapter=a, activate=True)
    vb = make_adapter_version(db, adapter=b)
    a.active_version_id = vb.id
    assert "fk_adapters_active_version_own" in str(refused(db, db.flush))


def test_adapter_versions_must_share_the_adapters_tenant(db):
    from services.common.models import AdapterVersion

    adapter = make_adapter(db, tenant=make_tenant(db))
    other = make_tenant(db)
    err = refused(db, lambda: db.add(AdapterVersion(
        adapter_id=adapter.id, tenant_id=other.id, version=1, base_model_id=adapter.base_model_id,
        content_sha256="a" * 64, storage_uri="file:///x", size_bytes=1)))
    assert "fk_adapter_versions_adapter_id_tenant_id_adapters" in str(err)


def test_adapter_names_are_unique_among_live_adapters_of_a_tenant(db):
    tenant, other = make_tenant(db), make_tenant(db)
    first = make_adapter(db, tenant=tenant, name="support-bot")
    make_adapter(db, tenant=other, name="support-bot")  # other tenants may use the name
    refused(db, lambda: make_adapter(db, tenant=tenant, name="support-bot"))
    first = db.get(type(first), first.id)
    first.deleted_at = datetime.now(timezone.utc)
    db.commit()
    assert make_adapter(db, tenant=tenant, name="support-bot").id != first.id  # reusable after deletion
    refused(db, lambda: make_adapter(db, tenant=tenant, name="bad@name"))


def test_base_model_names_are_unique(db):
    make_base_model(db, name="shared-base")
    from services.common.models import BaseModelRecord

    refused(db, lambda: db.add(BaseModelRecord(name="shared-base", uri="file:///other")))


# ---------------------------------------------------------------------------------------- identity


def test_tenant_roles_need_a_tenant_and_platform_roles_have_none(db):
    tenant = make_tenant(db)
    make_user(db, tenant=tenant, role=Role.TENANT_ADMIN)
    make_user(db, role=Role.FINANCE)
    for bad in (User(email="a@x.test", password_hash="h", role=Role.TENANT_MEMBER),
                User(email="b@x.test", password_hash="h", role=Role.PLATFORM_ADMIN, tenant_id=tenant.id)):
        assert "ck_users_tenant_matches_role" in str(refused(db, lambda u=bad: db.add(u)))


def test_emails_are_unique_and_lower_case(db):
    user = make_user(db)
    refused(db, lambda: db.add(User(email=user.email, password_hash="h", role=Role.FINANCE)))
    refused(db, lambda: db.add(User(email="Mixed@Case.test", password_hash="h", role=Role.FINANCE)))


def test_key_prefixes_are_unique_and_only_hashes_are_stored(db):
    tenant = make_tenant(db)
    key = make_api_key(db, tenant=tenant, tokens_per_min=100)
    assert key.row.scopes == ["inference"] and key.row.tokens_per_min == 100
    row = db.execute(text("SELECT * FROM api_keys WHERE id = :id"), {"id": key.row.id}).mappings().one()
    assert key.secret not in {str(v) for v in row.values()}
    from services.common.models import ApiKey

    refused(db, lambda: db.add(ApiKey(tenant_id=tenant.id, prefix=key.row.prefix, key_hash="b" * 64, name="dup")))


def test_tenant_slugs_and_limits_are_checked(db):
    tenant = make_tenant(db, limits={"tokens_per_min": 1000, "monthly_token_budget": None})
    db.expire_all()
    assert db.get(Tenant, tenant.id).limits.tokens_per_min == 1000
    refused(db, lambda: db.add(Tenant(name="x", slug="Bad Slug")))
    refused(db, lambda: make_tenant(db, slug=tenant.slug))
    refused(db, lambda: make_tenant(db, limits={"requests_per_min": -1}))


def test_audit_log_is_append_only(db):
    admin = make_user(db)
    entry = AuditLog(actor_user_id=admin.id, action="tenant.suspend", target_type="tenant", target_id="x", details={"why": "test"})
    db.add(entry)
    db.commit()
    refused(db, lambda: db.execute(update(AuditLog).where(AuditLog.id == entry.id).values(action="tenant.resume")))


def test_usage_status_values_are_checked(db):
    tenant = make_tenant(db)
    refused(db, lambda: db.execute(text(
        "INSERT INTO usage_events (request_id, tenant_id, model, base_model, prompt_tokens, completion_tokens, status,"
        " http_status, created_at) VALUES ('r-bad', :t, 'm', 'm', 1, 1, 'partial', 200, now())"), {"t": tenant.id}))
    assert UsageStatus("cancelled") is UsageStatus.CANCELLED
