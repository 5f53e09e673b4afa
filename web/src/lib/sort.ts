/** Sorting for tables: stable, typed keys, empty values always last. */

export type SortDir = "asc" | "desc";
export type SortKey = string | number | bigint | null | undefined;

export interface SortState<C extends string = string> {
  column: C;
  dir: SortDir;
}

const collator = new Intl.Collator("en", { numeric: true, sensitivity: "base" });

export function compareKeys(a: SortKey, b: SortKey): number {
  if (typeof a === "string" && typeof b === "string") return collator.compare(a, b);
  if (typeof a === "string" || typeof b === "string") return collator.compare(String(a), String(b));
  // numbers and bigints compare correctly with < and > across the two types
  if ((a as number | bigint) < (b as number | bigint)) return -1;
  if ((a as number | bigint) > (b as number | bigint)) return 1;
  return 0;
}

function isEmpty(k: SortKey): boolean {
  return k === null || k === undefined || (typeof k === "number" && Number.isNaN(k));
}

/** A sorted copy; ties keep their input order; null/undefined/NaN go last in both directions. */
export function sortRows<T>(rows: readonly T[], key: (row: T) => SortKey, dir: SortDir): T[] {
  const sign = dir === "asc" ? 1 : -1;
  return rows
    .map((row, index) => ({ row, index, k: key(row) }))
    .sort((a, b) => {
      const ea = isEmpty(a.k);
      const eb = isEmpty(b.k);
      if (ea || eb) return ea === eb ? a.index - b.index : ea ? 1 : -1;
      return sign * compareKeys(a.k, b.k) || a.index - b.index;
    })
    .map((x) => x.row);
}

/**
 * The sort after clicking `column`: the same column flips direction; a new column starts
 * descending for numbers (largest first is what people look for) and ascending for text.
 */
export function nextSort<C extends string>(current: SortState<C>, column: C, numeric: boolean): SortState<C> {
  if (current.column === column) return { column, dir: current.dir === "asc" ? "desc" : "asc" };
  return { column, dir: numeric ? "desc" : "asc" };
}

/** The aria-sort value for a header cell. */
export function ariaSort(state: SortState, column: string): "ascending" | "descending" | "none" {
  if (state.column !== column) return "none";
  return state.dir === "asc" ? "ascending" : "descending";
}
