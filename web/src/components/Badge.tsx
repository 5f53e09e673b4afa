/** Small status labels; the visible text is the raw status so tests and people read the same word. */
import type { VersionStatus } from "../api/types";

const TONE: Record<string, string> = {
  ready: "good",
  active: "good",
  passed: "good",
  rejected: "bad",
  suspended: "bad",
  revoked: "bad",
  expired: "bad",
  failed: "bad",
  unhealthy: "bad",
  healthy: "good",
  degraded: "warn",
  temporary: "info",
  uploaded: "info",
  validating: "info",
  evaluating: "info",
  completed: "good",
  in_progress: "info",
  finalizing: "info",
  cancelling: "warn",
  cancelled: "warn",
};

export function Badge(props: { text: string; testid?: string; tone?: string }) {
  return (
    <span class={`badge badge-${props.tone ?? TONE[props.text] ?? "neutral"}`} data-testid={props.testid}>
      {props.text}
    </span>
  );
}

export const TERMINAL: ReadonlySet<VersionStatus> = new Set(["ready", "rejected"]);

export function isInFlight(status: VersionStatus): boolean {
  return !TERMINAL.has(status);
}
