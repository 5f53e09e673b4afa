/** Display formatting for counts, percentages, times and limits (money lives in money.ts). */

const intFmt = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

export function formatInt(n: number | bigint | null | undefined): string {
  if (n === null || n === undefined) return "—";
  return intFmt.format(n);
}

/** 0.1234 -> "12.3%". */
export function formatPercent(fraction: number | null | undefined, digits = 1): string {
  if (fraction === null || fraction === undefined || !Number.isFinite(fraction)) return "—";
  return `${(fraction * 100).toFixed(digits)}%`;
}

/** A metric value as people read it: integers grouped, fractions to 4 significant digits. */
export function formatMetric(v: unknown): string {
  if (typeof v === "number") {
    if (Number.isInteger(v)) return formatInt(v);
    return Number(v.toPrecision(4)).toString();
  }
  if (typeof v === "boolean") return v ? "yes" : "no";
  if (v === null || v === undefined) return "—";
  if (typeof v === "string") return v;
  return JSON.stringify(v);
}

/** "2025-01-31 14:05 UTC": one unambiguous clock for everyone, as the API speaks UTC. */
export function formatDateTime(iso: string | null | undefined): string {
  if (!iso) return "—";
  const d = new Date(iso);
  if (Number.isNaN(d.getTime())) return iso;
  return `${d.toISOString().slice(0, 16).replace("T", " ")} UTC`;
}

/** "just now", "5 min ago", "3 h ago", "2 d ago". */
export function relativeTime(iso: string | null | undefined, now: Date): string {
  if (!iso) return "never";
  const t = new Date(iso).getTime();
  if (Number.isNaN(t)) return iso;
  const s = Math.round((now.getTime() - t) / 1000);
  if (s < 0) return "just now";
  if (s < 45) return s < 5 ? "just now" : `${s} s ago`;
  const m = Math.round(s / 60);
  if (m < 60) return `${m} min ago`;
  const h = Math.round(m / 60);
  if (h < 48) return `${h} h ago`;
  return `${Math.round(h / 24)} d ago`;
}

export function formatLimit(limit: number | null | undefined): string {
  return limit === null || limit === undefined ? "unlimited" : formatInt(limit);
}

/** Share of a limit used, clamped to [0, 1]; null for unlimited. */
export function meterFraction(used: number, limit: number | null | undefined): number | null {
  if (limit === null || limit === undefined) return null;
  if (limit <= 0) return used > 0 ? 1 : 0;
  return Math.max(0, Math.min(1, used / limit));
}

export type MeterLevel = "ok" | "warn" | "over";

export function meterLevel(fraction: number | null): MeterLevel {
  if (fraction === null || fraction < 0.8) return "ok";
  return fraction < 1 ? "warn" : "over";
}

/** A long hash as its first characters, for tables. */
export function shortHash(h: string | null | undefined, n = 12): string {
  if (!h) return "—";
  return h.length > n ? `${h.slice(0, n)}…` : h;
}

/** 1536 -> "1.5 KB" (powers of 1024, as file pickers show). */
export function formatBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !Number.isFinite(n)) return "—";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}
