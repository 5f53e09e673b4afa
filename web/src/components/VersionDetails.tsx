/** One adapter version: lifecycle steps, progress, rejection reasons, gate metrics, and (admins) override. */
import { useState } from "preact/hooks";
import type { AdapterVersion, VersionStatus } from "../api/types";
import { useApp } from "../context";
import { formatDateTime, formatMetric, formatPercent, shortHash } from "../lib/format";
import { gateSummary, type GateCheck, type GateRow } from "../lib/gate";
import { useAction } from "../lib/useAction";
import { Badge, isInFlight } from "./Badge";
import { FormError, TableScroll } from "./Status";

const ORDER: VersionStatus[] = ["uploaded", "validating", "evaluating"];

type StepState = "done" | "current" | "todo" | "failed" | "skipped";

/** Where each lifecycle step stands. `evaluated`: the gate ran (a rejection without it came from validation). */
export function stepState(step: string, status: VersionStatus, evaluated: boolean): StepState {
  if (status === "rejected" && !evaluated) {
    if (step === "validating") return "failed";
    if (step === "evaluating") return "skipped";
  }
  if (step === "final") return isInFlight(status) ? "todo" : "done";
  const at = ORDER.indexOf(status);
  const i = ORDER.indexOf(step as VersionStatus);
  if (at === -1) return "done"; // terminal: every earlier step is behind us
  return i < at ? "done" : i === at ? "current" : "todo";
}

const STEP_NOTE: Record<StepState, string> = { done: " (done)", current: " (current)", todo: "", failed: " (failed)", skipped: " (skipped)" };

export function VersionSteps({ status, evaluated = true }: { status: VersionStatus; evaluated?: boolean }) {
  const finalLabel = status === "rejected" ? "rejected" : "ready";
  const steps = [...ORDER.map((s) => ({ key: s, label: s })), { key: "final", label: finalLabel }];
  return (
    <ol class="steps" data-testid="version-steps" aria-label="Lifecycle">
      {steps.map((s) => {
        const st = stepState(s.key, status, evaluated);
        const bad = st === "failed" || (s.key === "final" && status === "rejected");
        const cls = st === "failed" ? "step-done" : st === "skipped" ? "step-skipped" : `step-${st}`;
        return (
          <li
            key={s.key}
            class={`step ${cls} ${bad ? "step-bad" : ""}`}
            data-state={st}
            aria-current={st === "current" || (s.key === "final" && st === "done") ? "step" : undefined}
          >
            <span class="step-dot" aria-hidden="true" />
            {s.label}
            {st === "skipped" && <span class="small"> (skipped)</span>}
            <span class="sr-only">{st === "skipped" ? "" : STEP_NOTE[st]}</span>
          </li>
        );
      })}
    </ol>
  );
}

