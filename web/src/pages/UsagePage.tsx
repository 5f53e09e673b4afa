/** Tenant dashboard: spend and budget (tokens and dollars), quota meters, spend and tokens per day, and a breakdown
 * by adapter, model or API key — for a period kept in the URL (`?from=&to=&by=`), so a view can be shared. */
import type { ChartConfiguration } from "chart.js";
import { useMemo } from "preact/hooks";
import type { KeyUsageReport, Spend, Tenant, UsageFields, UsageReport } from "../api/types";
import { Badge } from "../components/Badge";
import { ChartView, PALETTE } from "../components/ChartView";
import { Meter } from "../components/Meter";
import { PeriodPicker } from "../components/PeriodPicker";
import { Segmented } from "../components/Segmented";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { monthOf, periodFromSearch, searchWithPeriod, toDay, type Period } from "../lib/dates";
import { formatInt } from "../lib/format";
import { columnDecimals, formatUsd, formatUsdFixed } from "../lib/money";
import { navigate, useLocation } from "../lib/router";
import { adapterLabel, fillDays, hasUsage } from "../lib/usage";
import { useApi, type ApiState } from "../lib/useApi";

type Breakdown = "adapter" | "model" | "key";
const BREAKDOWNS: { id: Breakdown; label: string }[] = [
  { id: "adapter", label: "By adapter" },
  { id: "model", label: "By model" },
  { id: "key", label: "By API key" },
];

/** One line of a breakdown, whatever it groups by. */
interface BreakdownRow extends UsageFields {
  id: string;
  label: string;
  revoked?: boolean;
}

