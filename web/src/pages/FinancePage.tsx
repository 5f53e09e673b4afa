/** Finance: per-tenant revenue, attributed cost and margin for a period, the margin left after idle GPU cost, and
 * the trend per day; sortable, exportable as CSV, the period kept in the URL. Money columns print a fixed number
 * of decimals each, so figures line up and none is rounded away. */
import type { ChartConfiguration } from "chart.js";
import { Fragment } from "preact";
import { useMemo, useState } from "preact/hooks";
import type { FinanceReport, FinanceRow, FinanceTrend } from "../api/types";
import { ChartView, PALETTE } from "../components/ChartView";
import { PeriodPicker } from "../components/PeriodPicker";
import { SortHeader } from "../components/SortHeader";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { monthOf, periodFromSearch, searchWithPeriod, type Period } from "../lib/dates";
import { FINANCE_COLUMNS, columnDef, csvUrl, financeTotals, totalsMismatch, type FinanceColumn } from "../lib/finance";
import { formatInt, formatPercent } from "../lib/format";
import { columnDecimals, formatUsd, formatUsdFixed, marginRatio, toMicro, type Micro } from "../lib/money";
import { navigate, useLocation } from "../lib/router";
import { nextSort, sortRows, type SortState } from "../lib/sort";
import { adapterLabel } from "../lib/usage";
import { useApi } from "../lib/useApi";

export function FinancePage() {
  const { client } = useApp();
  const loc = useLocation();
  const thisMonth = useMemo(() => monthOf(new Date()), []);
  const period = periodFromSearch(loc.search, thisMonth);
  const setPeriod = (p: Period) => navigate(`${loc.path}${searchWithPeriod(loc.search, p)}`);
  const report = useApi((s) => client.get<FinanceReport>("/api/finance/report", { ...period }, s), [period.from, period.to]);
  const trend = useApi((s) => client.get<FinanceTrend>("/api/finance/trend", { ...period }, s), [period.from, period.to]);

  return (
    <>
      <header class="page-head row-between">
        <div>
          <h1>Finance</h1>
          <p class="muted">Revenue billed to tenants against the GPU cost of serving them: attributed to their traffic, and idle.</p>
        </div>
        <a class="btn btn-primary" href={client.url(csvUrl(period))} download data-testid="download-csv">
          Download CSV
        </a>
      </header>
      <PeriodPicker value={period} onApply={setPeriod} idPrefix="finance" busy={report.busy} />
      {report.loading ? (
        <Loading label="Loading the report…" testid="finance-loading" />
      ) : report.error ? (
        <ErrorBox error={report.error} onRetry={report.reload} testid="finance-error" />
      ) : report.data && report.data.rows.length === 0 ? (
        <Empty testid="finance-empty">
          <p>
            No billable usage between {period.from} and {period.to}.
            {report.data.unallocated_cost_microusd ? ` Unallocated compute cost: ${formatUsd(report.data.unallocated_cost_microusd)}.` : ""}
          </p>
        </Empty>
      ) : report.data ? (
        <Report report={report.data} />
      ) : null}
      <section class="section" aria-labelledby="trend-title">
        <h2 id="trend-title">Trend per day</h2>
        {trend.loading ? (
          <Loading label="Loading the trend…" testid="finance-trend-loading" />
        ) : trend.error ? (
          <ErrorBox error={trend.error} onRetry={trend.reload} testid="finance-trend-error" />
        ) : trend.data ? (
          <Trend trend={trend.data} />
        ) : null}
      </section>
    </>
  );
}

/** The fixed decimals of each money column, over every figure it shows (rows, breakdowns, totals). */
function moneyDecimals(rows: readonly FinanceRow[], totals: Record<"billed" | "cost" | "margin", Micro>) {
  const all = rows.flatMap((r) => [r, ...r.breakdown]);
  return {
    billed: columnDecimals([...all.map((r) => r.billed_microusd), totals.billed]),
    cost: columnDecimals([...all.map((r) => r.compute_cost_microusd), totals.cost]),
    margin: columnDecimals([...all.map((r) => r.margin_microusd), totals.margin]),
  };
}

type Decimals = ReturnType<typeof moneyDecimals>;