export function VersionDetails(props: { version: AdapterVersion; canOverride: boolean; onChanged?: (v: AdapterVersion) => void }) {
  const v = props.version;
  const inFlight = isInFlight(v.status);
  const percent = Math.max(0, Math.min(100, Math.round(v.progress?.percent ?? 0)));
  return (
    <div class="version" data-testid="version-details">
      <div class="version-head">
        <h2 class="h3">
          {v.adapter_name} <span class="muted">v{v.version}</span>
        </h2>
        <Badge text={v.status} testid="version-status" />
      </div>
      <VersionSteps status={v.status} evaluated={v.eval !== null} />
      {inFlight && (
        <div class="version-progress">
          <label for={`vp-${v.id}`}>Progress</label>
          <progress id={`vp-${v.id}`} max={100} value={percent} data-testid="version-progress" />
          <span data-testid="version-step">
            {percent}%{v.progress?.step ? ` · ${v.progress.step}` : ""}
          </span>
        </div>
      )}
      <p class="sr-only" aria-live="polite" data-testid="version-live">
        {inFlight ? `Status: ${v.status}, ${percent}%${v.progress?.step ? `, ${v.progress.step}` : ""}` : `Status: ${v.status}`}
      </p>

      {v.reasons.length > 0 && (
        <div class={v.status === "rejected" ? "reasons reasons-bad" : "reasons"} data-testid="rejection-reasons">
          <h3 class="h4">{v.status === "rejected" ? "Why it was rejected" : "Notes"}</h3>
          <ul>
            {v.reasons.map((r, i) => (
              <li key={`${r.code}-${i}`}>
                <code>{r.code}</code> {r.message}
              </li>
            ))}
          </ul>
        </div>
      )}

      {v.eval ? <GateResults version={v} /> : !inFlight && v.status === "ready" ? <p class="muted">No quality-gate run recorded for this version.</p> : null}

      <dl class="meta">
        <div>
          <dt>Rank</dt>
          <dd>{v.rank ?? "—"}</dd>
        </div>
        <div>
          <dt>Target modules</dt>
          <dd>{v.target_modules?.length ? v.target_modules.join(", ") : "—"}</dd>
        </div>
        <div>
          <dt>Content SHA-256</dt>
          <dd class="mono" title={v.content_sha256 ?? undefined}>
            {shortHash(v.content_sha256, 16)}
          </dd>
        </div>
        <div>
          <dt>Uploaded</dt>
          <dd>{formatDateTime(v.created_at)}</dd>
        </div>
        <div>
          <dt>Ready</dt>
          <dd>{formatDateTime(v.ready_at)}</dd>
        </div>
      </dl>

      {v.override && (
        <p class="notice" data-testid="version-override">
          Overridden by {v.override.by} on {formatDateTime(v.override.at)}: “{v.override.reason}”
        </p>
      )}
      {/* keyed by status: after an override the form starts again from the new state's opposite decision */}
      {/* The gate's verdict can be overruled; validation's cannot (the files are not a loadable adapter). */}
      {props.canOverride && !inFlight && (v.eval !== null || v.status === "ready") && (
        <OverrideForm key={`${v.id}-${v.status}`} version={v} onChanged={props.onChanged} />
      )}
      {props.canOverride && v.status === "rejected" && v.eval === null && !v.override && (
        <p class="muted" data-testid="override-unavailable">
          Rejected by validation, before the quality gate: there is nothing to override. Upload a fixed version instead.
        </p>
      )}
    </div>
  );
}

function GateResults({ version }: { version: AdapterVersion }) {
  const gate = version.eval!;
  const summary = gateSummary(gate);
  return (
    <div class="gate" data-testid="gate-metrics">
      <h3 class="h4">
        Quality gate: <Badge text={gate.passed ? "passed" : "failed"} testid="gate-passed" />
      </h3>
      {summary.flat ? (
        <FlatGateRows rows={summary.flat} />
      ) : (
        <>
          <TableScroll label="Quality gate checks">
            <thead>
              <tr>
                <th scope="col">Check</th>
                <th scope="col" class="num">Result</th>
                <th scope="col" class="num">Required</th>
                <th scope="col">Verdict</th>
              </tr>
            </thead>
            <tbody>
              {summary.checks.map((c) => (
                <tr key={c.id} data-testid={`gate-check-${c.id}`}>
                  <th scope="row" class="wrap">
                    {c.label}
                    {c.message && <div class="muted small check-message">{c.message}</div>}
                  </th>
                  <td class="num">{checkValue(c, c.value)}</td>
                  <td class="num">{c.threshold === null ? "—" : `${c.cmp === "max" ? "≤" : "≥"} ${checkValue(c, c.threshold)}`}</td>
                  <td>{c.pass === null ? "—" : <Badge text={c.pass ? "passed" : "failed"} />}</td>
                </tr>
              ))}
            </tbody>
          </TableScroll>
          <TableScroll label="Scores on the eval set (0 to 1, higher is better)">
            <caption class="caption">Scores on the eval set (0–1, higher is better)</caption>
            <thead>
              <tr>
                <th scope="col">Metric</th>
                <th scope="col" class="num">Base model</th>
                <th scope="col" class="num">Adapter</th>
                <th scope="col" class="num">Adapter, full precision</th>
                <th scope="col" class="num">Adapter − base</th>
              </tr>
            </thead>
            <tbody>
              {summary.scores.map((r) => (
                <tr key={r.name} data-testid={`gate-metric-${r.name}`} class={r.gated ? "row-strong" : undefined}>
                  <th scope="row">
                    {r.name.replace(/_/g, "-")}
                    {r.gated && <span class="muted small"> (gate metric)</span>}
                  </th>
                  <td class="num">{formatMetric(r.base)}</td>
                  <td class="num">{formatMetric(r.adapter)}</td>
                  <td class="num">{formatMetric(r.full)}</td>
                  <td class="num">{signed(r.delta)}</td>
                </tr>
              ))}
            </tbody>
          </TableScroll>
          {summary.facts.length > 0 && (
            <dl class="meta" data-testid="gate-facts">
              {summary.facts.map((f) => (
                <div key={f.label}>
                  <dt>{f.label}</dt>
                  <dd>{f.value}</dd>
                </div>
              ))}
            </dl>
          )}
        </>
      )}
      {gate.examples.length > 0 && <Examples examples={gate.examples} />}
    </div>
  );
}

