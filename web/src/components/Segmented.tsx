/** A row of toggle buttons choosing one view (aria-pressed on the chosen one), e.g. "By adapter | By model". */
export function Segmented<T extends string>(props: {
  label: string;
  options: { id: T; label: string }[];
  value: T;
  onChange: (id: T) => void;
  testidPrefix: string;
}) {
  return (
    <div class="segmented" role="group" aria-label={props.label}>
      {props.options.map((o) => (
        <button
          key={o.id}
          type="button"
          class="btn btn-small btn-ghost"
          aria-pressed={o.id === props.value}
          data-testid={`${props.testidPrefix}-${o.id}`}
          onClick={() => props.onChange(o.id)}
        >
          {o.label}
        </button>
      ))}
    </div>
  );
}