function Report({ report }: { report: FinanceReport }) {
  const [sort, setSort] = useState<SortState<FinanceColumn>>({ column: "billed", dir: "desc" });
  const [open, setOpen] = useState<string | null>(null);
  const totals = useMemo(() => financeTotals(report.rows), [report]);
  const mismatch = totalsMismatch(totals, report.totals as unknown as Record<string, number> | null);
  const rows = useMemo(() => sortRows(report.rows, columnDef(sort.column).key, sort.dir), [report, sort]);
  const onSort = (c: FinanceColumn) => setSort(nextSort(sort, c, columnDef(c).numeric));
  const ratio = marginRatio(totals.margin_microusd, totals.billed_microusd);
  const idle = toMicro(report.unallocated_cost_microusd ?? 0);
  // The server's net margin when it sends one; the same arithmetic otherwise (older gateways).
  const net = report.net_margin_microusd !== undefined ? toMicro(report.net_margin_microusd) : totals.margin_microusd - idle;
  const netRatio = marginRatio(net, totals.billed_microusd);
  const decimals = moneyDecimals(report.rows, { billed: totals.billed_microusd, cost: totals.compute_cost_microusd, margin: totals.margin_microusd });

  return (
    <>
      <p class="muted" data-testid="finance-period">
        {report.period.from} to {report.period.to} · {rows.length} tenant{rows.length === 1 ? "" : "s"}
      </p>
      <div class="cards finance-cards">
        <Stat label="Billed" micro={totals.billed_microusd} testid="finance-total-billed" />
        <Stat label="Attributed cost" micro={totals.compute_cost_microusd} sub="GPU time of tenants' requests" testid="finance-total-cost" />
        <Stat label="Gross margin" micro={totals.margin_microusd} sub={`${formatPercent(ratio)} of billed, before idle cost`} testid="finance-total-margin" />
        <Stat label="Unallocated cost" micro={idle} sub="idle GPU time no tenant used" testid="finance-unallocated" />
        <Stat
          label="Net margin"
          micro={net}
          sub={`${formatPercent(netRatio)} of billed, after idle cost`}
          testid="finance-net-margin"
          strong
        />
      </div>
      {net < 0n && (
        <p class="banner banner-bad" role="status" data-testid="finance-net-negative">
          Serving cost more than it billed: idle GPU time ({formatUsd(idle)}) outweighs the gross margin ({formatUsd(totals.margin_microusd)}).
        </p>
      )}
      {mismatch.length > 0 && (
        <p class="banner banner-bad" role="alert" data-testid="finance-totals-mismatch">
          The server's totals differ from the sum of its rows for: {mismatch.join(", ")}. The figures above are the sum of the rows.
        </p>
      )}
      <FinanceChart rows={rows} />
      <p class="muted small">Margin per tenant is before idle cost, which no tenant caused; the net margin above includes it.</p>
      <TableScroll label="Per-tenant report" testid="finance-table" class="finance stack-on-mobile sortable-head">
        <thead>
          <tr>
            {FINANCE_COLUMNS.map((c) => (
              <SortHeader key={c.id} column={c.id} label={c.label} state={sort} onSort={onSort} numeric={c.numeric} />
            ))}
          </tr>
        </thead>
        <tbody>
          {rows.map((r) => (
            <Fragment key={r.tenant_id}>
              <tr data-testid={`finance-row-${r.tenant_id}`}>
                <th scope="row">
                  {r.breakdown.length > 0 ? (
                    <button
                      type="button"
                      class="link-btn"
                      aria-expanded={open === r.tenant_id}
                      onClick={() => setOpen(open === r.tenant_id ? null : r.tenant_id)}
                      data-testid={`finance-expand-${r.tenant_id}`}
                    >
                      <span aria-hidden="true">{open === r.tenant_id ? "▾ " : "▸ "}</span>
                      {r.tenant_name}
                    </button>
                  ) : (
                    r.tenant_name
                  )}
                </th>
                <Cells row={r} decimals={decimals} />
              </tr>
              {open === r.tenant_id &&
                r.breakdown.map((b, i) => (
                  <tr key={`${r.tenant_id}-${i}`} class="sub-row">
                    <th scope="row">
                      {b.model ?? "—"} / {adapterLabel(b.adapter)}
                      {b.service_tier === "batch" ? " · Batch API" : ""}
                    </th>
                    <Cells row={b} decimals={decimals} />
                  </tr>
                ))}
            </Fragment>
          ))}
        </tbody>
        <tfoot>
          <tr data-testid="finance-totals">
            <th scope="row">Total</th>
            <td class="num" data-label="Requests">{formatInt(totals.requests)}</td>
            <td class="num" data-label="Tokens in">{formatInt(totals.prompt_tokens)}</td>
            <td class="num" data-label="Cached">{formatInt(totals.cached_tokens)}</td>
            <td class="num" data-label="Tokens out">{formatInt(totals.completion_tokens)}</td>
            <td class="num" data-label="Billed">{formatUsdFixed(totals.billed_microusd, decimals.billed)}</td>
            <td class="num" data-label="Attributed cost">{formatUsdFixed(totals.compute_cost_microusd, decimals.cost)}</td>
            <td class="num" data-label="Margin">{formatUsdFixed(totals.margin_microusd, decimals.margin)}</td>
            <td class="num" data-label="Margin %">{formatPercent(ratio)}</td>
          </tr>
        </tfoot>
      </TableScroll>
    </>
  );
}

