/** Tenant dashboard: spend vs budget and quota meters, usage per day and per adapter for a period. */
import type { ChartConfiguration } from "chart.js";
import { useMemo, useState } from "preact/hooks";
import type { Spend, Tenant, UsageReport } from "../api/types";
import { Badge } from "../components/Badge";
import { ChartView, PALETTE } from "../components/ChartView";
import { Meter } from "../components/Meter";
import { PeriodPicker } from "../components/PeriodPicker";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { monthOf, toDay, type Period } from "../lib/dates";
import { formatInt } from "../lib/format";
import { formatUsd } from "../lib/money";
import { adapterLabel, fillDays, hasUsage } from "../lib/usage";
import { useApi, type ApiState } from "../lib/useApi";

export function UsagePage() {
  const { client } = useApp();
  const [period, setPeriod] = useState<Period>(() => monthOf(new Date()));
  const tenant = useApi((s) => client.get<Tenant>("/api/tenant", undefined, s), []);
  const spend = useApi((s) => client.get<Spend>("/api/tenant/spend", undefined, s), [], { intervalMs: 15_000 });
  const byDay = useApi(
    (s) => client.get<UsageReport>("/api/tenant/usage", { ...period, group_by: "day" }, s),
    [period.from, period.to],
  );
  const byAdapter = useApi(
    (s) => client.get<UsageReport>("/api/tenant/usage", { ...period, group_by: "adapter" }, s),
    [period.from, period.to],
  );

  return (
    <>
      <header class="page-head">
        <h1>Usage</h1>
        {tenant.data && (
          <p class="muted" data-testid="tenant-summary">
            {tenant.data.name} · plan <strong>{tenant.data.plan}</strong> · <Badge text={tenant.data.status} testid="tenant-status" />
          </p>
        )}
      </header>
      {tenant.data?.status === "suspended" && (
        <p class="banner banner-bad" role="alert" data-testid="tenant-suspended">
          This tenant is suspended: API calls are refused until a platform admin reactivates it.
        </p>
      )}
      {tenant.error && <ErrorBox error={tenant.error} onRetry={tenant.reload} testid="tenant-error" />}

      <section aria-labelledby="spend-title" class="section">
        <h2 id="spend-title">Spend and limits this period</h2>
        <SpendPanel state={spend} />
      </section>

      <section aria-labelledby="usage-title" class="section">
        <h2 id="usage-title">Usage over time</h2>
        <PeriodPicker value={period} onApply={setPeriod} idPrefix="usage" busy={byDay.busy} />
        {byDay.loading ? (
          <Loading label="Loading usage…" testid="usage-loading" />
        ) : byDay.error ? (
          <ErrorBox error={byDay.error} onRetry={byDay.reload} testid="usage-error" />
        ) : byDay.data && !hasUsage(byDay.data.totals) ? (
          <Empty testid="usage-empty">
            <p>
              No usage between {period.from} and {period.to}. Calls made with this tenant's API keys show up here once they
              finish.
            </p>
          </Empty>
        ) : byDay.data ? (
          <DailyUsage report={byDay.data} period={period} />
        ) : null}
      </section>

      <section aria-labelledby="adapter-title" class="section">
        <h2 id="adapter-title">By adapter</h2>
        {byAdapter.loading ? (
          <Loading label="Loading the per-adapter breakdown…" testid="adapter-usage-loading" />
        ) : byAdapter.error ? (
          <ErrorBox error={byAdapter.error} onRetry={byAdapter.reload} testid="adapter-usage-error" />
        ) : byAdapter.data && byAdapter.data.rows.length > 0 ? (
          <AdapterUsage report={byAdapter.data} />
        ) : (
          <Empty testid="adapter-usage-empty">
            <p>No calls in this period, so nothing to break down by adapter.</p>
          </Empty>
        )}
      </section>
    </>
  );
}

