/** Platform admin: the engine fleet, refreshed every few seconds (can be paused). */
import { useState } from "preact/hooks";
import type { Engine, ListResponse } from "../api/types";
import { Badge } from "../components/Badge";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { formatInt, formatPercent, meterLevel, relativeTime, shortHash } from "../lib/format";
import { useApi } from "../lib/useApi";

export const ENGINES_REFRESH_MS = 3000;
/** Engines heartbeat every second; one silent for this long is probably gone. */
const STALE_MS = 10_000;

export function EnginesPage() {
  const { client } = useApp();
  const [auto, setAuto] = useState(true);
  const engines = useApi((s) => client.get<ListResponse<Engine>>("/api/admin/engines", undefined, s), [], {
    intervalMs: auto ? ENGINES_REFRESH_MS : null,
  });
  const list = engines.data?.data ?? [];
  const now = engines.refreshedAt ?? new Date();
  const totals = list.reduce((a, e) => ({ running: a.running + e.running, waiting: a.waiting + e.waiting, kv: a.kv + e.kv_usage }), { running: 0, waiting: 0, kv: 0 });

  return (
    <>
      <header class="page-head row-between">
        <h1>Engines</h1>
        <div class="row">
          <label class="checkbox">
            <input type="checkbox" checked={auto} onChange={(e) => setAuto((e.target as HTMLInputElement).checked)} data-testid="engines-autorefresh" />
            Refresh every {ENGINES_REFRESH_MS / 1000} s
          </label>
          <button type="button" class="btn btn-small" onClick={engines.reload} disabled={engines.busy} data-testid="engines-refresh">
            Refresh now
          </button>
        </div>
      </header>
      <p class="muted small" aria-live="off" data-testid="engines-refreshed">
        {engines.refreshedAt ? `Updated ${engines.refreshedAt.toISOString().slice(11, 19)} UTC` : ""}
      </p>
      {engines.loading ? (
        <Loading label="Loading engines…" testid="engines-loading" />
      ) : engines.error && !engines.data ? (
        <ErrorBox error={engines.error} onRetry={engines.reload} testid="engines-error" />
      ) : list.length === 0 ? (
        <Empty testid="engines-empty">
          <p>No engine has reported in. Engines register themselves within a second of starting.</p>
        </Empty>
      ) : (
        <>
          {engines.error && (
            <p class="form-error" role="alert" data-testid="engines-refresh-error">
              Could not refresh: {engines.error.message}. Showing the last answer.
            </p>
          )}
          <dl class="totals" data-testid="engines-summary">
            <div>
              <dt>Engines</dt>
              <dd data-testid="engines-count">{list.length}</dd>
            </div>
            <div>
              <dt>Running</dt>
              <dd>{formatInt(totals.running)}</dd>
            </div>
            <div>
              <dt>Queued</dt>
              <dd>{formatInt(totals.waiting)}</dd>
            </div>
            <div>
              <dt>Mean KV use</dt>
              <dd>{formatPercent(totals.kv / list.length, 0)}</dd>
            </div>
          </dl>
          <TableScroll label="Engines" testid="engines-table">
            <thead>
              <tr>
                <th scope="col">Engine</th>
                <th scope="col">Base model</th>
                <th scope="col" class="num">Running</th>
                <th scope="col" class="num">Queue</th>
                <th scope="col">KV cache</th>
                <th scope="col">Adapters in GPU slots</th>
                <th scope="col">Adapters in host memory</th>
                <th scope="col">Heartbeat</th>
              </tr>
            </thead>
            <tbody>
              {list.map((e) => {
                const age = now.getTime() - new Date(e.updated_at).getTime();
                return (
                  <tr key={e.id} data-testid={`engine-row-${e.id}`}>
                    <th scope="row">
                      {e.id}
                      <div class="muted small mono">{e.url}</div>
                    </th>
                    <td>{e.base_model}</td>
                    <td class="num">{formatInt(e.running)}</td>
                    <td class="num" data-testid={`engine-queue-${e.id}`}>
                      {formatInt(e.waiting)}
                    </td>
                    <td>
                      <div class={`kv meter-${meterLevel(e.kv_usage)}`}>
                        <div class="meter-track" role="meter" aria-label={`KV cache use of ${e.id}`} aria-valuemin={0} aria-valuemax={100} aria-valuenow={Math.round(e.kv_usage * 100)}>
                          <div class="meter-fill" style={{ width: `${Math.min(100, e.kv_usage * 100).toFixed(1)}%` }} />
                        </div>
                        <span data-testid={`engine-kv-${e.id}`}>{formatPercent(e.kv_usage, 0)}</span>
                      </div>
                    </td>
                    <td>
                      <AdapterIds ids={e.slot_adapters} />
                    </td>
                    <td>
                      <AdapterIds ids={e.host_adapters} />
                    </td>
                    <td>{age > STALE_MS ? <Badge text="stale" tone="bad" /> : <span class="muted">{relativeTime(e.updated_at, now)}</span>}</td>
                  </tr>
                );
              })}
            </tbody>
          </TableScroll>
        </>
      )}
    </>
  );
}

/** Engines know adapters by content hash; show how many, with the hashes on demand. */
function AdapterIds({ ids }: { ids: string[] }) {
  if (ids.length === 0) return <span class="muted">none</span>;
  return (
    <details class="ids">
      <summary>{ids.length}</summary>
      <ul class="plain-list mono small">
        {ids.map((id) => (
          <li key={id} title={id}>
            {shortHash(id, 12)}
          </li>
        ))}
      </ul>
    </details>
  );
}
