/** State for a form action: busy while it runs, the error it ended with (shown by FormError). */
import { useCallback, useState } from "preact/hooks";

export interface Action {
  busy: boolean;
  error: Error | null;
  /** Runs `fn`; true when it finished without throwing (its error is kept for display otherwise). */
  run: (fn: () => Promise<unknown>) => Promise<boolean>;
  fail: (error: Error | null) => void;
}

export function useAction(): Action {
  const [busy, setBusy] = useState(false);
  const [error, setError] = useState<Error | null>(null);
  const run = useCallback(async (fn: () => Promise<unknown>) => {
    setBusy(true);
    setError(null);
    try {
      await fn();
      return true;
    } catch (exc) {
      setError(exc instanceof Error ? exc : new Error(String(exc)));
      return false;
    } finally {
      setBusy(false);
    }
  }, []);
  return { busy, error, run, fail: setError };
}
