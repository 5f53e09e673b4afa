/** Tenant limits as form text: blank means unlimited (null on the wire), otherwise a whole number >= 0. */
import type { Limits } from "../api/types";

export const LIMIT_FIELDS: { key: keyof Limits; label: string; testid: string; unit: string }[] = [
  { key: "tokens_per_min", label: "Tokens per minute", testid: "limit-tokens-per-min", unit: "tokens a minute" },
  { key: "requests_per_min", label: "Requests per minute", testid: "limit-requests-per-min", unit: "requests a minute" },
  { key: "concurrent_requests", label: "Concurrent requests", testid: "limit-concurrent", unit: "requests at once" },
  { key: "monthly_token_budget", label: "Monthly token budget", testid: "limit-monthly-tokens", unit: "tokens a UTC month" },
];

const grouped = new Intl.NumberFormat("en-US", { maximumFractionDigits: 0 });

/** A limit as typed, shown with thousands separators when it is a whole number; anything else is left as it is
 * (parseLimits says what is wrong with it). */
export function formatLimitText(text: string): string {
  const raw = text.trim().replace(/[,_\s]/g, "");
  return /^\d+$/.test(raw) && Number.isSafeInteger(Number(raw)) ? grouped.format(Number(raw)) : text;
}

export type LimitsText = Record<keyof Limits, string>;

export function limitsToText(l: Limits | null | undefined): LimitsText {
  const t = (v: number | null | undefined) => (v === null || v === undefined ? "" : grouped.format(v));
  return {
    tokens_per_min: t(l?.tokens_per_min),
    requests_per_min: t(l?.requests_per_min),
    concurrent_requests: t(l?.concurrent_requests),
    monthly_token_budget: t(l?.monthly_token_budget),
  };
}

export type ParsedLimits = { ok: true; limits: Limits } | { ok: false; problem: string };

export function parseLimits(text: LimitsText): ParsedLimits {
  const out: Partial<Limits> = {};
  for (const f of LIMIT_FIELDS) {
    const raw = text[f.key].trim().replace(/[,_\s]/g, "");
    if (raw === "") {
      out[f.key] = null;
      continue;
    }
    if (!/^\d+$/.test(raw) || !Number.isSafeInteger(Number(raw))) {
      return { ok: false, problem: `${f.label} must be a whole number, or blank for unlimited.` };
    }
    out[f.key] = Number(raw);
  }
  return { ok: true, limits: out as Limits };
}

/** Only the windows the admin filled in: on create, the server gives every other one the new-tenant default. */
export function givenLimits(limits: Limits): Partial<Limits> {
  return Object.fromEntries(Object.entries(limits).filter(([, v]) => v !== null)) as Partial<Limits>;
}

/** "Acme Corp." -> "acme-corp": a URL-safe default the admin can still edit. */
export function slugify(name: string): string {
  return name
    .normalize("NFKD")
    .replace(/[\u0300-\u036f]/g, "")
    .toLowerCase()
    .replace(/[^a-z0-9]+/g, "-")
    .replace(/^-+|-+$/g, "")
    .slice(0, 63);
}
