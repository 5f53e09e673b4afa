/** Platform admin: the engine fleet — health, load, the adapters each holds (by name and tenant), and the last
 * minutes of throughput, queue, KV cache and adapter slots; refreshed every few seconds (can be paused). */
import type { ChartConfiguration } from "chart.js";
import { useMemo, useState } from "preact/hooks";
import type { Engine, EngineAdapter, EngineHistory, ListResponse } from "../api/types";
import { Badge } from "../components/Badge";
import { ChartView, PALETTE } from "../components/ChartView";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { formatInt, formatPercent, meterLevel, relativeTime, shortHash } from "../lib/format";
import { useApi } from "../lib/useApi";

export const ENGINES_REFRESH_MS = 3000;
const HISTORY_REFRESH_MS = 5000; // engines add a history sample every 5 s

export function EnginesPage() {
  const { client } = useApp();
  const [auto, setAuto] = useState(true);
  const engines = useApi((s) => client.get<ListResponse<Engine>>("/api/admin/engines", undefined, s), [], {
    intervalMs: auto ? ENGINES_REFRESH_MS : null,
  });
  const history = useApi((s) => client.get<ListResponse<EngineHistory>>("/api/admin/engines/history", undefined, s), [], {
    intervalMs: auto ? HISTORY_REFRESH_MS : null,
  });
  const list = engines.data?.data ?? [];
  const now = engines.refreshedAt ?? new Date();
  const totals = list.reduce((a, e) => ({ running: a.running + e.running, waiting: a.waiting + e.waiting, kv: a.kv + e.kv_usage }), { running: 0, waiting: 0, kv: 0 });
  const unhealthy = list.filter((e) => e.health && e.health.state !== "healthy").length;

  return (
    <>
      <header class="page-head row-between">
        <h1>Engines</h1>
        <div class="row">
          <label class="checkbox">
            <input type="checkbox" checked={auto} onChange={(e) => setAuto((e.target as HTMLInputElement).checked)} data-testid="engines-autorefresh" />
            Refresh every {ENGINES_REFRESH_MS / 1000} s
          </label>
          <button
            type="button"
            class="btn btn-small"
            onClick={() => {
              engines.reload();
              history.reload();
            }}
            disabled={engines.busy}
            data-testid="engines-refresh"
          >
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
              <dt>Not healthy</dt>
              <dd data-testid="engines-unhealthy">{unhealthy}</dd>
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
          <TableScroll label="Engines" testid="engines-table" class="stack-on-mobile">
            <thead>
              <tr>
                <th scope="col">Engine</th>
                <th scope="col">Health</th>
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
                const named = new Map((e.adapters ?? []).map((a) => [a.content_id, a]));
                return (
                  <tr key={e.id} data-testid={`engine-row-${e.id}`}>
                    <th scope="row" class="wrap">
                      {e.id}
                      <div class="muted small mono">{e.url}</div>
                      <div class="muted small">{e.base_model}</div>
                    </th>
                    <td data-label="Health" class="wrap" data-testid={`engine-health-${e.id}`}>
                      {e.health ? (
                        <>
                          <Badge text={e.health.state} />
                          {e.health.reasons.length > 0 && (
                            <ul class="plain-list small reasons-list">
                              {e.health.reasons.map((r) => (
                                <li key={r}>{r}</li>
                              ))}
                            </ul>
                          )}
                        </>
                      ) : (
                        <span class="muted">unknown</span>
                      )}
                    </td>
                    <td class="num" data-label="Running">
                      {formatInt(e.running)}
                    </td>
                    <td class="num" data-label="Queue" data-testid={`engine-queue-${e.id}`}>
                      {formatInt(e.waiting)}
                    </td>
                    <td data-label="KV cache">
                      <div class={`kv meter-${meterLevel(e.kv_usage)}`}>
                        <div class="meter-track" role="meter" aria-label={`KV cache use of ${e.id}`} aria-valuemin={0} aria-valuemax={100} aria-valuenow={Math.round(e.kv_usage * 100)}>
                          <div class="meter-fill" style={{ width: `${Math.min(100, e.kv_usage * 100).toFixed(1)}%` }} />
                        </div>
                        <span data-testid={`engine-kv-${e.id}`}>{formatPercent(e.kv_usage, 0)}</span>
                      </div>
                    </td>
                    <td data-label="GPU slots" class="wrap" data-testid={`engine-slots-${e.id}`}>
                      {e.slots_total != null && (
                        <div class="muted small">
                          {e.slot_adapters.length} of {e.slots_total} slots
                        </div>
                      )}
                      <AdapterNames ids={e.slot_adapters} named={named} />
                    </td>
                    <td data-label="Host memory" class="wrap" data-testid={`engine-host-${e.id}`}>
                      <AdapterNames ids={e.host_adapters} named={named} />
                    </td>
                    <td data-label="Heartbeat">
                      <span class="muted">{relativeTime(e.updated_at, now)}</span>
                    </td>
                  </tr>
                );
              })}
            </tbody>
          </TableScroll>
          <section class="section" aria-labelledby="history-title">
            <h2 id="history-title">Last minutes</h2>
            {history.loading ? (
              <Loading label="Loading the history…" testid="engines-history-loading" />
            ) : history.error && !history.data ? (
              <ErrorBox error={history.error} onRetry={history.reload} testid="engines-history-error" />
            ) : history.data && history.data.data.some((h) => h.samples.length > 0) ? (
              <HistoryCharts history={history.data.data} />
            ) : (
              <Empty testid="engines-history-empty">
                <p>No history yet: engines add a sample every 5 seconds.</p>
              </Empty>
            )}
          </section>
        </>
      )}
    </>
  );
}

