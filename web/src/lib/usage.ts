/** Shaping usage rows for charts: a point for every day, readable adapter names. */
import type { UsageFields, UsageRow } from "../api/types";
import { daysIn, type Period } from "./dates";

export const ZERO_USAGE: UsageFields = {
  requests: 0,
  prompt_tokens: 0,
  cached_tokens: 0,
  completion_tokens: 0,
  billed_microusd: 0,
};

/**
 * One row per day of the period, zeros where the server sent nothing (it only returns days with usage),
 * so the chart's x axis is time and not "days that happened to have traffic". Stops at `until` (a day) if given.
 */
export function fillDays(rows: readonly UsageRow[], period: Period, until?: string): (UsageFields & { day: string })[] {
  const byDay = new Map<string, UsageRow>();
  for (const r of rows) if (r.day) byDay.set(r.day, r);
  // Days after `until` (today) have not happened yet: leave them off rather than plot them as zero.
  const days = daysIn(period).filter((d) => until === undefined || d <= until);
  // Rows outside the requested period (should not happen) still show rather than vanish.
  for (const d of byDay.keys()) if (!days.includes(d)) days.push(d);
  days.sort();
  return days.map((day) => {
    const r = byDay.get(day);
    return {
      day,
      requests: r?.requests ?? 0,
      prompt_tokens: r?.prompt_tokens ?? 0,
      cached_tokens: r?.cached_tokens ?? 0,
      completion_tokens: r?.completion_tokens ?? 0,
      billed_microusd: r?.billed_microusd ?? 0,
    };
  });
}

/** Usage rows without an adapter are base-model calls. */
export function adapterLabel(adapter: string | null | undefined): string {
  return adapter ? adapter : "base model";
}

export function hasUsage(totals: UsageFields | null | undefined): boolean {
  return !!totals && (totals.requests > 0 || totals.prompt_tokens > 0 || totals.completion_tokens > 0);
}
