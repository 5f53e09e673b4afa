/** Lines up the quality gate's metrics with its thresholds so each shows value, bar and verdict. */
import type { GateEval, GateReason } from "../api/types";
import { formatInt, formatMetric, formatPercent } from "./format";

export interface GateRow {
  name: string;
  value: unknown;
  threshold: unknown;
  /** "min": value must be >= threshold; "max": value must be <= threshold; null: unknown direction. */
  kind: "min" | "max" | null;
  /** null when it cannot be decided from the numbers (no threshold, or unknown direction). */
  pass: boolean | null;
}

/**
 * A metric `m` is matched with threshold `min_m` / `max_m` (direction known) or `m` (direction unknown).
 * Thresholds that match no metric still get a row, so nothing the gate checked is hidden.
 */
export function gateRows(gate: GateEval): GateRow[] {
  const metrics = gate.metrics ?? {};
  const thresholds = gate.thresholds ?? {};
  const used = new Set<string>();
  const rows: GateRow[] = [];
  for (const [name, value] of Object.entries(metrics)) {
    let kind: GateRow["kind"] = null;
    let threshold: unknown = undefined;
    for (const [key, k] of [[`min_${name}`, "min"], [`max_${name}`, "max"], [name, null]] as const) {
      if (key in thresholds) {
        threshold = thresholds[key];
        kind = k;
        used.add(key);
        break;
      }
    }
    rows.push({ name, value, threshold, kind, pass: verdict(value, threshold, kind) });
  }
  for (const [key, threshold] of Object.entries(thresholds)) {
    if (!used.has(key)) rows.push({ name: key, value: undefined, threshold, kind: null, pass: null });
  }
  return rows;
}

function verdict(value: unknown, threshold: unknown, kind: GateRow["kind"]): boolean | null {
  if (typeof value !== "number" || typeof threshold !== "number" || kind === null) return null;
  return kind === "min" ? value >= threshold : value <= threshold;
}

/** How a check's number reads: a signed score difference, a share, or a count. */
export type CheckFormat = "signed" | "percent" | "count";

/** One pass/fail check of the gate, with the number it was decided on. */
export interface GateCheck {
  /** The gate's name for it: margin, no_regression, well_formed, logits, fp8_agreement (older runs: margin, fp8). */
  id: string;
  label: string;
  value: number | null;
  threshold: number | null;
  /** "min": passes at or above the threshold; "max": at or below. */
  cmp: "min" | "max" | null;
  format: CheckFormat;
  pass: boolean | null;
  /** The gate's own sentence about it, when it wrote one. */
  message?: string;
}

const CHECK_INFO: Record<string, { label: (metric: string) => string; cmp: "min" | "max" | null; format: CheckFormat }> = {
  margin: { label: (m) => `Beats the base model on ${m}`, cmp: "min", format: "signed" },
  no_regression: { label: (m) => `No regression on base capabilities (${m}: upper bound of the drop)`, cmp: "max", format: "signed" },
  well_formed: { label: () => "Well-formed outputs (share newly empty, undecodable or looping)", cmp: "max", format: "percent" },
  logits: { label: () => "Finite, informative logits (degenerate tokens)", cmp: "max", format: "count" },
  fp8_agreement: { label: () => "Greedy tokens agree, served vs full precision", cmp: "min", format: "percent" },
};

/** The gate's own list of checks, as rows (unknown checks still show, by name). */
export function checksFromReasons(reasons: readonly GateReason[], metric: string): GateCheck[] {
  return reasons.map((r) => {
    const info = CHECK_INFO[r.check] ?? { label: () => r.check.replace(/_/g, " "), cmp: null, format: "count" as const };
    return {
      id: r.check,
      label: info.label(metric.replace(/_/g, "-")),
      value: num(r.value),
      threshold: num(r.threshold),
      cmp: info.cmp,
      format: info.format,
      pass: typeof r.passed === "boolean" ? r.passed : null,
      message: r.message,
    };
  });
}

/** One similarity score on the eval set: base, adapter (served precision), adapter at full precision. */
export interface ScoreRow {
  name: string;
  base: number | null;
  adapter: number | null;
  full: number | null;
  /** adapter - base */
  delta: number | null;
  /** the metric the margin check uses */
  gated: boolean;
}

export interface GateFact {
  label: string;
  value: string;
}

/** The gate's result as people read it; `flat` holds the generic rows when the metrics are not the gate's shape. */
export interface GateSummary {
  checks: GateCheck[];
  scores: ScoreRow[];
  facts: GateFact[];
  flat: GateRow[] | null;
}

const num = (v: unknown): number | null => (typeof v === "number" && Number.isFinite(v) ? v : null);
const obj = (v: unknown): Record<string, unknown> | null =>
  v && typeof v === "object" && !Array.isArray(v) ? (v as Record<string, unknown>) : null;

const CONSUMED = new Set([
  "adapter", "base", "full_precision", "fp8_token_agreement", "fp8_exact_output_match", "served_weight_dtype",
  "latency", "n_examples", "n_skipped", "eval_set", "check", "malformed", "degenerate_logits", "regression",
]);