export function UsagePage() {
  const { client } = useApp();
  const loc = useLocation();
  const thisMonth = useMemo(() => monthOf(new Date()), []);
  const period = periodFromSearch(loc.search, thisMonth);
  const byParam = new URLSearchParams(loc.search).get("by");
  const by: Breakdown = BREAKDOWNS.some((b) => b.id === byParam) ? (byParam as Breakdown) : "adapter";

  const setPeriod = (p: Period) => navigate(`${loc.path}${searchWithPeriod(loc.search, p)}`);
  const setBy = (b: Breakdown) => {
    const q = new URLSearchParams(loc.search);
    q.set("by", b);
    navigate(`${loc.path}?${q.toString()}`, { replace: true });
  };

  const tenant = useApi((s) => client.get<Tenant>("/api/tenant", undefined, s), []);
  const spend = useApi((s) => client.get<Spend>("/api/tenant/spend", undefined, s), [], { intervalMs: 15_000 });
  const byDay = useApi(
    (s) => client.get<UsageReport>("/api/tenant/usage", { ...period, group_by: "day" }, s),
    [period.from, period.to],
  );
  const breakdown = useApi<BreakdownRow[]>(
    async (s) => {
      if (by === "key") {
        const r = await client.get<KeyUsageReport>("/api/tenant/usage/keys", { ...period }, s);
        return r.rows.map((k) => ({
          ...k,
          id: k.key_id ?? "none",
          label: k.key_name ? `${k.key_name} (${k.key_prefix}…)` : "no API key",
          revoked: k.revoked,
        }));
      }
      const r = await client.get<UsageReport>("/api/tenant/usage", { ...period, group_by: by }, s);
      return r.rows.map((row) => {
        const label = by === "adapter" ? adapterLabel(row.adapter) : (row.model ?? "unknown model");
        return { ...row, id: label, label };
      });
    },
    [period.from, period.to, by],
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
        <h2 id="spend-title">This month: spend, budget and limits</h2>
        <SpendPanel state={spend} />
      </section>

      <section aria-labelledby="usage-title" class="section">
        <h2 id="usage-title">Over time</h2>
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

      <section aria-labelledby="breakdown-title" class="section">
        <div class="row-between">
          <h2 id="breakdown-title">Breakdown</h2>
          <Segmented label="Break usage down" options={BREAKDOWNS} value={by} onChange={setBy} testidPrefix="breakdown" />
        </div>
        <p class="muted small">
          {period.from} to {period.to}
          {by === "key" && " · dollars per key are each day's bill shared out by what each key's tokens cost, so they add up to the total"}
        </p>
        {breakdown.loading ? (
          <Loading label="Loading the breakdown…" testid="breakdown-loading" />
        ) : breakdown.error ? (
          <ErrorBox error={breakdown.error} onRetry={breakdown.reload} testid="breakdown-error" />
        ) : breakdown.data && breakdown.data.length > 0 ? (
          <BreakdownView rows={breakdown.data} by={by} />
        ) : (
          <Empty testid="breakdown-empty">
            <p>No calls in this period, so nothing to break down.</p>
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
  const dollars = s.budget_in_dollars;
  const budgetNote =
    s.budget.monthly_token_budget === null ? (
      "No monthly token budget"
    ) : dollars?.budget_microusd != null ? (
      <span data-testid="budget-dollars" data-microusd={String(dollars.budget_microusd)}>
        ≈ {formatUsd(dollars.used_microusd)} of ≈ {formatUsd(dollars.budget_microusd)} at this month's average{" "}
        {formatUsd(dollars.microusd_per_million_tokens ?? 0)} per 1M tokens
      </span>
    ) : (
      <span data-testid="budget-dollars">In dollars once there is usage this month</span>
    );
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
          <span class="stat-label">Projected for the month</span>
          <span class="stat-value" data-testid="spend-projected" data-microusd={String(s.projected_microusd)}>
            {formatUsd(s.projected_microusd)}
          </span>
          <span class="muted">at the current daily rate</span>
        </div>
      </div>
      {/* One grid, one component: the monthly budget and the per-minute windows read the same way. */}
      <div class="meters" data-testid="meters">
        <Meter label="Monthly token budget" used={s.budget.used_tokens} limit={s.budget.monthly_token_budget} unit="tokens" testid="budget-meter" note={budgetNote} />
        <Meter label="Tokens per minute" used={s.meters.tokens_per_min.used} limit={s.meters.tokens_per_min.limit} testid="meter-tokens-per-min" />
        <Meter label="Requests per minute" used={s.meters.requests_per_min.used} limit={s.meters.requests_per_min.limit} testid="meter-requests-per-min" />
        <Meter label="Concurrent requests" used={s.meters.concurrent.used} limit={s.meters.concurrent.limit} testid="meter-concurrent" />
      </div>
      {state.error && (
        <p class="form-error" role="alert" data-testid="spend-refresh-error">
          Could not refresh: {state.error.message}
        </p>
      )}
    </>
  );
}

/** Chart.js options for an axis of integer micro-USD printed as dollars (tiny bills would read 1.2E-5 otherwise). */
function usdAxis(title: string) {
  return {
    beginAtZero: true,
    title: { display: true, text: title },
    ticks: { precision: 0, callback: (v: string | number) => formatUsd(Math.round(Number(v))) },
  };
}

function DailyUsage({ report, period }: { report: UsageReport; period: Period }) {
  const days = useMemo(() => fillDays(report.rows, period, toDay(new Date())), [report, period]);
  const cumulative = useMemo(() => {
    let sum = 0;
    return days.map((d) => (sum += d.billed_microusd));
  }, [days]);
  const spendConfig = useMemo<ChartConfiguration>(
    () => ({
      type: "bar",
      data: {
        labels: days.map((d) => d.day.slice(5)),
        datasets: [
          { type: "bar", label: "Billed that day", data: days.map((d) => d.billed_microusd), backgroundColor: PALETTE[0], yAxisID: "y" },
          { type: "line", label: "Billed since the period began", data: cumulative, borderColor: PALETTE[5], backgroundColor: PALETTE[5], yAxisID: "y", pointRadius: 2 },
        ],
      },
      options: {
        interaction: { mode: "index", intersect: false },
        scales: { x: { ticks: { maxRotation: 0, autoSkip: true } }, y: usdAxis("USD") },
        plugins: { tooltip: { callbacks: { label: (ctx) => `${ctx.dataset.label}: ${formatUsd(Math.round(Number(ctx.raw)))}` } } },
      },
    }),
    [days, cumulative],
  );
  const tokenConfig = useMemo<ChartConfiguration>(
    () => ({
      type: "bar",
      data: {
        labels: days.map((d) => d.day.slice(5)),
        datasets: [
          { type: "bar", label: "Tokens in", data: days.map((d) => d.prompt_tokens), backgroundColor: PALETTE[0], stack: "tokens", yAxisID: "y" },
          { type: "bar", label: "Tokens out", data: days.map((d) => d.completion_tokens), backgroundColor: PALETTE[1], stack: "tokens", yAxisID: "y" },
          { type: "line", label: "Requests", data: days.map((d) => d.requests), borderColor: PALETTE[2], backgroundColor: PALETTE[2], yAxisID: "y1", pointRadius: 2 },
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
  const shown = days.filter((d) => d.requests > 0 || d.prompt_tokens > 0 || d.completion_tokens > 0);
  const decimals = columnDecimals(shown.map((d) => d.billed_microusd));
  const peak = days.reduce((a, d) => (d.billed_microusd > a.billed_microusd ? d : a), days[0]);
  return (
    <>
      <dl class="totals" data-testid="usage-totals">
        <div>
          <dt>Billed</dt>
          <dd data-testid="usage-total-billed" data-microusd={String(t.billed_microusd)}>{formatUsd(t.billed_microusd)}</dd>
        </div>
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
        {report.batch && report.batch.requests > 0 && (
          <div>
            <dt>of which Batch API</dt>
            <dd data-testid="usage-total-batch">
              {formatInt(report.batch.requests)} requests · {formatInt(report.batch.prompt_tokens + report.batch.completion_tokens)} tokens
            </dd>
          </div>
        )}
      </dl>
      <div class="grid-2 charts">
        <div>
          <h3 class="h4">Spend per day (USD)</h3>
          <ChartView
            config={spendConfig}
            testid="spend-chart"
            label={`Spend per day from ${period.from} to ${period.to}: ${formatUsd(t.billed_microusd)} in total${
              peak && peak.billed_microusd > 0 ? `, most on ${peak.day} (${formatUsd(peak.billed_microusd)})` : ""
            }.`}
          />
        </div>
        <div>
          <h3 class="h4">Tokens and requests per day</h3>
          <ChartView
            config={tokenConfig}
            testid="usage-chart"
            label={`Tokens in and out and requests per day from ${period.from} to ${period.to}: ${formatInt(t.prompt_tokens)} tokens in, ${formatInt(t.completion_tokens)} tokens out, ${formatInt(t.requests)} requests.`}
          />
        </div>
      </div>
      <details class="table-details">
        <summary>Daily numbers as a table</summary>
        <TableScroll label="Daily usage table" testid="usage-table" class="stack-on-mobile">
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
            {shown.map((d) => (
              <tr key={d.day} data-testid={`usage-day-${d.day}`}>
                <th scope="row">{d.day}</th>
                <td class="num" data-label="Requests">{formatInt(d.requests)}</td>
                <td class="num" data-label="Tokens in">{formatInt(d.prompt_tokens)}</td>
                <td class="num" data-label="Cached">{formatInt(d.cached_tokens)}</td>
                <td class="num" data-label="Tokens out">{formatInt(d.completion_tokens)}</td>
                <td class="num" data-label="Billed" data-microusd={String(d.billed_microusd)}>{formatUsdFixed(d.billed_microusd, decimals)}</td>
              </tr>
            ))}
          </tbody>
        </TableScroll>
      </details>
    </>
  );
}

function BreakdownView({ rows, by }: { rows: BreakdownRow[]; by: Breakdown }) {
  const sorted = useMemo(
    () => [...rows].sort((a, b) => b.billed_microusd - a.billed_microusd || b.prompt_tokens + b.completion_tokens - (a.prompt_tokens + a.completion_tokens)),
    [rows],
  );
  const what = BREAKDOWNS.find((b) => b.id === by)!.label.toLowerCase();
  const config = useMemo<ChartConfiguration>(
    () => ({
      type: "bar",
      data: { labels: sorted.map((r) => r.label), datasets: [{ label: "Billed", data: sorted.map((r) => r.billed_microusd), backgroundColor: PALETTE[0] }] },
      options: {
        indexAxis: "y",
        scales: { x: usdAxis("USD"), y: { ticks: { autoSkip: false } } },
        plugins: { legend: { display: false }, tooltip: { callbacks: { label: (ctx) => `Billed: ${formatUsd(Math.round(Number(ctx.raw)))}` } } },
      },
    }),
    [sorted],
  );
  const decimals = columnDecimals(sorted.map((r) => r.billed_microusd));
  const total = sorted.reduce((n, r) => n + r.billed_microusd, 0);
  return (
    <>
      <ChartView
        config={config}
        testid="breakdown-chart"
        height={Math.max(140, 40 + sorted.length * 36)}
        label={`Billed ${what}: ${sorted.map((r) => `${r.label} ${formatUsd(r.billed_microusd)}`).join(", ")}.`}
      />
      <TableScroll label={`Usage ${what}`} testid="breakdown-table" class="stack-on-mobile">
        <thead>
          <tr>
            <th scope="col">{by === "adapter" ? "Adapter" : by === "model" ? "Model" : "API key"}</th>
            <th scope="col" class="num">Requests</th>
            <th scope="col" class="num">Tokens in</th>
            <th scope="col" class="num">Tokens out</th>
            <th scope="col" class="num">Billed</th>
            <th scope="col" class="num">Share</th>
          </tr>
        </thead>
        <tbody>
          {sorted.map((r) => (
            <tr key={r.id} data-testid={`breakdown-row-${r.id}`}>
              <th scope="row">
                {r.label}
                {r.revoked && (
                  <>
                    {" "}
                    <Badge text="revoked" />
                  </>
                )}
              </th>
              <td class="num" data-label="Requests">{formatInt(r.requests)}</td>
              <td class="num" data-label="Tokens in">{formatInt(r.prompt_tokens)}</td>
              <td class="num" data-label="Tokens out">{formatInt(r.completion_tokens)}</td>
              <td class="num" data-label="Billed" data-microusd={String(r.billed_microusd)}>{formatUsdFixed(r.billed_microusd, decimals)}</td>
              <td class="num" data-label="Share">{total > 0 ? `${((100 * r.billed_microusd) / total).toFixed(1)}%` : "—"}</td>
            </tr>
          ))}
        </tbody>
        <tfoot>
          <tr data-testid="breakdown-total">
            <th scope="row">Total</th>
            <td class="num" data-label="Requests">{formatInt(sorted.reduce((n, r) => n + r.requests, 0))}</td>
            <td class="num" data-label="Tokens in">{formatInt(sorted.reduce((n, r) => n + r.prompt_tokens, 0))}</td>
            <td class="num" data-label="Tokens out">{formatInt(sorted.reduce((n, r) => n + r.completion_tokens, 0))}</td>
            <td class="num" data-label="Billed" data-microusd={String(total)}>{formatUsdFixed(total, decimals)}</td>
            <td class="num" data-label="Share">{total > 0 ? "100%" : "—"}</td>
          </tr>
        </tfoot>
      </TableScroll>
    </>
  );
}
