/** Loading, error and empty states, used by every page the same way. */
import type { ComponentChildren } from "preact";

export function Loading({ label = "Loading…", testid }: { label?: string; testid?: string }) {
  return (
    <p class="state state-loading" role="status" data-testid={testid ?? "loading"}>
      <span class="spinner" aria-hidden="true" />
      {label}
    </p>
  );
}

export function ErrorBox({ error, onRetry, testid }: { error: Error; onRetry?: () => void; testid?: string }) {
  return (
    <div class="state state-error" role="alert" data-testid={testid ?? "error"}>
      <p>
        <strong>Something went wrong.</strong> <span data-testid="error-message">{error.message}</span>
      </p>
      {onRetry && (
        <button type="button" class="btn btn-small" onClick={onRetry}>
          Try again
        </button>
      )}
    </div>
  );
}

export function Empty({ children, testid }: { children: ComponentChildren; testid?: string }) {
  return (
    <div class="state state-empty" data-testid={testid ?? "empty"}>
      {children}
    </div>
  );
}

/** A region whose text changes are read out by screen readers (async results, copy confirmations). */
export function LiveText({ children, testid, class: cls }: { children: ComponentChildren; testid?: string; class?: string }) {
  return (
    <p class={cls ?? "live"} aria-live="polite" data-testid={testid}>
      {children}
    </p>
  );
}

/** An inline error for a form action; role=alert so it is announced when it appears. */
export function FormError({ error, testid }: { error: Error | null; testid?: string }) {
  if (!error) return null;
  return (
    <p class="form-error" role="alert" data-testid={testid ?? "form-error"}>
      {error.message}
    </p>
  );
}

/** A table inside a keyboard-scrollable region: wide tables scroll sideways on narrow screens, not the page — or,
 * with the class `stack-on-mobile` (cells carrying `data-label`), turn into one card per row on a phone. */
export function TableScroll(props: { label: string; testid?: string; class?: string; children: ComponentChildren }) {
  const stacks = (props.class ?? "").split(" ").includes("stack-on-mobile");
  return (
    <div class={stacks ? "table-scroll stacks" : "table-scroll"} tabIndex={0} role="region" aria-label={props.label}>
      <table data-testid={props.testid} class={props.class}>
        {props.children}
      </table>
    </div>
  );
}
