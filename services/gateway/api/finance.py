"""Finance reports (`/api/finance/report`, `/api/finance/report.csv`): roles finance and platform_admin only.

Both are the bytes `mplex billing report` writes for the same period (services.billing.reports), so the
page, the download and the CLI agree to the micro-dollar.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import Response
from pydantic import BaseModel

from services.billing.config import BillingConfig
from services.billing.reports import ReportError, build_report, csv_filename, report_csv, report_json_bytes
from services.billing.trend import daily_trend
from services.billing.usage import UsageQueryError, parse_period
from services.common.errors import InvalidRequestError
from services.gateway.deps import FinanceUser, GatewayDep, SessionDep

router = APIRouter(prefix="/api/finance", tags=["finance"])

FromQuery = Annotated[str | None, Query(alias="from", description="First day (UTC), YYYY-MM-DD; default: month start")]
ToQuery = Annotated[str | None, Query(description="Last day (UTC, inclusive); default: month end")]


def _report(db, gw, from_: str | None, to: str | None):
    config = BillingConfig.from_settings(gw.settings)
    try:
        day_from, day_to = parse_period(from_, to, config, datetime.now(timezone.utc).date())
        return build_report(db, config, day_from=day_from, day_to=day_to)
    except UsageQueryError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from None
    except ReportError as exc:
        raise InvalidRequestError(str(exc), param="from") from None


@router.get("/report")
def report(user: FinanceUser, db: SessionDep, gw: GatewayDep, from_: FromQuery = None, to: ToQuery = None) -> Response:
    return Response(report_json_bytes(_report(db, gw, from_, to)), media_type="application/json")


@router.get("/report.csv")
def report_as_csv(user: FinanceUser, db: SessionDep, gw: GatewayDep, from_: FromQuery = None, to: ToQuery = None) -> Response:
    rep = _report(db, gw, from_, to)
    return Response(
        report_csv(rep), media_type="text/csv; charset=utf-8",
        headers={"Content-Disposition": f'attachment; filename="{csv_filename(rep.day_from, rep.day_to)}"', "Cache-Control": "no-store"},
    )


class TrendDayOut(BaseModel):
    day: str
    requests: int
    billed_microusd: int
    compute_cost_microusd: int  # attributed to requests
    margin_microusd: int  # billed - attributed cost
    unallocated_cost_microusd: int  # idle engine time that day
    net_margin_microusd: int  # margin - unallocated cost


class TrendOut(BaseModel):
    period: dict[str, str]
    rows: list[TrendDayOut]


@router.get("/trend", response_model=TrendOut, responses={400: {}, 401: {}, 403: {}})
def trend(user: FinanceUser, db: SessionDep, gw: GatewayDep, from_: FromQuery = None, to: ToQuery = None):
    """Per UTC day of the period: revenue, attributed and idle cost, margin before and after idle cost."""
    config = BillingConfig.from_settings(gw.settings)
    try:
        day_from, day_to = parse_period(from_, to, config, datetime.now(timezone.utc).date())
        days = daily_trend(db, config, day_from=day_from, day_to=day_to)
    except UsageQueryError as exc:
        raise InvalidRequestError(str(exc), param=exc.param) from None
    except ReportError as exc:
        raise InvalidRequestError(str(exc), param="from") from None
    return TrendOut(period={"from": day_from.isoformat(), "to": day_to.isoformat()}, rows=[
        TrendDayOut(day=d.day.isoformat(), requests=d.requests, billed_microusd=d.billed_micros,
                    compute_cost_microusd=d.compute_cost_micros, margin_microusd=d.margin_micros,
                    unallocated_cost_microusd=d.idle_cost_micros, net_margin_microusd=d.net_margin_micros)
        for d in days])
