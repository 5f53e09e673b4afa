/** Days are UTC `YYYY-MM-DD` strings, as in the API; periods are inclusive. */

export interface Period {
  from: string;
  to: string;
}

const DAY_RE = /^(\d{4})-(\d{2})-(\d{2})$/;
const DAY_MS = 86_400_000;

export function toDay(d: Date): string {
  return d.toISOString().slice(0, 10);
}

export function parseDay(day: string): Date | null {
  const m = DAY_RE.exec(day);
  if (!m) return null;
  const d = new Date(Date.UTC(Number(m[1]), Number(m[2]) - 1, Number(m[3])));
  return toDay(d) === day ? d : null;
}

export function isDay(day: string): boolean {
  return parseDay(day) !== null;
}

export function monthOf(now: Date, offsetMonths = 0): Period {
  const y = now.getUTCFullYear();
  const m = now.getUTCMonth() + offsetMonths;
  return { from: toDay(new Date(Date.UTC(y, m, 1))), to: toDay(new Date(Date.UTC(y, m + 1, 0))) };
}

export function lastNDays(now: Date, n: number): Period {
  const today = Date.UTC(now.getUTCFullYear(), now.getUTCMonth(), now.getUTCDate());
  return { from: toDay(new Date(today - (n - 1) * DAY_MS)), to: toDay(new Date(today)) };
}

/** Every day from `from` to `to` inclusive; empty if the period is invalid or reversed. */
export function daysIn(period: Period, maxDays = 400): string[] {
  const a = parseDay(period.from);
  const b = parseDay(period.to);
  if (!a || !b || a > b) return [];
  const out: string[] = [];
  for (let t = a.getTime(); t <= b.getTime() && out.length < maxDays; t += DAY_MS) out.push(toDay(new Date(t)));
  return out;
}

/** Why a period cannot be used, or null when it can. */
export function periodProblem(period: Period): string | null {
  if (!isDay(period.from)) return "Enter a valid start date.";
  if (!isDay(period.to)) return "Enter a valid end date.";
  if (period.from > period.to) return "The start date must not be after the end date.";
  return null;
}

export interface PeriodPreset {
  id: string;
  label: string;
  period: Period;
}

export function periodPresets(now: Date): PeriodPreset[] {
  return [
    { id: "this-month", label: "This month", period: monthOf(now) },
    { id: "last-month", label: "Last month", period: monthOf(now, -1) },
    { id: "last-7", label: "Last 7 days", period: lastNDays(now, 7) },
    { id: "last-30", label: "Last 30 days", period: lastNDays(now, 30) },
  ];
}

/** The period a page's URL names (`?from=&to=`), or `fallback` when it names none or an invalid one. */
export function periodFromSearch(search: string, fallback: Period): Period {
  const q = new URLSearchParams(search);
  const from = q.get("from");
  const to = q.get("to");
  if (from && to && periodProblem({ from, to }) === null) return { from, to };
  return fallback;
}

/** `search` with the period written into it (other parameters kept), as `?…`. */
export function searchWithPeriod(search: string, period: Period): string {
  const q = new URLSearchParams(search);
  q.set("from", period.from);
  q.set("to", period.to);
  return `?${q.toString()}`;
}