function Cells({ row, decimals }: { row: Omit<FinanceRow, "tenant_id" | "tenant_name" | "breakdown">; decimals: Decimals }) {
  const ratio = marginRatio(row.margin_microusd, row.billed_microusd);
  return (
    <>
      <td class="num" data-label="Requests">{formatInt(row.requests)}</td>
      <td class="num" data-label="Tokens in">{formatInt(row.prompt_tokens)}</td>
      <td class="num" data-label="Cached">{formatInt(row.cached_tokens)}</td>
      <td class="num" data-label="Tokens out">{formatInt(row.completion_tokens)}</td>
      <td class="num" data-label="Billed" data-microusd={String(row.billed_microusd)}>{formatUsdFixed(row.billed_microusd, decimals.billed)}</td>
      <td class="num" data-label="Attributed cost" data-microusd={String(row.compute_cost_microusd)}>{formatUsdFixed(row.compute_cost_microusd, decimals.cost)}</td>
      <td class={row.margin_microusd < 0 ? "num negative" : "num"} data-label="Margin" data-microusd={String(row.margin_microusd)}>
        {formatUsdFixed(row.margin_microusd, decimals.margin)}
      </td>
      <td class="num" data-label="Margin %">{formatPercent(ratio)}</td>
    </>
  );
}

/** A money figure; `data-microusd` carries the exact integer for tests and scripts. */
function Stat(props: { label: string; micro: bigint | number; sub?: string; testid: string; strong?: boolean }) {
  const negative = toMicro(props.micro) < 0n;
  return (
    <div class={`card stat${props.strong ? " stat-strong" : ""}`}>
      <span class="stat-label">{props.label}</span>
      <span class={negative ? "stat-value negative" : "stat-value"} data-testid={props.testid} data-microusd={String(props.micro)}>
        {formatUsd(props.micro)}
      </span>
      {props.sub && <span class="muted">{props.sub}</span>}
    </div>
  );
}

const usdTicks = { precision: 0, callback: (v: string | number) => formatUsd(Math.round(Number(v))) };

/** Billed vs cost per tenant (in table order). Plotted in integer micro-USD so the axis and tooltips print
 * dollars with the same formatter as the table (tiny demo bills would otherwise read 1.2E-5). */
function FinanceChart({ rows }: { rows: FinanceRow[] }) {
  const shown = rows.slice(0, 20);
  const config = useMemo<ChartConfiguration>(
    () => ({
      type: "bar",
      data: {
        labels: shown.map((r) => r.tenant_name),
        datasets: [
          { label: "Billed", data: shown.map((r) => Number(r.billed_microusd)), backgroundColor: PALETTE[0] },
          { label: "Attributed cost", data: shown.map((r) => Number(r.compute_cost_microusd)), backgroundColor: PALETTE[5] },
        ],
      },
      options: {
        scales: { y: { beginAtZero: true, title: { display: true, text: "USD" }, ticks: usdTicks } },
        plugins: {
          tooltip: { callbacks: { label: (ctx) => `${ctx.dataset.label}: ${formatUsd(Math.round(Number(ctx.raw)))}` } },
        },
      },
    }),
    [rows],
  );
  return (
    <ChartView
      config={config}
      testid="finance-chart"
      label={`Billed and attributed cost per tenant${rows.length > 20 ? " (first 20 in table order)" : ""}: ${shown
        .map((r) => `${r.tenant_name} billed ${formatUsd(r.billed_microusd)}, cost ${formatUsd(r.compute_cost_microusd)}`)
        .join("; ")}.`}
    />
  );
}

