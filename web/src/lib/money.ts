/** Money arrives as integer micro-USD: sum as BigInt, turn into dollars only when printing. */

export type Micro = number | bigint;

const MICRO_PER_USD = 1_000_000n;

/** The amount as a BigInt; refuses fractions and unsafe integers, which would mean a float crept in. */
export function toMicro(value: Micro): bigint {
  if (typeof value === "bigint") return value;
  if (!Number.isSafeInteger(value)) {
    throw new RangeError(`money must be an integer number of micro-USD, got ${value}`);
  }
  return BigInt(value);
}

export function sumMicro(values: Iterable<Micro>): bigint {
  let total = 0n;
  for (const v of values) total += toMicro(v);
  return total;
}

/** Sum one micro-USD field over rows. */
export function sumField<T>(rows: readonly T[], pick: (row: T) => Micro): bigint {
  return sumMicro(rows.map(pick));
}

export interface UsdFormat {
  /** Always show at least this many decimals (cents by default). */
  minDecimals?: number;
  /** Never show more than this many (micro-dollars by default, so small token bills stay visible). */
  maxDecimals?: number;
}

function groupThousands(digits: string): string {
  return digits.replace(/\B(?=(\d{3})+(?!\d))/g, ",");
}

/**
 * `1234500000` -> `$1,234.50`; `1234` -> `$0.001234`; `-2500000` -> `-$2.50`.
 * Rounds half away from zero when maxDecimals < 6, in integer arithmetic.
 */
export function formatUsd(value: Micro, opts: UsdFormat = {}): string {
  const minDecimals = opts.minDecimals ?? 2;
  const maxDecimals = opts.maxDecimals ?? 6;
  if (!(minDecimals >= 0 && maxDecimals <= 6 && minDecimals <= maxDecimals)) {
    throw new RangeError("need 0 <= minDecimals <= maxDecimals <= 6");
  }
  const micro = toMicro(value);
  const negative = micro < 0n;
  let abs = negative ? -micro : micro;
  const unit = 10n ** BigInt(6 - maxDecimals);
  if (unit > 1n) abs = ((abs + unit / 2n) / unit) * unit;
  const dollars = abs / MICRO_PER_USD;
  let frac = (abs % MICRO_PER_USD).toString().padStart(6, "0").slice(0, maxDecimals);
  while (frac.length > minDecimals && frac.endsWith("0")) frac = frac.slice(0, -1);
  const body = `$${groupThousands(dollars.toString())}${frac ? `.${frac}` : ""}`;
  return negative && abs !== 0n ? `-${body}` : body;
}

/** Margin as a share of billed revenue, e.g. 0.25; null when nothing was billed. For display only. */
export function marginRatio(margin: Micro, billed: Micro): number | null {
  const b = toMicro(billed);
  if (b === 0n) return null;
  // Scale in integers first so the division is the only rounding step.
  return Number((toMicro(margin) * 1_000_000n) / b) / 1_000_000;
}

/**
 * How many decimals a money column prints so that all its figures are exact and line up: the most any value
 * needs (micro-USD have six), never fewer than cents.
 */
export function columnDecimals(values: Iterable<Micro>): number {
  let decimals = 2;
  for (const v of values) {
    let frac = toMicro(v) % MICRO_PER_USD;
    if (frac < 0n) frac = -frac;
    let need = 6;
    while (need > decimals && frac % 10n === 0n) {
      frac /= 10n;
      need--;
    }
    if (frac !== 0n) decimals = Math.max(decimals, need);
  }
  return decimals;
}

/** `formatUsd` with exactly `decimals` decimals (a column's fixed precision). */
export function formatUsdFixed(value: Micro, decimals: number): string {
  return formatUsd(value, { minDecimals: decimals, maxDecimals: decimals });
}