const QUALITY_CHECK: Record<string, string> = {
  margin: "margin over the base (a task eval set)",
  no_regression: "no regression (no task eval set: the platform's base-capability set)",
};

function evalSetLabel(source: unknown): string | null {
  if (typeof source !== "string" || !source) return null;
  if (source === "tenant") return "the eval set uploaded with this version";
  if (source === "default") return "the platform's default eval set";
  if (source.startsWith("demo:")) return `the demo kit's “${source.slice(5)}” eval set`;
  return source;
}

/**
 * The quality gate's metrics (services/adapters/gate.py): scores of adapter, base and full precision per
 * similarity metric, FP8 token agreement, latency sample, and the thresholds of the two checks.
 */
export function gateSummary(gate: GateEval): GateSummary {
  const m = gate.metrics ?? {};
  const t = gate.thresholds ?? {};
  const adapter = obj(m.adapter);
  const base = obj(m.base);
  if (!adapter || !base) return { checks: [], scores: [], facts: [], flat: gateRows(gate) };
  const full = obj(m.full_precision) ?? {};
  const metric = typeof t.metric === "string" ? t.metric : "rouge_l";

  const names = [...new Set([...Object.keys(adapter), ...Object.keys(base), ...Object.keys(full)])];
  const scores: ScoreRow[] = names.map((name) => {
    const a = num(adapter[name]);
    const b = num(base[name]);
    return { name, base: b, adapter: a, full: num(full[name]), delta: a !== null && b !== null ? a - b : null, gated: name === metric };
  });

  const judge = (value: number | null, threshold: number | null) => (value === null || threshold === null ? null : value >= threshold);
  const margin = scores.find((s) => s.gated)?.delta ?? null;
  const minMargin = num(t.min_margin);
  const agreement = num(m.fp8_token_agreement);
  const minAgreement = num(t.min_fp8_agreement);
  const dtype = typeof m.served_weight_dtype === "string" ? m.served_weight_dtype : "served";
  // The gate reports every check it made; older runs reported none, and their two checks are derived here.
  const checks: GateCheck[] = gate.reasons?.length
    ? checksFromReasons(gate.reasons, metric)
    : [
        { id: "margin", label: `Beats the base model on ${metric.replace(/_/g, "-")}`, value: margin, threshold: minMargin, cmp: "min", format: "signed", pass: judge(margin, minMargin) },
        { id: "fp8", label: `Greedy tokens agree, ${dtype} vs full precision`, value: agreement, threshold: minAgreement, cmp: "min", format: "percent", pass: judge(agreement, minAgreement) },
      ];

  const facts: GateFact[] = [];
  if (typeof m.check === "string") facts.push({ label: "Quality check", value: QUALITY_CHECK[m.check] ?? m.check });
  const source = evalSetLabel(m.eval_set);
  const n = num(m.n_examples);
  if (n !== null) {
    const skipped = num(m.n_skipped);
    facts.push({ label: "Examples", value: `${formatInt(n)}${source ? ` from ${source}` : ""}${skipped ? ` (${formatInt(skipped)} too long, skipped)` : ""}` });
  } else if (source) facts.push({ label: "Eval set", value: source });
  const exact = num(m.fp8_exact_output_match);
  if (exact !== null) facts.push({ label: `Identical outputs, ${dtype} vs full precision`, value: formatPercent(exact) });
  const lat = obj(m.latency);
  if (lat) {
    const b = num(lat.base_ms_per_token);
    const a = num(lat.adapter_ms_per_token);
    if (a !== null && b !== null) facts.push({ label: "Latency per token (base → adapter)", value: `${formatMetric(b)} ms → ${formatMetric(a)} ms` });
    const overhead = num(lat.adapter_overhead);
    if (overhead !== null) facts.push({ label: "Adapter overhead", value: `×${formatMetric(overhead)}` });
  }
  const reg = obj(m.regression);
  if (reg && num(reg.mean_drop) !== null && num(reg.upper_bound) !== null) {
    const pct = num(reg.confidence) !== null ? `${Math.round(100 * num(reg.confidence)!)}% ` : "";
    facts.push({
      label: "Paired drop vs the base",
      value: `mean ${formatMetric(reg.mean_drop)}, ${pct}upper bound ${formatMetric(reg.upper_bound)} over ${formatInt(num(reg.n))} items (${formatInt(num(reg.worse))} worse, ${formatInt(num(reg.better))} better, ${formatInt(num(reg.tied))} unchanged)`,
    });
  }
  const bad = obj(m.malformed);
  if (bad && num(bad.count) !== null) {
    facts.push({ label: "Malformed outputs (where the base's are fine)", value: `${formatInt(num(bad.count))}${n !== null ? ` of ${formatInt(n)}` : ""}` });
  }
  const logits = obj(m.degenerate_logits);
  if (logits && num(logits.tokens) !== null) {
    facts.push({ label: "Degenerate logits", value: `${formatInt(num(logits.tokens))} of ${formatInt(num(logits.checked))} tokens` });
  }
  for (const [k, v] of Object.entries(m)) {
    if (!CONSUMED.has(k)) facts.push({ label: k.replace(/_/g, " "), value: formatMetric(v) });
  }
  return { checks, scores, facts, flat: null };
}
