/** Finance report logic: sortable columns, exact integer totals, the CSV link. */
import type { FinanceRow } from "../api/types";
import { buildQuery } from "../api/client";
import type { Period } from "./dates";
import { marginRatio, sumField, toMicro } from "./money";
import type { SortKey } from "./sort";

export type FinanceColumn =
  | "tenant"
  | "requests"
  | "prompt_tokens"
  | "cached_tokens"
  | "completion_tokens"
  | "billed"
  | "cost"
  | "margin"
  | "margin_pct";

export interface ColumnDef {
  id: FinanceColumn;
  label: string;
  numeric: boolean;
  key: (r: FinanceRow) => SortKey;
}

export const FINANCE_COLUMNS: ColumnDef[] = [
  { id: "tenant", label: "Tenant", numeric: false, key: (r) => r.tenant_name },
  { id: "requests", label: "Requests", numeric: true, key: (r) => r.requests },
  { id: "prompt_tokens", label: "Tokens in", numeric: true, key: (r) => r.prompt_tokens },
  { id: "cached_tokens", label: "Cached", numeric: true, key: (r) => r.cached_tokens },
  { id: "completion_tokens", label: "Tokens out", numeric: true, key: (r) => r.completion_tokens },
  { id: "billed", label: "Billed", numeric: true, key: (r) => toMicro(r.billed_microusd) },
  { id: "cost", label: "Attributed cost", numeric: true, key: (r) => toMicro(r.compute_cost_microusd) },
  { id: "margin", label: "Margin", numeric: true, key: (r) => toMicro(r.margin_microusd) },
  { id: "margin_pct", label: "Margin %", numeric: true, key: (r) => marginRatio(r.margin_microusd, r.billed_microusd) },
];

export function columnDef(id: FinanceColumn): ColumnDef {
  const c = FINANCE_COLUMNS.find((x) => x.id === id);
  if (!c) throw new Error(`unknown column ${id}`);
  return c;
}

export interface FinanceTotals {
  requests: bigint;
  prompt_tokens: bigint;
  cached_tokens: bigint;
  completion_tokens: bigint;
  billed_microusd: bigint;
  compute_cost_microusd: bigint;
  margin_microusd: bigint;
}

/** Column sums over the rows, all in integers: a total never drifts from the rows it adds up. */
export function financeTotals(rows: readonly FinanceRow[]): FinanceTotals {
  return {
    requests: sumField(rows, (r) => r.requests),
    prompt_tokens: sumField(rows, (r) => r.prompt_tokens),
    cached_tokens: sumField(rows, (r) => r.cached_tokens),
    completion_tokens: sumField(rows, (r) => r.completion_tokens),
    billed_microusd: sumField(rows, (r) => r.billed_microusd),
    compute_cost_microusd: sumField(rows, (r) => r.compute_cost_microusd),
    margin_microusd: sumField(rows, (r) => r.margin_microusd),
  };
}

/** The fields where the server's totals disagree with the sum of its rows (empty when consistent). */
export function totalsMismatch(computed: FinanceTotals, server: Record<string, number> | null | undefined): string[] {
  if (!server) return [];
  return (Object.keys(computed) as (keyof FinanceTotals)[]).filter(
    (k) => typeof server[k] === "number" && toMicro(server[k]) !== computed[k],
  );
}

export function csvUrl(period: Period): string {
  return `/api/finance/report.csv${buildQuery({ from: period.from, to: period.to })}`;
}