/** Revenue, total cost (attributed + idle) and net margin per day, with the same numbers as a table. */
function Trend({ trend }: { trend: FinanceTrend }) {
  const days = trend.rows;
  const config = useMemo<ChartConfiguration>(
    () => ({
      type: "line",
      data: {
        labels: days.map((d) => d.day.slice(5)),
        datasets: [
          { label: "Billed", data: days.map((d) => d.billed_microusd), borderColor: PALETTE[0], backgroundColor: PALETTE[0], pointRadius: 2 },
          {
            label: "Cost (attributed + idle)",
            data: days.map((d) => d.compute_cost_microusd + d.unallocated_cost_microusd),
            borderColor: PALETTE[5],
            backgroundColor: PALETTE[5],
            pointRadius: 2,
          },
          { label: "Net margin", data: days.map((d) => d.net_margin_microusd), borderColor: PALETTE[2], backgroundColor: PALETTE[2], pointRadius: 2, borderDash: [6, 3] },
        ],
      },
      options: {
        interaction: { mode: "index", intersect: false },
        scales: { x: { ticks: { maxRotation: 0, autoSkip: true } }, y: { title: { display: true, text: "USD" }, ticks: usdTicks } },
        plugins: { tooltip: { callbacks: { label: (ctx) => `${ctx.dataset.label}: ${formatUsd(Math.round(Number(ctx.raw)))}` } } },
      },
    }),
    [days],
  );
  const sum = (f: (d: FinanceTrend["rows"][number]) => number) => days.reduce((n, d) => n + f(d), 0);
  const decimals = {
    billed: columnDecimals(days.map((d) => d.billed_microusd)),
    cost: columnDecimals(days.map((d) => d.compute_cost_microusd)),
    idle: columnDecimals(days.map((d) => d.unallocated_cost_microusd)),
    net: columnDecimals(days.map((d) => d.net_margin_microusd)),
  };
  const active = days.filter((d) => d.billed_microusd || d.compute_cost_microusd || d.unallocated_cost_microusd);
  return (
    <>
      <ChartView
        config={config}
        testid="finance-trend-chart"
        label={`Per day from ${trend.period.from} to ${trend.period.to}: billed ${formatUsd(sum((d) => d.billed_microusd))}, cost ${formatUsd(
          sum((d) => d.compute_cost_microusd + d.unallocated_cost_microusd),
        )}, net margin ${formatUsd(sum((d) => d.net_margin_microusd))}.`}
      />
      <details class="table-details">
        <summary data-testid="finance-trend-toggle">Days as a table</summary>
        <TableScroll label="Trend per day" testid="finance-trend-table" class="stack-on-mobile">
          <thead>
            <tr>
              <th scope="col">Day</th>
              <th scope="col" class="num">Requests</th>
              <th scope="col" class="num">Billed</th>
              <th scope="col" class="num">Attributed cost</th>
              <th scope="col" class="num">Idle cost</th>
              <th scope="col" class="num">Net margin</th>
            </tr>
          </thead>
          <tbody>
            {active.map((d) => (
              <tr key={d.day} data-testid={`finance-trend-${d.day}`}>
                <th scope="row">{d.day}</th>
                <td class="num" data-label="Requests">{formatInt(d.requests)}</td>
                <td class="num" data-label="Billed" data-microusd={String(d.billed_microusd)}>{formatUsdFixed(d.billed_microusd, decimals.billed)}</td>
                <td class="num" data-label="Attributed cost">{formatUsdFixed(d.compute_cost_microusd, decimals.cost)}</td>
                <td class="num" data-label="Idle cost" data-microusd={String(d.unallocated_cost_microusd)}>{formatUsdFixed(d.unallocated_cost_microusd, decimals.idle)}</td>
                <td class={d.net_margin_microusd < 0 ? "num negative" : "num"} data-label="Net margin" data-microusd={String(d.net_margin_microusd)}>
                  {formatUsdFixed(d.net_margin_microusd, decimals.net)}
                </td>
              </tr>
            ))}
          </tbody>
        </TableScroll>
      </details>
    </>
  );
}
