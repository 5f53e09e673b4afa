/** The tenant's Batch API jobs: progress, counts, ETA, result downloads, cancel. Refreshes while any runs. */
import { useEffect, useState } from "preact/hooks";
import type { BatchJob } from "../api/types";
import { Badge } from "../components/Badge";
import { Empty, ErrorBox, FormError, LiveText, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { formatInt, formatPercent } from "../lib/format";
import { useAction } from "../lib/useAction";
import { useApi } from "../lib/useApi";

const RUNNING = new Set(["validating", "in_progress", "finalizing", "cancelling"]);
const REFRESH_MS = 2000;

export function BatchesPage() {
  const { client } = useApp();
  const batches = useApi((s) => client.get<{ data: BatchJob[]; has_more: boolean }>("/api/tenant/batches", { limit: 50 }, s), []);
  const [announce, setAnnounce] = useState("");
  const running = batches.data?.data.some((b) => RUNNING.has(b.status)) ?? false;
  useEffect(() => {
    if (!running) return;
    const t = window.setInterval(() => batches.reload(), REFRESH_MS);
    return () => window.clearInterval(t);
  }, [running]);

  return (
    <>
      <header class="page-head">
        <h1>Batches</h1>
        <p class="muted">
          Offline jobs sent with the Batch API (<code>POST /v1/batches</code>, or <code>mplex batch submit</code>): they run on
          idle engine capacity at the batch rate and finish within their completion window.
        </p>
      </header>
      <LiveText testid="batches-status">{announce}</LiveText>
      <section class="section" aria-labelledby="batches-title">
        <h2 id="batches-title">Your batches</h2>
        {batches.loading && !batches.data ? (
          <Loading label="Loading batches…" testid="batches-loading" />
        ) : batches.error && !batches.data ? (
          <ErrorBox error={batches.error} onRetry={batches.reload} testid="batches-error" />
        ) : batches.data && batches.data.data.length === 0 ? (
          <Empty testid="batches-empty">
            <p>No batches yet. Upload a JSONL file of requests and create a batch with the OpenAI SDK or the CLI.</p>
          </Empty>
        ) : batches.data ? (
          <TableScroll label="Batches" testid="batches-table">
            <table>
              <thead>
                <tr>
                  <th scope="col">Batch</th>
                  <th scope="col">Status</th>
                  <th scope="col">Progress</th>
                  <th scope="col">Completed</th>
                  <th scope="col">Failed</th>
                  <th scope="col">ETA</th>
                  <th scope="col">Results</th>
                  <th scope="col">
                    <span class="visually-hidden">Actions</span>
                  </th>
                </tr>
              </thead>
              <tbody>
                {batches.data.data.map((b) => (
                  <BatchRow key={b.id} batch={b} onCancelled={() => { setAnnounce(`Batch ${b.id} is being cancelled.`); batches.reload(); }} />
                ))}
              </tbody>
            </table>
          </TableScroll>
        ) : null}
      </section>
    </>
  );
}

function BatchRow({ batch: b, onCancelled }: { batch: BatchJob; onCancelled: () => void }) {
  const { client } = useApp();
  const action = useAction();
  const c = b.request_counts;
  const done = c.completed + c.failed;
  const fraction = c.total ? done / c.total : 0;
  const download = (id: string) => `/api/tenant/batch-files/${encodeURIComponent(id)}/content`;
  return (
    <tr data-testid={`batch-${b.id}`}>
      <td>
        <code>{b.id}</code>
        <div class="muted small">{b.endpoint}</div>
      </td>
      <td>
        <Badge text={b.status} testid="batch-status" />
      </td>
      <td>
        <span class="batch-progress">
          <progress max={c.total || 1} value={done} aria-label={`${b.id} progress`} data-testid="batch-progress" />
          <span class="muted small">{formatPercent(fraction, 0)}</span>
        </span>
      </td>
      <td data-testid="batch-completed">{formatInt(c.completed)} / {formatInt(c.total)}</td>
      <td data-testid="batch-failed">{formatInt(c.failed)}</td>
      <td data-testid="batch-eta">{b.eta_s === null ? "—" : formatEta(b.eta_s)}</td>
      <td>
        {b.output_file_id && (
          <a href={download(b.output_file_id)} download data-testid="batch-output-link">
            Output
          </a>
        )}
        {b.output_file_id && b.error_file_id && " · "}
        {b.error_file_id && (
          <a href={download(b.error_file_id)} download data-testid="batch-errors-link">
            Errors
          </a>
        )}
      </td>
      <td>
        {(b.status === "validating" || b.status === "in_progress") && (
          <button
            type="button"
            class="button-danger"
            disabled={action.busy}
            data-testid="batch-cancel"
            onClick={() => {
              if (!window.confirm(`Cancel batch ${b.id}? Lines answered so far stay in its output.`)) return;
              void action.run(async () => {
                await client.post(`/api/tenant/batches/${encodeURIComponent(b.id)}/cancel`);
                onCancelled();
              });
            }}
          >
            Cancel
          </button>
        )}
        <FormError error={action.error} testid="batch-cancel-error" />
      </td>
    </tr>
  );
}

export function formatEta(seconds: number): string {
  if (seconds < 60) return `${seconds} s`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min`;
  return `${(seconds / 3600).toFixed(1)} h`;
}