interface SideBySide {
  prompt: string;
  expected: string;
  base: string;
  adapter: string;
  base_score: number | null;
  adapter_score: number | null;
}

/** The gate's examples in its own shape (services/adapters/gate.py), or null for anything else. */
function sideBySide(ex: unknown): SideBySide | null {
  if (!ex || typeof ex !== "object" || Array.isArray(ex)) return null;
  const e = ex as Record<string, unknown>;
  const text = (k: string) => (typeof e[k] === "string" ? (e[k] as string) : null);
  const score = (k: string) => (typeof e[k] === "number" ? (e[k] as number) : null);
  const [prompt, expected, base, adapter] = [text("prompt"), text("expected"), text("base"), text("adapter")];
  if (prompt === null || expected === null || base === null || adapter === null) return null;
  return { prompt, expected, base, adapter, base_score: score("base_score"), adapter_score: score("adapter_score") };
}

/** Prompt | expected | base | adapter in columns, so a difference is seen at a glance (cards on a phone). */
function Examples({ examples }: { examples: unknown[] }) {
  const shown = examples.slice(0, 20);
  const rows = shown.map(sideBySide);
  const plain = rows.some((r) => r === null);
  return (
    <details class="examples">
      <summary data-testid="gate-examples-toggle">
        {examples.length} example{examples.length === 1 ? "" : "s"} from the eval set{plain ? "" : ": prompt, expected, base, adapter"}
      </summary>
      {plain ? (
        <ol data-testid="gate-examples">
          {shown.map((ex, i) => (
            <li key={i}>
              <Example value={ex} />
            </li>
          ))}
        </ol>
      ) : (
        <TableScroll label="Examples from the eval set" testid="gate-examples" class="examples-table stack-on-mobile">
          <thead>
            <tr>
              <th scope="col">Prompt</th>
              <th scope="col">Expected</th>
              <th scope="col">Base model</th>
              <th scope="col">Adapter</th>
            </tr>
          </thead>
          <tbody>
            {(rows as SideBySide[]).map((r, i) => (
              <tr key={i} data-testid={`gate-example-${i}`}>
                <td class="wrap" data-label="Prompt">
                  <pre>{r.prompt}</pre>
                </td>
                <td class="wrap" data-label="Expected">
                  <pre>{r.expected}</pre>
                </td>
                <td class="wrap" data-label="Base model">
                  <pre>{r.base}</pre>
                  {r.base_score !== null && <span class="muted small">score {formatMetric(r.base_score)}</span>}
                </td>
                <td class="wrap" data-label="Adapter">
                  <pre>{r.adapter}</pre>
                  {r.adapter_score !== null && (
                    <span class={r.base_score !== null && r.adapter_score < r.base_score ? "small negative" : "muted small"}>
                      score {formatMetric(r.adapter_score)}
                    </span>
                  )}
                </td>
              </tr>
            ))}
          </tbody>
        </TableScroll>
      )}
    </details>
  );
}