function SpendPanel({ state }: { state: ApiState<Spend> }) {
  if (state.loading) return <Loading label="Loading spend…" testid="spend-loading" />;
  if (state.error && !state.data) return <ErrorBox error={state.error} onRetry={state.reload} testid="spend-error" />;
  const s = state.data;
  if (!s) return null;
  return (
    <>
      <div class="cards">
        <div class="card stat">
          <span class="stat-label">Billed so far</span>
          <span class="stat-value" data-testid="spend-total" data-microusd={String(s.billed_microusd)}>
            {formatUsd(s.billed_microusd)}
          </span>
          <span class="muted" data-testid="spend-period">
            {s.period.from} to {s.period.to}
          </span>
        </div>
        <div class="card stat">
          <span class="stat-label">Projected for the period</span>
          <span class="stat-value" data-testid="spend-projected" data-microusd={String(s.projected_microusd)}>
            {formatUsd(s.projected_microusd)}
          </span>
          <span class="muted">at the current daily rate</span>
        </div>
        <div class="card stat stat-wide">
          <Meter
            label="Monthly token budget"
            used={s.budget.used_tokens}
            limit={s.budget.monthly_token_budget}
            unit="tokens"
            testid="budget-meter"
          />
        </div>
      </div>
      <div class="meters card">
        <Meter label="Tokens per minute" used={s.meters.tokens_per_min.used} limit={s.meters.tokens_per_min.limit} testid="meter-tokens-per-min" />
        <Meter label="Requests per minute" used={s.meters.requests_per_min.used} limit={s.meters.requests_per_min.limit} testid="meter-requests-per-min" />
        <Meter label="Concurrent requests" used={s.meters.concurrent.used} limit={s.meters.concurrent.limit} testid="meter-concurrent" />
        <Meter label="Tokens this month" used={s.meters.monthly_tokens.used} limit={s.meters.monthly_tokens.limit} testid="meter-monthly-tokens" />
      </div>
      {state.error && (
        <p class="form-error" role="alert" data-testid="spend-refresh-error">
          Could not refresh: {state.error.message}
        </p>
      )}
    </>
  );
}

function DailyUsage({ report, period }: { report: UsageReport; period: Period }) {
  const days = useMemo(() => fillDays(report.rows, period, toDay(new Date())), [report, period]);
  const config = useMemo<ChartConfiguration>(
    () => ({
      type: "bar",
      data: {
        labels: days.map((d) => d.day.slice(5)),
        datasets: [
          { type: "bar", label: "Tokens in", data: days.map((d) => d.prompt_tokens), backgroundColor: PALETTE[0], stack: "tokens", yAxisID: "y" },
          { type: "bar", label: "Tokens out", data: days.map((d) => d.completion_tokens), backgroundColor: PALETTE[1], stack: "tokens", yAxisID: "y" },
          {
            type: "line",
            label: "Requests",
            data: days.map((d) => d.requests),
            borderColor: PALETTE[2],
            backgroundColor: PALETTE[2],
            yAxisID: "y1",
            pointRadius: 2,
          },
        ],
      },
      options: {
        interaction: { mode: "index", intersect: false },
        scales: {
          x: { stacked: true, ticks: { maxRotation: 0, autoSkip: true } },
          y: { stacked: true, beginAtZero: true, title: { display: true, text: "tokens" } },
          y1: { position: "right", beginAtZero: true, grid: { drawOnChartArea: false }, title: { display: true, text: "requests" }, ticks: { precision: 0 } },
        },
      },
    }),
    [days],
  );
  const t = report.totals;
  return (
    <>
      <dl class="totals" data-testid="usage-totals">
        <div>
          <dt>Requests</dt>
          <dd data-testid="usage-total-requests">{formatInt(t.requests)}</dd>
        </div>
        <div>
          <dt>Tokens in</dt>
          <dd data-testid="usage-total-prompt-tokens">{formatInt(t.prompt_tokens)}</dd>
        </div>
        <div>
          <dt>of which cached</dt>
          <dd data-testid="usage-total-cached-tokens">{formatInt(t.cached_tokens)}</dd>
        </div>
        <div>
          <dt>Tokens out</dt>
          <dd data-testid="usage-total-completion-tokens">{formatInt(t.completion_tokens)}</dd>
        </div>
        <div>
          <dt>Billed</dt>
          <dd data-testid="usage-total-billed" data-microusd={String(t.billed_microusd)}>{formatUsd(t.billed_microusd)}</dd>
        </div>
      </dl>
      <ChartView
        config={config}
        testid="usage-chart"
        label={`Tokens in and out and requests per day from ${period.from} to ${period.to}: ${formatInt(t.prompt_tokens)} tokens in, ${formatInt(t.completion_tokens)} tokens out, ${formatInt(t.requests)} requests.`}
      />
      <details class="table-details">
        <summary>Daily numbers as a table</summary>
        <TableScroll label="Daily usage table" testid="usage-table">
          <thead>
            <tr>
              <th scope="col">Day</th>
              <th scope="col" class="num">Requests</th>
              <th scope="col" class="num">Tokens in</th>
              <th scope="col" class="num">Cached</th>
              <th scope="col" class="num">Tokens out</th>
              <th scope="col" class="num">Billed</th>
            </tr>
          </thead>
          <tbody>
            {days
              .filter((d) => d.requests > 0 || d.prompt_tokens > 0 || d.completion_tokens > 0)
              .map((d) => (
                <tr key={d.day} data-testid={`usage-day-${d.day}`}>
                  <th scope="row">{d.day}</th>
                  <td class="num">{formatInt(d.requests)}</td>
                  <td class="num">{formatInt(d.prompt_tokens)}</td>
                  <td class="num">{formatInt(d.cached_tokens)}</td>
                  <td class="num">{formatInt(d.completion_tokens)}</td>
                  <td class="num">{formatUsd(d.billed_microusd)}</td>
                </tr>
              ))}
          </tbody>
        </TableScroll>
      </details>
    </>
  );
}

