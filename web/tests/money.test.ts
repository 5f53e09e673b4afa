import { describe, expect, it } from "vitest";
import { formatUsd, marginRatio, sumField, sumMicro, toMicro } from "../src/lib/money";

describe("formatUsd", () => {
  it.each([
    [0, "$0.00"],
    [1, "$0.000001"],
    [1234, "$0.001234"],
    [10_000, "$0.01"],
    [1_500_000, "$1.50"],
    [1_234_500_000, "$1,234.50"],
    [12_345_678_901_234, "$12,345,678.901234"],
    [-2_500_000, "-$2.50"],
    [-1, "-$0.000001"],
  ])("%s micro-USD -> %s", (micro, text) => {
    expect(formatUsd(micro)).toBe(text);
  });

  it("rounds half away from zero in integers when fewer decimals are asked for", () => {
    expect(formatUsd(1_005_000, { maxDecimals: 2 })).toBe("$1.01");
    expect(formatUsd(1_004_999, { maxDecimals: 2 })).toBe("$1.00");
    expect(formatUsd(-1_005_000, { maxDecimals: 2 })).toBe("-$1.01");
    expect(formatUsd(999_995_000, { maxDecimals: 2 })).toBe("$1,000.00");
    expect(formatUsd(4_999, { maxDecimals: 2 })).toBe("$0.00");
  });

  it("never prints a negative zero", () => {
    expect(formatUsd(-4_999, { maxDecimals: 2 })).toBe("$0.00");
  });

  it("formats BigInt totals beyond 2^53 exactly", () => {
    const big = 2n ** 60n; // 1,152,921,504,606.846976 USD
    expect(formatUsd(big)).toBe("$1,152,921,504,606.846976");
  });

  it("shows whole dollars with minDecimals 0", () => {
    expect(formatUsd(7_000_000, { minDecimals: 0 })).toBe("$7");
  });

  it("rejects impossible options", () => {
    expect(() => formatUsd(1, { minDecimals: 3, maxDecimals: 2 })).toThrow(RangeError);
    expect(() => formatUsd(1, { maxDecimals: 7 })).toThrow(RangeError);
  });
});

describe("toMicro / sumMicro", () => {
  it("refuses fractional or unsafe amounts instead of silently rounding", () => {
    expect(() => toMicro(0.5)).toThrow(RangeError);
    expect(() => toMicro(Number.MAX_SAFE_INTEGER + 1)).toThrow(RangeError);
    expect(() => toMicro(Number.NaN)).toThrow(RangeError);
    expect(toMicro(Number.MAX_SAFE_INTEGER)).toBe(9_007_199_254_740_991n);
  });

  it("sums without float drift: ten dimes are exactly a dollar", () => {
    const dimes = Array.from({ length: 10 }, () => 100_000);
    expect(sumMicro(dimes)).toBe(1_000_000n);
    expect(formatUsd(sumMicro(dimes))).toBe("$1.00");
    // the float way gets this wrong: 0.1 added ten times is 0.9999999999999999
    expect(Array.from({ length: 10 }, () => 0.1).reduce((a, b) => a + b, 0)).not.toBe(1);
  });

  it("keeps totals exact past Number.MAX_SAFE_INTEGER", () => {
    const total = sumMicro([Number.MAX_SAFE_INTEGER, Number.MAX_SAFE_INTEGER, 2]);
    expect(total).toBe(18_014_398_509_481_984n);
  });

  it("sums a field over rows", () => {
    expect(sumField([{ v: 3 }, { v: -1 }, { v: 5 }], (r) => r.v)).toBe(7n);
    expect(sumField([], (r: { v: number }) => r.v)).toBe(0n);
  });
});

describe("marginRatio", () => {
  it("is margin over billed, null when nothing was billed", () => {
    expect(marginRatio(250_000, 1_000_000)).toBe(0.25);
    expect(marginRatio(-500_000, 1_000_000)).toBe(-0.5);
    expect(marginRatio(10, 0)).toBeNull();
  });
});
