"""One batch line through the gateway's own request path: the live endpoint's request model, the resolver,
the planner, the router and the engine stream (services.gateway.api.openai.Call), at the engines' `batch`
priority class. What a line's failure means follows the live path's rules of fault:

- the line's own fault (bad body, unknown model, refused or failed by the engine on its own account, lost
  inside an engine): answered with that error, in the error file, never retried;
- no engine could take it and nothing of it ran (all unreachable, draining, overloaded): not answered —
  the line stays pending and the runner offers it again once the fleet has room.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone

from pydantic import ValidationError
from sqlalchemy.exc import SQLAlchemyError

from services.batch.checkpoint import PendingLine
from services.common.batch_contract import ENDPOINTS, SERVICE_TIER, LineState, line_request_id
from services.common.errors import ApiError
from services.common.openai_protocol import error_body, validation_error_body
from services.common.openai_serving import collect, merge, plan_request_async
from services.common.wire import InvalidRequest
from services.gateway.api.openai import Call, as_api_error, failure, open_streams
from services.gateway.batch_input import parse_request
from services.gateway.metering import UsageRecord
from services.gateway.upstream import NoEngineAvailable, StreamResult


@dataclass(frozen=True, slots=True)
class BatchPrincipal:
    """Who a batch's lines run for: the tenant and key that created it (what `Call` reads of a principal)."""

    tenant_id: uuid.UUID
    key_id: uuid.UUID | None
    plan: str
    cache_salt: str  # the tenant's prefix-cache salt, derived server-side as for its live requests

    @property
    def tenant(self) -> str:  # as KeyPrincipal.tenant
        return str(self.tenant_id)


@dataclass(frozen=True, slots=True)
class Answer:
    state: LineState
    status_code: int
    body: dict
    usage: UsageRecord


class NotRun(Exception):
    """No engine could take the line and nothing of it ran: it stays pending, to be offered again."""


async def answer_line(gw, principal: BatchPrincipal, batch_id: uuid.UUID, line: PendingLine) -> Answer:
    """Run one line to its answer (or raise NotRun)."""
    rid = line_request_id(batch_id, line.line_no)
    accepted_at, t0 = datetime.now(timezone.utc), time.monotonic()
    kind = ENDPOINTS[line.url]
    try:
        req = parse_request(line.url, line.body).model_copy(update={"priority": "batch", "stream": False})
        resolved = await gw.resolver.resolve(principal.tenant_id, req.model)
        plan = await plan_request_async(kind, req, gw.resolver.builders[resolved.base.name], resolved.base.max_model_len)
    except ValidationError as exc:
        return _refused(gw, principal, rid, line, accepted_at, 400, validation_error_body(exc.errors(include_url=False)))
    except InvalidRequest as exc:
        err = ApiError.from_invalid_request(exc)
        return _refused(gw, principal, rid, line, accepted_at, err.status, err.body())
    except ApiError as exc:  # the model does not resolve for this tenant (any more)
        return _refused(gw, principal, rid, line, accepted_at, exc.status, exc.body())
    except SQLAlchemyError:
        raise  # the database, not the line: the run stops and its task retries
    except Exception as exc:  # a line that breaks the planner fails alone; it must not stop the batch
        body = error_body(f"This request could not be planned ({exc.__class__.__name__}).", "server_error", None,
                          "request_failed")
        return _refused(gw, principal, rid, line, accepted_at, 500, body)
    call = Call(gw, principal, resolved, plan, None, rid, None, accepted_at, t0, [StreamResult() for _ in plan.jobs],
                service_tier=SERVICE_TIER)
    response_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
    try:
        body, _ = await collect(plan, response_id, req.model, merge(await open_streams(call, req)))
    except NoEngineAvailable as exc:
        raise NotRun(str(exc)) from None
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise
    except Exception as exc:
        status, http_status, code = failure(exc)
        err = as_api_error(exc, gw)
        body = err.body() if isinstance(err, ApiError) else error_body(str(exc), "server_error", None, code)
        u = call.usage(server_failed=http_status >= 500)
        return Answer(LineState.FAILED, http_status, body, call.usage_record(u, status, http_status, code))
    call.delivered = True
    u = call.usage()
    body["usage"] = u.to_dict()
    return Answer(LineState.DONE, 200, body, call.usage_record(u, "ok", 200, None))


def _refused(gw, principal: BatchPrincipal, rid: str, line: PendingLine, accepted_at: datetime, status: int,
             body: dict) -> Answer:
    """A line refused before any engine saw it: answered with the live endpoint's error, metered at 0 tokens."""
    model = line.body.get("model")
    rec = UsageRecord(
        request_id=rid, tenant_id=principal.tenant_id, api_key_id=principal.key_id,
        model=model[:300] if isinstance(model, str) else "", base_model=gw.resolver.default_base.name,
        adapter_version_id=None, prompt_tokens=0, cached_tokens=0, completion_tokens=0, status="error",
        http_status=status, created_at=accepted_at, error_code=(body.get("error") or {}).get("code"),
        service_tier=SERVICE_TIER,
    )
    return Answer(LineState.FAILED, status, body, rec)


def quota_refusal(gw, principal: BatchPrincipal, batch_id: uuid.UUID, line: PendingLine) -> Answer:
    """The tenant's monthly batch token budget is spent: the line is answered 429 without running."""
    body = error_body("Your monthly batch token budget is spent; this request was not run.", "insufficient_quota",
                      None, "batch_quota_exceeded")
    return _refused(gw, principal, line_request_id(batch_id, line.line_no), line, datetime.now(timezone.utc), 429, body)
