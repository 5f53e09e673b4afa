/** A column header that sorts its table; a real button inside the <th>, with aria-sort on the cell. */
import { ariaSort, type SortState } from "../lib/sort";

export function SortHeader<C extends string>(props: {
  column: C;
  label: string;
  state: SortState<C>;
  onSort: (column: C) => void;
  numeric?: boolean;
}) {
  const active = props.state.column === props.column;
  const arrow = active ? (props.state.dir === "asc" ? "▲" : "▼") : "";
  return (
    <th scope="col" aria-sort={ariaSort(props.state, props.column)} class={props.numeric ? "num" : undefined}>
      <button type="button" class="sort-btn" data-testid={`sort-${props.column}`} onClick={() => props.onSort(props.column)}>
        {props.label}
        <span class="sort-arrow" aria-hidden="true">
          {arrow}
        </span>
      </button>
    </th>
  );
}
