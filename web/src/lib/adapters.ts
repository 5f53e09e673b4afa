/** The adapters table: one row per adapter, live ones first, rejected ones collapsed; search, status, pages. */
import type { Adapter, AdapterVersion } from "../api/types";

export type AdapterGroup = "live" | "in_progress" | "rejected";
export type StatusFilter = "all" | "live" | "in_progress" | "rejected";

export interface AdapterSummary {
  adapter: Adapter;
  /** The highest version number, whatever its status. */
  latest: AdapterVersion | null;
  /** The version the name routes to. */
  active: AdapterVersion | null;
  /** live: routable; in_progress: not routable yet, a version is in the pipeline; rejected: nothing routable or coming. */
  group: AdapterGroup;
  inFlight: boolean;
  lastUpload: string | null;
}

const IN_FLIGHT = new Set(["uploaded", "validating", "evaluating"]);
const collator = new Intl.Collator("en", { numeric: true, sensitivity: "base" });
const GROUP_ORDER: Record<AdapterGroup, number> = { live: 0, in_progress: 1, rejected: 2 };

export function summarize(adapter: Adapter): AdapterSummary {
  const versions = [...adapter.versions].sort((a, b) => b.version - a.version);
  const active = versions.find((v) => v.version === adapter.active_version) ?? null;
  const inFlight = versions.some((v) => IN_FLIGHT.has(v.status));
  const group: AdapterGroup = active ? "live" : inFlight ? "in_progress" : "rejected";
  const lastUpload = versions.reduce<string | null>((t, v) => (t === null || v.created_at > t ? v.created_at : t), null);
  return { adapter, latest: versions[0] ?? null, active, group, inFlight, lastUpload };
}

export function matchesStatus(s: AdapterSummary, filter: StatusFilter): boolean {
  if (filter === "all") return true;
  if (filter === "in_progress") return s.inFlight;
  return s.group === filter;
}

export interface AdapterQuery {
  query: string;
  status: StatusFilter;
  /** Show rejected adapters in the list when the filter does not ask for them by itself. */
  showRejected: boolean;
}

export interface AdapterRows {
  rows: AdapterSummary[];
  /** Rejected adapters matching the search that are collapsed (not in `rows`). */
  hiddenRejected: number;
  /** Adapters matching search and status, collapsed ones included. */
  matching: number;
}

/** Routable adapters first, then those on their way, then rejected ones; by name within each group. */
export function adapterRows(adapters: readonly Adapter[], q: AdapterQuery): AdapterRows {
  const needle = q.query.trim().toLowerCase();
  const matching = adapters
    .map(summarize)
    .filter((s) => (!needle || s.adapter.name.toLowerCase().includes(needle)) && matchesStatus(s, q.status))
    .sort((a, b) => GROUP_ORDER[a.group] - GROUP_ORDER[b.group] || collator.compare(a.adapter.name, b.adapter.name));
  // Rejected uploads (test runs, broken files) stay out of the way unless asked for: by the filter, the toggle or a search.
  const collapse = q.status === "all" && !q.showRejected && !needle;
  const rows = collapse ? matching.filter((s) => s.group !== "rejected") : matching;
  return { rows, hiddenRejected: matching.length - rows.length, matching: matching.length };
}

export interface Page<T> {
  items: T[];
  /** 1-based, clamped to the pages there are. */
  page: number;
  pages: number;
  first: number;
  last: number;
}

export function paginate<T>(rows: readonly T[], page: number, size: number): Page<T> {
  const pages = Math.max(1, Math.ceil(rows.length / size));
  const p = Math.min(Math.max(1, Math.floor(page) || 1), pages);
  const start = (p - 1) * size;
  const items = rows.slice(start, start + size);
  return { items, page: p, pages, first: items.length ? start + 1 : 0, last: start + items.length };
}
