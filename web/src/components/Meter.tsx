/** A quota or budget gauge: used vs limit, "unlimited" when there is no limit. Every meter has the same three
 * lines (label and figure, bar, note), so meters side by side line up whatever they measure. */
import type { ComponentChildren } from "preact";
import { formatInt, formatLimit, formatPercent, meterFraction, meterLevel } from "../lib/format";

export function Meter(props: {
  label: string;
  used: number | null;
  limit: number | null;
  unit?: string;
  testid: string;
  /** A second line under the bar (e.g. the budget in dollars); a blank line keeps the rows level. */
  note?: ComponentChildren;
}) {
  const fraction = props.used === null ? null : meterFraction(props.used, props.limit);
  const level = meterLevel(fraction);
  const unit = props.unit ? ` ${props.unit}` : "";
  const used = props.used === null ? "—" : formatInt(props.used);
  const text = props.limit === null ? `${used}${unit} · no limit` : `${used} of ${formatLimit(props.limit)}${unit}`;
  return (
    <div class={`meter meter-${level}${props.limit === null ? " meter-unlimited" : ""}`} data-testid={props.testid}>
      <div class="meter-head">
        <span class="meter-label" id={`${props.testid}-label`}>
          {props.label}
        </span>
        <span class="meter-value" data-testid={`${props.testid}-value`}>
          {text}
          {fraction !== null && <span class="muted"> ({formatPercent(fraction, 0)})</span>}
        </span>
      </div>
      <div
        class="meter-track"
        role="meter"
        aria-labelledby={`${props.testid}-label`}
        aria-valuemin={0}
        aria-valuemax={props.limit ?? undefined}
        aria-valuenow={props.used ?? 0}
        aria-valuetext={props.used === null ? "not available" : text}
      >
        <div class="meter-fill" style={{ width: fraction === null ? "0%" : `${(fraction * 100).toFixed(1)}%` }} />
      </div>
      <p class="meter-note muted small" data-testid={`${props.testid}-note`}>
        {props.note ?? (props.limit === null ? "Unlimited" : props.used === null ? "Live counter unavailable" : "\u00a0")}
      </p>
    </div>
  );
}
