/** A quota or budget gauge: used vs limit, "unlimited" when there is no limit. */
import { formatInt, formatLimit, formatPercent, meterFraction, meterLevel } from "../lib/format";

export function Meter(props: { label: string; used: number; limit: number | null; unit?: string; testid: string }) {
  const fraction = meterFraction(props.used, props.limit);
  const level = meterLevel(fraction);
  const unit = props.unit ? ` ${props.unit}` : "";
  const text =
    props.limit === null ? `${formatInt(props.used)}${unit} used · unlimited` : `${formatInt(props.used)} of ${formatLimit(props.limit)}${unit}`;
  return (
    <div class={`meter meter-${level}`} data-testid={props.testid}>
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
        aria-valuenow={props.used}
        aria-valuetext={text}
      >
        <div class="meter-fill" style={{ width: fraction === null ? "0%" : `${(fraction * 100).toFixed(1)}%` }} />
      </div>
    </div>
  );
}
