/** Load (and optionally poll) an API resource; stale answers from superseded loads are dropped. */
import { useCallback, useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "../api/client";

export interface ApiState<T> {
  data: T | null;
  error: ApiError | Error | null;
  /** True until the first answer (success or error) for the current inputs. */
  loading: boolean;
  /** True while any load is in flight, including background polls. */
  busy: boolean;
  refreshedAt: Date | null;
  reload: () => void;
}

export interface ApiOptions {
  /** Poll this often after each answer; null stops polling (read on every answer, so it may change). */
  intervalMs?: number | null;
}

export function useApi<T>(load: (signal: AbortSignal) => Promise<T>, deps: unknown[], opts: ApiOptions = {}): ApiState<T> {
  const [data, setData] = useState<T | null>(null);
  const [error, setError] = useState<ApiError | Error | null>(null);
  const [loading, setLoading] = useState(true);
  const [busy, setBusy] = useState(true);
  const [refreshedAt, setRefreshedAt] = useState<Date | null>(null);
  const gen = useRef(0);
  const timer = useRef<number | null>(null);
  const controller = useRef<AbortController | null>(null);
  const interval = useRef(opts.intervalMs ?? null);
  const loadRef = useRef(load);
  loadRef.current = load;
  interval.current = opts.intervalMs ?? null;

  const run = useCallback((initial: boolean) => {
    const my = ++gen.current;
    if (timer.current !== null) window.clearTimeout(timer.current);
    timer.current = null;
    controller.current?.abort();
    const ctl = new AbortController();
    controller.current = ctl;
    if (initial) setLoading(true);
    setBusy(true);
    loadRef.current(ctl.signal).then(
      (value) => {
        if (my !== gen.current) return;
        setData(value);
        setError(null);
        setRefreshedAt(new Date());
      },
      (exc: unknown) => {
        if (my !== gen.current) return;
        if (exc instanceof DOMException && exc.name === "AbortError") return;
        setError(exc instanceof Error ? exc : new Error(String(exc)));
      },
    ).finally(() => {
      if (my !== gen.current) return;
      setLoading(false);
      setBusy(false);
      if (interval.current !== null) timer.current = window.setTimeout(() => run(false), interval.current);
    });
  }, []);

  useEffect(() => {
    setData(null);
    setError(null);
    run(true);
    return () => {
      gen.current++;
      controller.current?.abort();
      if (timer.current !== null) window.clearTimeout(timer.current);
      timer.current = null;
    };
  }, deps);

  // Polling switched off: drop the pending poll; switched back on while idle: start the cycle again.
  useEffect(() => {
    if (opts.intervalMs == null && timer.current !== null) {
      window.clearTimeout(timer.current);
      timer.current = null;
    }
    if (opts.intervalMs != null && timer.current === null && !busy) {
      timer.current = window.setTimeout(() => run(false), opts.intervalMs);
    }
  }, [opts.intervalMs, busy, run]);

  const reload = useCallback(() => run(false), [run]);
  return { data, error, loading, busy, refreshedAt, reload };
}
