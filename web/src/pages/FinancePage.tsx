/** Finance: per-tenant revenue, attributed cost and margin for a period; sortable, charted, exportable as CSV. */
import type { ChartConfiguration } from "chart.js";
import { Fragment } from "preact";
import { useMemo, useState } from "preact/hooks";
import type { FinanceReport, FinanceRow } from "../api/types";
import { ChartView, PALETTE } from "../components/ChartView";
import { PeriodPicker } from "../components/PeriodPicker";
import { SortHeader } from "../components/SortHeader";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { monthOf, type Period } from "../lib/dates";
import { FINANCE_COLUMNS, columnDef, csvUrl, financeTotals, totalsMismatch, type FinanceColumn } from "../lib/finance";
import { formatInt, formatPercent } from "../lib/format";
import { formatUsd, marginRatio } from "../lib/money";
import { nextSort, sortRows, type SortState } from "../lib/sort";
import { adapterLabel } from "../lib/usage";
import { useApi } from "../lib/useApi";

export function FinancePage() {
  const { client } = useApp();
  const [period, setPeriod] = useState<Period>(() => monthOf(new Date()));
  const report = useApi((s) => client.get<FinanceReport>("/api/finance/report", { ...period }, s), [period.from, period.to]);

  return (
    <>
      <header class="page-head row-between">
        <div>
          <h1>Finance</h1>
          <p class="muted">Revenue billed to tenants against the GPU cost attributed to their traffic.</p>
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
    </>
  );
}

function Report({ report }: { report: FinanceReport }) {
  const [sort, setSort] = useState<SortState<FinanceColumn>>({ column: "billed", dir: "desc" });
  const [open, setOpen] = useState<string | null>(null);
  const totals = useMemo(() => financeTotals(report.rows), [report]);
  const mismatch = totalsMismatch(totals, report.totals as unknown as Record<string, number> | null);
  const rows = useMemo(() => sortRows(report.rows, columnDef(sort.column).key, sort.dir), [report, sort]);
  const onSort = (c: FinanceColumn) => setSort(nextSort(sort, c, columnDef(c).numeric));
  const ratio = marginRatio(totals.margin_microusd, totals.billed_microusd);

  return (
    <>
      <p class="muted" data-testid="finance-period">
        {report.period.from} to {report.period.to} · {rows.length} tenant{rows.length === 1 ? "" : "s"}
      </p>
      <div class="cards">
        <Stat label="Billed" micro={totals.billed_microusd} testid="finance-total-billed" />
        <Stat label="Attributed cost" micro={totals.compute_cost_microusd} testid="finance-total-cost" />
        <Stat label="Margin" micro={totals.margin_microusd} sub={formatPercent(ratio)} testid="finance-total-margin" />
        <Stat
          label="Unallocated cost"
          micro={report.unallocated_cost_microusd ?? 0}
          sub="idle GPU time no tenant used"
          testid="finance-unallocated"
        />
      </div>
      {mismatch.length > 0 && (
        <p class="banner banner-bad" role="alert" data-testid="finance-totals-mismatch">
          The server's totals differ from the sum of its rows for: {mismatch.join(", ")}. The figures above are the sum of the rows.
        </p>
      )}
      <FinanceChart rows={rows} />
      <TableScroll label="Per-tenant report" testid="finance-table" class="finance">
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
                <Cells row={r} />
              </tr>
              {open === r.tenant_id &&
                r.breakdown.map((b, i) => (
                  <tr key={`${r.tenant_id}-${i}`} class="sub-row">
                    <th scope="row">
                      {b.model ?? "—"} / {adapterLabel(b.adapter)}
                    </th>
                    <Cells row={b} />
                  </tr>
                ))}
            </Fragment>
          ))}
        </tbody>
        <tfoot>
          <tr data-testid="finance-totals">
            <th scope="row">Total</th>
            <td class="num">{formatInt(totals.requests)}</td>
            <td class="num">{formatInt(totals.prompt_tokens)}</td>
            <td class="num">{formatInt(totals.cached_tokens)}</td>
            <td class="num">{formatInt(totals.completion_tokens)}</td>
            <td class="num">{formatUsd(totals.billed_microusd)}</td>
            <td class="num">{formatUsd(totals.compute_cost_microusd)}</td>
            <td class="num">{formatUsd(totals.margin_microusd)}</td>
            <td class="num">{formatPercent(ratio)}</td>
          </tr>
        </tfoot>
      </TableScroll>
    </>
  );
}

function Cells({ row }: { row: Omit<FinanceRow, "tenant_id" | "tenant_name" | "breakdown"> }) {
  const ratio = marginRatio(row.margin_microusd, row.billed_microusd);
  return (
    <>
      <td class="num">{formatInt(row.requests)}</td>
      <td class="num">{formatInt(row.prompt_tokens)}</td>
      <td class="num">{formatInt(row.cached_tokens)}</td>
      <td class="num">{formatInt(row.completion_tokens)}</td>
      <td class="num">{formatUsd(row.billed_microusd)}</td>
      <td class="num">{formatUsd(row.compute_cost_microusd)}</td>
      <td class={row.margin_microusd < 0 ? "num negative" : "num"}>{formatUsd(row.margin_microusd)}</td>
      <td class="num">{formatPercent(ratio)}</td>
    </>
  );
}

/** A money figure; `data-microusd` carries the exact integer for tests and scripts. */
function Stat(props: { label: string; micro: bigint | number; sub?: string; testid: string }) {
  return (
    <div class="card stat">
      <span class="stat-label">{props.label}</span>
      <span class="stat-value" data-testid={props.testid} data-microusd={String(props.micro)}>
        {formatUsd(props.micro)}
      </span>
      {props.sub && <span class="muted">{props.sub}</span>}
    </div>
  );
}

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
        scales: {
          y: {
            beginAtZero: true,
            title: { display: true, text: "USD" },
            ticks: { precision: 0, callback: (v) => formatUsd(Math.round(Number(v))) },
          },
        },
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
