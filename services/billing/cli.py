"""`mplex billing ...`: cost reports, roll-ups, statements, engine samples and the price book."""
from __future__ import annotations

import sys
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, help="Billing: price book, roll-ups, statements, finance reports.")


def _day(value: str, name: str) -> date:
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"expected YYYY-MM-DD, got {value!r}", param_hint=name) from None


def _when(value: str | None) -> datetime:
    """An ISO time (naive = UTC), or now."""
    if not value:
        return datetime.now(timezone.utc)
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(f"expected an ISO time, got {value!r}", param_hint="--effective-from") from None
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _runtime():
    from services.billing.config import BillingConfig
    from services.common.db import get_db_engine, make_sessionmaker
    from services.common.settings import get_settings

    return BillingConfig.from_settings(get_settings()), make_sessionmaker(get_db_engine())


@app.command()
def report(
    from_: str = typer.Option(..., "--from", help="First day (UTC), YYYY-MM-DD"),
    to: str = typer.Option(..., "--to", help="Last day (UTC, inclusive), YYYY-MM-DD"),
    format: str = typer.Option("csv", "--format", help="csv | json"),
    output: Path = typer.Option(None, "--output", "-o", help="Write to this file (default: stdout)"),
) -> None:
    """Per-tenant cost report: requests, tokens, billed, attributed compute cost, margin (docs/billing.md)."""
    from services.billing.reports import ReportError, build_report, report_csv, report_json_bytes

    if format not in ("csv", "json"):
        raise typer.BadParameter("csv or json", param_hint="--format")
    config, factory = _runtime()
    with factory() as s:
        try:
            rep = build_report(s, config, day_from=_day(from_, "--from"), day_to=_day(to, "--to"))
        except ReportError as exc:
            raise typer.BadParameter(str(exc)) from None
    data = report_csv(rep) if format == "csv" else report_json_bytes(rep)
    if output is None:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    else:
        output.write_bytes(data)
        typer.echo(f"wrote {output} ({len(rep.tenants)} tenants)", err=True)


@app.command()
def rollup(
    day: list[str] = typer.Option(None, "--day", help="Recompute this day (repeatable); default: everything pending"),
    from_: str = typer.Option(None, "--from", help="Recompute a range of days: first day"),
    to: str = typer.Option(None, "--to", help="Recompute a range of days: last day (inclusive)"),
) -> None:
    """Aggregate the ledger into daily rows (idempotent). After changing past prices, re-run those days."""
    from services.billing.rollup import rollup_days, rollup_pending

    days = [_day(d, "--day") for d in day or ()]
    if from_ or to:
        if not (from_ and to):
            raise typer.BadParameter("--from and --to go together")
        a, b = _day(from_, "--from"), _day(to, "--to")
        days += [a + timedelta(days=i) for i in range((b - a).days + 1)]
    config, factory = _runtime()
    with factory() as s:
        r = rollup_days(s, config, days) if days else rollup_pending(s, config)
    typer.echo(f"{len(r.days)} day(s) rolled up: {r.rows} rows, {r.changed} changed")


@app.command()
def statements(
    month: str = typer.Option(..., "--month", help="A closed month, YYYY-MM"),
) -> None:
    """Issue the month's statements (a new revision only where the data changed)."""
    from services.billing.money import format_usd
    from services.billing.rollup import rollup_pending
    from services.billing.statements import StatementError, issue_statements, parse_month

    config, factory = _runtime()
    with factory() as s:
        try:
            period = parse_month(month)
            rollup_pending(s, config)
            results = issue_statements(s, config, period=period)
        except StatementError as exc:
            raise typer.BadParameter(str(exc), param_hint="--month") from None
    for r in results:
        money = f"{format_usd(r.total_micros)} USD" if r.total_micros is not None else ""
        typer.echo(f"{r.tenant_id}  {r.status:9}  rev {r.revision or '-'}  {money}  {r.reason or ''}".rstrip())
    if any(r.status == "refused" for r in results):
        raise typer.Exit(1)


@app.command("sample-engines")
def sample_engines_cmd() -> None:
    """Record one busy/idle window per live engine from the registry (the beat does this periodically)."""
    import redis

    from services.billing.engines import sample_engines
    from services.common.embedded import resolve_urls
    from services.common.settings import get_settings

    settings = get_settings()
    client = redis.Redis.from_url(settings.redis_url or resolve_urls(settings).redis_url)
    _, factory = _runtime()
    for w in sample_engines(factory, client):
        typer.echo(f"{w.engine_id}  {w.window_start.isoformat()} .. {w.window_end.isoformat()}  busy {w.busy_us} us  idle {w.idle_us} us")


@app.command("set-price")
def set_price(
    base_model: str = typer.Option(...), plan: str = typer.Option("default"),
    input: int = typer.Option(..., help="micro-USD per 1M prompt tokens"),
    cached_input: int = typer.Option(..., help="micro-USD per 1M cached prompt tokens"),
    output: int = typer.Option(..., help="micro-USD per 1M completion tokens"),
    adapter_surcharge: int = typer.Option(0, help="micro-USD per 1M tokens of adapter requests"),
    effective_from: str = typer.Option(None, help="ISO time (UTC); default: now"),
) -> None:
    """Add a list price row (rows are never edited; a change is a new effective-dated row)."""
    from services.billing.pricebook import set_list_price

    when = _when(effective_from)
    _, factory = _runtime()
    with factory() as s:
        set_list_price(s, base_model=base_model, plan=plan, effective_from=when, input=input, cached_input=cached_input,
                       output=output, adapter_surcharge=adapter_surcharge)
        s.commit()
    typer.echo(f"price for {base_model}/{plan} from {when.isoformat()}")


@app.command("set-engine-price")
def set_engine_price_cmd(
    name: str = typer.Option(..., help="Engine type, e.g. H100"),
    price_per_hour: int = typer.Option(..., help="micro-USD per engine-hour"),
    effective_from: str = typer.Option(None, help="ISO time (UTC); default: now"),
) -> None:
    from services.billing.pricebook import set_engine_price

    when = _when(effective_from)
    _, factory = _runtime()
    with factory() as s:
        set_engine_price(s, name=name, effective_from=when, price_per_hour=price_per_hour)
        s.commit()
    typer.echo(f"engine type {name}: {price_per_hour} micro-USD/h from {when.isoformat()}")


@app.command("seed-demo-prices")
def seed_demo_prices_cmd(base_model: str = typer.Option("mplex-demo"), plan: list[str] = typer.Option(["default"])) -> None:
    """Demo list and engine-hour prices where none exist (idempotent; `make up` seeding)."""
    from services.billing.pricebook import seed_demo_prices

    _, factory = _runtime()
    with factory() as s:
        n = seed_demo_prices(s, base_model=base_model, plans=plan)
        s.commit()
    typer.echo(f"{n} price row(s) added")
