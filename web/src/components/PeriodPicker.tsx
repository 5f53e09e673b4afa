/** From/to day inputs with quick presets; the parent applies a period only when it is valid. */
import { useEffect, useState } from "preact/hooks";
import { periodPresets, periodProblem, type Period } from "../lib/dates";

const same = (a: Period, b: Period) => a.from === b.from && a.to === b.to;

export function PeriodPicker(props: { value: Period; onApply: (p: Period) => void; idPrefix: string; busy?: boolean }) {
  const [draft, setDraft] = useState<Period>(props.value);
  const [problem, setProblem] = useState<string | null>(null);
  const presets = periodPresets(new Date());
  // The applied period can change from outside (the URL: back/forward); the inputs follow it.
  useEffect(() => {
    setDraft(props.value);
    setProblem(null);
  }, [props.value.from, props.value.to]);

  const apply = (p: Period) => {
    const why = periodProblem(p);
    setProblem(why);
    if (!why) props.onApply(p);
  };

  return (
    <form
      class="period"
      aria-label="Period"
      onSubmit={(ev) => {
        ev.preventDefault();
        apply(draft);
      }}
    >
      <div class="field">
        <label for={`${props.idPrefix}-from`}>From</label>
        <input
          id={`${props.idPrefix}-from`}
          type="date"
          value={draft.from}
          data-testid="period-from"
          onInput={(e) => setDraft({ ...draft, from: (e.target as HTMLInputElement).value })}
          required
        />
      </div>
      <div class="field">
        <label for={`${props.idPrefix}-to`}>To</label>
        <input
          id={`${props.idPrefix}-to`}
          type="date"
          value={draft.to}
          data-testid="period-to"
          onInput={(e) => setDraft({ ...draft, to: (e.target as HTMLInputElement).value })}
          required
        />
      </div>
      <button type="submit" class="btn btn-primary" data-testid="period-apply" disabled={props.busy}>
        Show
      </button>
      <div class="presets" role="group" aria-label="Quick periods">
        {presets.map((p) => (
          <button
            type="button"
            class="btn btn-small btn-ghost"
            key={p.id}
            data-testid={`period-${p.id}`}
            // Pressed only while the inputs still show the preset that is applied: once the dates are edited
            // (to anything, valid or not) no preset describes what is on screen.
            aria-pressed={same(p.period, props.value) && same(draft, props.value)}
            onClick={() => {
              setDraft(p.period);
              apply(p.period);
            }}
          >
            {p.label}
          </button>
        ))}
      </div>
      {problem && (
        <p class="form-error" role="alert" data-testid="period-error">
          {problem}
        </p>
      )}
    </form>
  );
}