function AdapterUsage({ report }: { report: UsageReport }) {
  const rows = useMemo(
    () => [...report.rows].sort((a, b) => b.prompt_tokens + b.completion_tokens - (a.prompt_tokens + a.completion_tokens)),
    [report],
  );
  const config = useMemo<ChartConfiguration>(
    () => ({
      type: "bar",
      data: {
        labels: rows.map((r) => adapterLabel(r.adapter)),
        datasets: [
          { label: "Tokens in", data: rows.map((r) => r.prompt_tokens), backgroundColor: PALETTE[0], stack: "t" },
          { label: "Tokens out", data: rows.map((r) => r.completion_tokens), backgroundColor: PALETTE[1], stack: "t" },
        ],
      },
      options: {
        indexAxis: "y",
        scales: { x: { stacked: true, beginAtZero: true, title: { display: true, text: "tokens" } }, y: { stacked: true, ticks: { autoSkip: false } } },
      },
    }),
    [rows],
  );
  return (
    <>
      <ChartView
        config={config}
        testid="adapter-chart"
        height={Math.max(140, 40 + rows.length * 36)}
        label={`Tokens per adapter: ${rows.map((r) => `${adapterLabel(r.adapter)} ${formatInt(r.prompt_tokens + r.completion_tokens)}`).join(", ")}.`}
      />
      <TableScroll label="Usage by adapter" testid="adapter-usage-table">
        <thead>
          <tr>
            <th scope="col">Adapter</th>
            <th scope="col" class="num">Requests</th>
            <th scope="col" class="num">Tokens in</th>
            <th scope="col" class="num">Tokens out</th>
            <th scope="col" class="num">Billed</th>
          </tr>
        </thead>
        <tbody>
          {rows.map((r) => (
            <tr key={r.adapter ?? ""}>
              <th scope="row">{adapterLabel(r.adapter)}</th>
              <td class="num">{formatInt(r.requests)}</td>
              <td class="num">{formatInt(r.prompt_tokens)}</td>
              <td class="num">{formatInt(r.completion_tokens)}</td>
              <td class="num">{formatUsd(r.billed_microusd)}</td>
            </tr>
          ))}
        </tbody>
      </TableScroll>
    </>
  );
}
