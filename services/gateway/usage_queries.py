"""Ledger queries the request path needs (rarely: only when a Redis month counter must be re-seeded)."""
from __future__ import annotations

import uuid
from datetime import datetime, timezone

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from services.common.models import UsageEvent


def month_start(now: datetime | None = None) -> datetime:
    now = now or datetime.now(timezone.utc)
    return now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)


def tokens_this_month(session_factory: sessionmaker[Session], kind: str, scope_id: str) -> int:
    """Prompt + completion tokens in the ledger this UTC month for a tenant or a key."""
    column = UsageEvent.tenant_id if kind == "tenant" else UsageEvent.api_key_id
    with session_factory() as s:
        total = s.execute(
            select(func.coalesce(func.sum(UsageEvent.prompt_tokens + UsageEvent.completion_tokens), 0))
            .where(column == uuid.UUID(scope_id), UsageEvent.created_at >= month_start())
        ).scalar_one()
    return int(total)