/** Engines know adapters by content hash; show the versions and tenants each hash is, the hash on hover. */
function AdapterNames({ ids, named }: { ids: string[]; named: Map<string, EngineAdapter> }) {
  if (ids.length === 0) return <span class="muted">none</span>;
  return (
    <ul class="plain-list small adapter-names">
      {ids.map((id) => {
        const a = named.get(id);
        return (
          <li key={id} title={`content sha256 ${id}`}>
            {a && a.names.length > 0 ? (
              <>
                <strong>{a.names.join(", ")}</strong> <span class="muted">· {a.tenants.join(", ")}</span>
              </>
            ) : (
              <span class="muted">
                no live adapter (<span class="mono">{shortHash(id, 10)}</span>)
              </span>
            )}
          </li>
        );
      })}
    </ul>
  );
}

interface Metric {
  id: "throughput" | "queue" | "kv" | "slots";
  title: string;
  unit: string;
  value: (s: EngineHistory["samples"][number]) => number | null;
  format: (v: number) => string;
}

const METRICS: Metric[] = [
  { id: "throughput", title: "Throughput", unit: "tokens/s", value: (s) => s.tokens_per_s, format: (v) => `${formatInt(Math.round(v))} tokens/s` },
  { id: "queue", title: "Queue", unit: "requests waiting", value: (s) => s.waiting, format: (v) => `${formatInt(v)} waiting` },
  { id: "kv", title: "KV cache use", unit: "%", value: (s) => Math.round(s.kv_usage * 1000) / 10, format: (v) => `${v}%` },
  { id: "slots", title: "Adapter slots in use", unit: "slots", value: (s) => s.slots_used, format: (v) => `${formatInt(v)} slots` },
];

/** One small line chart per metric, one line per engine, with the latest and peak values in a table beside them. */
function HistoryCharts({ history }: { history: EngineHistory[] }) {
  const withData = history.filter((h) => h.samples.length > 0);
  return (
    <>
      <div class="grid-2 charts" data-testid="engines-history">
        {METRICS.map((m) => (
          <MetricChart key={m.id} metric={m} history={withData} />
        ))}
      </div>
      <TableScroll label="Latest and peak values of the last minutes" testid="engines-history-table" class="stack-on-mobile">
        <thead>
          <tr>
            <th scope="col">Engine</th>
            {METRICS.map((m) => (
              <th key={m.id} scope="col" class="num">
                {m.title} (now / peak)
              </th>
            ))}
          </tr>
        </thead>
        <tbody>
          {withData.map((h) => (
            <tr key={h.id} data-testid={`engine-history-row-${h.id}`}>
              <th scope="row">{h.id}</th>
              {METRICS.map((m) => {
                const values = h.samples.map(m.value).filter((v): v is number => v !== null);
                const last = values.at(-1);
                return (
                  <td key={m.id} class="num" data-label={m.title}>
                    {last === undefined ? "—" : `${m.format(last)} / ${m.format(Math.max(...values))}`}
                  </td>
                );
              })}
            </tr>
          ))}
        </tbody>
      </TableScroll>
    </>
  );
}

function MetricChart({ metric, history }: { metric: Metric; history: EngineHistory[] }) {
  const config = useMemo<ChartConfiguration>(() => {
    // Engines sample on their own clocks: plot against seconds before the newest sample, so lines line up in time.
    const newest = Math.max(...history.flatMap((h) => h.samples.map((s) => Date.parse(s.ts))));
    return {
      type: "line",
      data: {
        datasets: history.map((h, i) => ({
          label: h.id,
          data: h.samples.map((s) => ({ x: Math.round((Date.parse(s.ts) - newest) / 1000), y: metric.value(s) })),
          borderColor: PALETTE[i % PALETTE.length],
          backgroundColor: PALETTE[i % PALETTE.length],
          pointRadius: 0,
          spanGaps: true,
        })),
      },
      options: {
        interaction: { mode: "nearest", axis: "x", intersect: false },
        scales: {
          x: { type: "linear", max: 0, title: { display: true, text: "seconds ago" }, ticks: { maxTicksLimit: 6, callback: (v) => `${-Number(v)}` } },
          y: { beginAtZero: true, title: { display: true, text: metric.unit }, ...(metric.id === "kv" ? { max: 100 } : {}) },
        },
        plugins: { legend: { display: history.length > 1 } },
      },
    };
  }, [history, metric]);
  const latest = history
    .map((h) => {
      const v = h.samples.map(metric.value).filter((x): x is number => x !== null).at(-1);
      return `${h.id} ${v === undefined ? "no data" : metric.format(v)}`;
    })
    .join("; ");
  return (
    <div>
      <h3 class="h4">{metric.title}</h3>
      <ChartView config={config} testid={`engine-history-${metric.id}`} height={180} label={`${metric.title} over the last minutes, now: ${latest}.`} />
    </div>
  );
}
