import { describe, expect, it } from "vitest";
import { ariaSort, compareKeys, nextSort, sortRows } from "../src/lib/sort";

type Row = { name: string; v: number | null; m?: bigint };

const rows: Row[] = [
  { name: "b", v: 2 },
  { name: "a", v: null },
  { name: "c", v: 10 },
  { name: "d", v: 2 },
  { name: "e", v: -1 },
];

describe("sortRows", () => {
  it("sorts numbers ascending and descending", () => {
    expect(sortRows(rows, (r) => r.v, "asc").map((r) => r.name)).toEqual(["e", "b", "d", "c", "a"]);
    expect(sortRows(rows, (r) => r.v, "desc").map((r) => r.name)).toEqual(["c", "b", "d", "e", "a"]);
  });

  it("keeps empty values last in both directions", () => {
    expect(sortRows(rows, (r) => r.v, "asc").at(-1)!.name).toBe("a");
    expect(sortRows(rows, (r) => r.v, "desc").at(-1)!.name).toBe("a");
  });

  it("is stable: ties keep input order whichever the direction", () => {
    const desc = sortRows(rows, (r) => r.v, "desc").map((r) => r.name);
    expect(desc.indexOf("b")).toBeLessThan(desc.indexOf("d"));
    const asc = sortRows(rows, (r) => r.v, "asc").map((r) => r.name);
    expect(asc.indexOf("b")).toBeLessThan(asc.indexOf("d"));
  });

  it("compares text naturally and case-insensitively", () => {
    const names = ["tenant10", "Tenant2", "tenant1"].map((name) => ({ name, v: 0 }));
    expect(sortRows(names, (r) => r.name, "asc").map((r) => r.name)).toEqual(["tenant1", "Tenant2", "tenant10"]);
  });

  it("orders BigInt money keys exactly, even 1 micro-USD apart past 2^53", () => {
    const big = [
      { name: "x", v: 0, m: 2n ** 60n + 1n },
      { name: "y", v: 0, m: 2n ** 60n },
      { name: "z", v: 0, m: -5n },
    ];
    expect(sortRows(big, (r) => r.m, "asc").map((r) => r.name)).toEqual(["z", "y", "x"]);
  });

  it("does not modify its input", () => {
    const copy = [...rows];
    sortRows(rows, (r) => r.v, "asc");
    expect(rows).toEqual(copy);
  });
});

describe("compareKeys", () => {
  it("mixes numbers and BigInts correctly", () => {
    expect(compareKeys(1, 2n)).toBe(-1);
    expect(compareKeys(3n, 2)).toBe(1);
    expect(compareKeys(2n, 2)).toBe(0);
  });
});

describe("nextSort / ariaSort", () => {
  it("flips the direction on the same column", () => {
    expect(nextSort({ column: "billed", dir: "desc" }, "billed", true)).toEqual({ column: "billed", dir: "asc" });
    expect(nextSort({ column: "billed", dir: "asc" }, "billed", true)).toEqual({ column: "billed", dir: "desc" });
  });

  it("starts a new numeric column descending and a text column ascending", () => {
    expect(nextSort({ column: "billed", dir: "asc" }, "margin", true)).toEqual({ column: "margin", dir: "desc" });
    expect(nextSort({ column: "billed", dir: "desc" }, "tenant", false)).toEqual({ column: "tenant", dir: "asc" });
  });

  it("reports aria-sort for the header cells", () => {
    expect(ariaSort({ column: "a", dir: "asc" }, "a")).toBe("ascending");
    expect(ariaSort({ column: "a", dir: "desc" }, "a")).toBe("descending");
    expect(ariaSort({ column: "a", dir: "desc" }, "b")).toBe("none");
  });
});