function checkValue(c: GateCheck, v: number | null): string {
  if (v === null) return "—";
  return c.format === "signed" ? signed(v) : c.format === "percent" ? formatPercent(v) : formatMetric(v);
}

function signed(v: number | null): string {
  if (v === null) return "—";
  const s = formatMetric(Math.abs(v) < 5e-5 ? 0 : v);
  return v > 0 && !s.startsWith("+") ? `+${s}` : s;
}

/** Metrics of an unknown shape: name, value, and a threshold when one is named after it. */
function FlatGateRows({ rows }: { rows: GateRow[] }) {
  return (
    <TableScroll label="Quality gate metrics">
      <thead>
        <tr>
          <th scope="col">Metric</th>
          <th scope="col" class="num">Value</th>
          <th scope="col" class="num">Threshold</th>
          <th scope="col">Verdict</th>
        </tr>
      </thead>
      <tbody>
        {rows.map((r) => (
          <tr key={r.name} data-testid={`gate-metric-${r.name}`}>
            <th scope="row">{r.name.replace(/_/g, " ")}</th>
            <td class="num">{formatMetric(r.value)}</td>
            <td class="num">
              {r.threshold === undefined ? "—" : `${r.kind === "min" ? "≥ " : r.kind === "max" ? "≤ " : ""}${formatMetric(r.threshold)}`}
            </td>
            <td>{r.pass === null ? "—" : <Badge text={r.pass ? "passed" : "failed"} />}</td>
          </tr>
        ))}
      </tbody>
    </TableScroll>
  );
}

function Example({ value }: { value: unknown }) {
  if (value && typeof value === "object" && !Array.isArray(value)) {
    return (
      <dl class="example">
        {Object.entries(value as Record<string, unknown>).map(([k, v]) => (
          <div key={k}>
            <dt>{k.replace(/_/g, " ")}</dt>
            <dd>{typeof v === "string" ? <pre>{v}</pre> : formatMetric(v)}</dd>
          </div>
        ))}
      </dl>
    );
  }
  return <pre>{typeof value === "string" ? value : JSON.stringify(value, null, 2)}</pre>;
}

function OverrideForm({ version, onChanged }: { version: AdapterVersion; onChanged?: (v: AdapterVersion) => void }) {
  const { client } = useApp();
  const [decision, setDecision] = useState<"ready" | "rejected">(version.status === "ready" ? "rejected" : "ready");
  const [reason, setReason] = useState("");
  const action = useAction();
  const submit = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => {
      const updated = await client.post<AdapterVersion>(`/api/admin/adapter-versions/${encodeURIComponent(version.id)}/override`, {
        decision,
        reason: reason.trim(),
      });
      onChanged?.(updated);
    });
  };
  return (
    <form class="card override" onSubmit={submit} aria-labelledby={`ov-title-${version.id}`} data-testid="override-form">
      <h3 class="h4" id={`ov-title-${version.id}`}>
        Override the gate
      </h3>
      <p class="muted">Recorded in the audit log with your name and reason.</p>
      <div class="row">
        <div class="field">
          <label for={`ov-decision-${version.id}`}>Decision</label>
          <select
            id={`ov-decision-${version.id}`}
            value={decision}
            onChange={(e) => setDecision((e.target as HTMLSelectElement).value as "ready" | "rejected")}
            data-testid="override-decision"
          >
            <option value="ready">ready (route traffic to it)</option>
            <option value="rejected">rejected (stop routing)</option>
          </select>
        </div>
        <div class="field grow">
          <label for={`ov-reason-${version.id}`}>Reason</label>
          <input
            id={`ov-reason-${version.id}`}
            required
            minLength={3}
            value={reason}
            onInput={(e) => setReason((e.target as HTMLInputElement).value)}
            data-testid="override-reason"
          />
        </div>
        <button type="submit" class="btn btn-primary" disabled={action.busy} data-testid="override-submit">
          {action.busy ? "Saving…" : "Override"}
        </button>
      </div>
      <FormError error={action.error} testid="override-error" />
    </form>
  );
}
