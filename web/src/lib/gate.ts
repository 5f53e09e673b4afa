/** Lines up the quality gate's metrics with its thresholds so each shows value, bar and verdict. */
import type { GateEval } from "../api/types";

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
