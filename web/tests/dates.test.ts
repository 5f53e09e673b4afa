import { describe, expect, it } from "vitest";
import { daysIn, isDay, lastNDays, monthOf, parseDay, periodProblem, periodPresets } from "../src/lib/dates";

const at = (iso: string) => new Date(iso);

describe("monthOf", () => {
  it("is the UTC calendar month, including leap February", () => {
    expect(monthOf(at("2024-02-10T12:00:00Z"))).toEqual({ from: "2024-02-01", to: "2024-02-29" });
    expect(monthOf(at("2025-02-10T12:00:00Z"))).toEqual({ from: "2025-02-01", to: "2025-02-28" });
  });

  it("crosses year boundaries both ways", () => {
    expect(monthOf(at("2025-01-15T00:00:00Z"), -1)).toEqual({ from: "2024-12-01", to: "2024-12-31" });
    expect(monthOf(at("2024-12-15T00:00:00Z"), 1)).toEqual({ from: "2025-01-01", to: "2025-01-31" });
  });

  it("uses UTC, not the local clock, near midnight", () => {
    expect(monthOf(at("2025-03-31T23:59:59Z"))).toEqual({ from: "2025-03-01", to: "2025-03-31" });
    expect(monthOf(at("2025-04-01T00:00:00Z"))).toEqual({ from: "2025-04-01", to: "2025-04-30" });
  });
});

describe("days", () => {
  it("lists a period inclusively", () => {
    expect(daysIn({ from: "2024-02-27", to: "2024-03-01" })).toEqual(["2024-02-27", "2024-02-28", "2024-02-29", "2024-03-01"]);
    expect(daysIn({ from: "2025-01-01", to: "2025-01-01" })).toEqual(["2025-01-01"]);
  });

  it("is empty for reversed or invalid periods", () => {
    expect(daysIn({ from: "2025-01-02", to: "2025-01-01" })).toEqual([]);
    expect(daysIn({ from: "nope", to: "2025-01-01" })).toEqual([]);
  });

  it("rejects impossible calendar days", () => {
    expect(parseDay("2025-02-30")).toBeNull();
    expect(isDay("2025-13-01")).toBe(false);
    expect(isDay("2025-1-01")).toBe(false);
    expect(isDay("2024-02-29")).toBe(true);
  });

  it("counts the last N days including today", () => {
    expect(lastNDays(at("2025-03-02T10:00:00Z"), 7)).toEqual({ from: "2025-02-24", to: "2025-03-02" });
  });
});

describe("periodProblem", () => {
  it("explains what is wrong, or returns null", () => {
    expect(periodProblem({ from: "2025-01-01", to: "2025-01-31" })).toBeNull();
    expect(periodProblem({ from: "", to: "2025-01-31" })).toMatch(/start date/);
    expect(periodProblem({ from: "2025-01-01", to: "x" })).toMatch(/end date/);
    expect(periodProblem({ from: "2025-02-01", to: "2025-01-31" })).toMatch(/not be after/);
  });
});

describe("periodPresets", () => {
  it("offers this month first", () => {
    const p = periodPresets(at("2025-06-15T00:00:00Z"));
    expect(p[0]).toMatchObject({ id: "this-month", period: { from: "2025-06-01", to: "2025-06-30" } });
    expect(p.find((x) => x.id === "last-month")!.period).toEqual({ from: "2025-05-01", to: "2025-05-31" });
  });
});
