"""The web app's view of the tenant's batches (`/api/tenant/batches`): the signed-in user's own tenant only;
the same records and shapes as `/v1/batches` (services.gateway.batch_files), plus an ETA for the page."""
from __future__ import annotations

import asyncio
from datetime import datetime, timezone

from fastapi import APIRouter, Query
from fastapi.responses import Response

from services.common.batch_contract import LIST_LIMIT_MAX, BatchStatus
from services.gateway import batch_files as records
from services.gateway.api.batches import store_of, cancel
from services.gateway.deps import GatewayDep, TenantUser

router = APIRouter(prefix="/api/tenant", tags=["tenant"])


def eta_s(b) -> int | None:
    """Seconds left at the rate the batch has answered lines so far (None until it has a rate)."""
    done = b.completed + b.failed
    if b.status != BatchStatus.IN_PROGRESS or not done or b.in_progress_at is None:
        return None
    elapsed = (datetime.now(timezone.utc) - b.in_progress_at).total_seconds()
    return int(elapsed / done * (b.total - done))


@router.get("/batches")
async def list_batches(user: TenantUser, gw: GatewayDep, after: str | None = Query(None, max_length=100),
                       limit: int = Query(20, ge=1, le=LIST_LIMIT_MAX)):
    def get() -> dict:
        with gw.session_factory() as s:
            rows, more = records.list_batches(s, user.tenant_id, after=after, limit=limit)
            return {"data": [{**records.batch_object(b), "eta_s": eta_s(b)} for b in rows], "has_more": more}

    return await asyncio.to_thread(get)


@router.post("/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, user: TenantUser, gw: GatewayDep):
    return await asyncio.to_thread(cancel, gw, user.tenant_id, batch_id)


@router.get("/batch-files/{file_id}/content")
async def download(file_id: str, user: TenantUser, gw: GatewayDep):
    def get() -> tuple[bytes, str]:
        with gw.session_factory() as s:
            row = records.get_file(s, user.tenant_id, file_id)
            return records.read_file(store_of(gw), row), row.filename

    data, filename = await asyncio.to_thread(get)
    safe = "".join(ch for ch in filename if ch.isalnum() or ch in "._-") or "batch.jsonl"
    return Response(data, media_type="application/jsonl", headers={"content-disposition": f'attachment; filename="{safe}"'})
