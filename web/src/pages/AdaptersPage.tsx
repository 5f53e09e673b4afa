/** A tenant's adapters as one table row each (search, status filter, pages; rejected ones collapsed), every version
 * one click away; refreshes while any version is in flight. Tenant roles see their own (/adapters); platform admins
 * open any tenant's (/admin/tenants/:id/adapters). */
import { useEffect, useMemo, useState } from "preact/hooks";
import type { Adapter, AdapterVersion, AdminTenant, ListResponse } from "../api/types";
import { Badge, isInFlight } from "../components/Badge";
import { Link } from "../components/Link";
import { Pager } from "../components/Pager";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { VersionDetails } from "../components/VersionDetails";
import { useApp } from "../context";
import { adapterRows, paginate, type AdapterSummary, type StatusFilter } from "../lib/adapters";
import { takeFlash } from "../lib/flash";
import { formatDateTime, formatMetric, formatPercent } from "../lib/format";
import { gateSummary as summarize } from "../lib/gate";
import { useApi } from "../lib/useApi";

export const PAGE_SIZE = 20;
/** On a phone each adapter is a card several lines tall: fewer per page keeps a page a few screens long. */
export const PHONE_PAGE_SIZE = 10;
const PHONE = "(max-width: 640px)";

function usePageSize(): number {
  const query = typeof window.matchMedia === "function" ? window.matchMedia(PHONE) : null;
  const [phone, setPhone] = useState(query?.matches ?? false);
  useEffect(() => {
    if (!query) return;
    const update = () => setPhone(query.matches);
    query.addEventListener("change", update);
    return () => query.removeEventListener("change", update);
  }, []);
  return phone ? PHONE_PAGE_SIZE : PAGE_SIZE;
}

const STATUS_OPTIONS: { id: StatusFilter; label: string }[] = [
  { id: "all", label: "All (rejected collapsed)" },
  { id: "live", label: "Routable (an active version)" },
  { id: "in_progress", label: "Being validated or evaluated" },
  { id: "rejected", label: "Rejected (nothing routable)" },
];

export function AdaptersPage({ tenantId }: { tenantId?: string }) {
  const { client, user } = useApp();
  const [polling, setPolling] = useState(false);
  const [flash] = useState(takeFlash);
  const [query, setQuery] = useState("");
  const [status, setStatus] = useState<StatusFilter>("all");
  const [showRejected, setShowRejected] = useState(false);
  const [page, setPage] = useState(1);
  const [open, setOpen] = useState<string | null>(null);
  const pageSize = usePageSize();
  const path = tenantId ? `/api/admin/tenants/${encodeURIComponent(tenantId)}/adapters` : "/api/tenant/adapters";
  const adapters = useApi(
    async (s) => {
      const res = await client.get<ListResponse<Adapter>>(path, undefined, s);
      setPolling(res.data.some((a) => a.versions.some((v) => isInFlight(v.status))));
      return res;
    },
    [path],
    { intervalMs: polling ? 2000 : null },
  );
  const tenants = useApi(
    (s) => (tenantId ? client.get<ListResponse<AdminTenant>>("/api/admin/tenants", undefined, s) : Promise.resolve(null)),
    [tenantId],
  );
  const tenantName = tenants.data?.data.find((t) => t.id === tenantId)?.name;
  const versionsBase = tenantId ? "/admin/versions" : "/adapters/versions";
  const all = adapters.data?.data ?? [];
  const list = useMemo(() => adapterRows(all, { query, status, showRejected }), [all, query, status, showRejected]);
  const shown = paginate(list.rows, page, pageSize);
  const filtering = (fn: () => void) => {
    fn();
    setPage(1);
  };

  return (
    <>
      <header class="page-head row-between">
        <div>
          {tenantId && (
            <Link to="/admin/tenants" class="back">
              ← Back to tenants
            </Link>
          )}
          <h1>{tenantId ? `Adapters of ${tenantName ?? "tenant"}` : "Adapters"}</h1>
          <p class="muted">
            Call one with <code>model: "name"</code> (active version) or <code>"name@version"</code>.
          </p>
        </div>
        {(user.role === "tenant_admin" || tenantId) && (
          <Link to={tenantId ? "/admin/upload" : "/adapters/upload"} class="btn btn-primary" testid="adapters-upload">
            Upload adapter
          </Link>
        )}
      </header>
      {flash && (
        <p class="notice" role="status" data-testid="adapters-notice">
          {flash}
        </p>
      )}
      {adapters.loading ? (
        <Loading label="Loading adapters…" testid="adapters-loading" />
      ) : adapters.error && !adapters.data ? (
        <ErrorBox error={adapters.error} onRetry={adapters.reload} testid="adapters-error" />
      ) : all.length === 0 ? (
        <Empty testid="adapters-empty">
          <p>No adapters yet. Calls can use the base model meanwhile.</p>
        </Empty>
      ) : (
        <>
          <form class="filters" role="search" aria-label="Find adapters" onSubmit={(e) => e.preventDefault()}>
            <div class="field grow">
              <label for="adapters-search">Search by name</label>
              <input
                id="adapters-search"
                type="search"
                value={query}
                placeholder="e.g. support"
                onInput={(e) => filtering(() => setQuery((e.target as HTMLInputElement).value))}
                data-testid="adapters-search"
              />
            </div>
            <div class="field">
              <label for="adapters-status">Status</label>
              <select
                id="adapters-status"
                value={status}
                onChange={(e) => filtering(() => setStatus((e.target as HTMLSelectElement).value as StatusFilter))}
                data-testid="adapters-status"
              >
                {STATUS_OPTIONS.map((o) => (
                  <option key={o.id} value={o.id}>
                    {o.label}
                  </option>
                ))}
              </select>
            </div>
          </form>
          <p class="muted small" aria-live="polite" data-testid="adapters-count">
            {list.matching} of {all.length} adapter{all.length === 1 ? "" : "s"}
            {list.hiddenRejected > 0 ? ` · ${list.hiddenRejected} rejected collapsed` : ""}
          </p>
          {list.rows.length === 0 ? (
            <Empty testid="adapters-none-match">
              <p>{list.hiddenRejected > 0 ? "Only rejected adapters are left; show them below." : "No adapter matches."}</p>
            </Empty>
          ) : (
            <TableScroll label="Adapters" testid="adapters-list" class="stack-on-mobile adapters-table">
              <thead>
                <tr>
                  <th scope="col">Adapter</th>
                  <th scope="col">Active</th>
                  <th scope="col">Latest version</th>
                  <th scope="col">Quality gate (latest)</th>
                  <th scope="col" class="num">Versions</th>
                  <th scope="col">Last upload</th>
                </tr>
              </thead>
              {shown.items.map((s) => (
                <AdapterRow
                  key={s.adapter.id}
                  summary={s}
                  open={open === s.adapter.id}
                  onToggle={() => setOpen(open === s.adapter.id ? null : s.adapter.id)}
                  versionsBase={versionsBase}
                />
              ))}
            </TableScroll>
          )}
          <Pager page={shown} total={list.rows.length} onPage={setPage} testid="adapters-pager" noun="adapters" />
          {(list.hiddenRejected > 0 || (showRejected && status === "all" && !query.trim())) && (
            <button
              type="button"
              class="btn btn-small btn-ghost"
              aria-expanded={showRejected}
              onClick={() => filtering(() => setShowRejected(!showRejected))}
              data-testid="adapters-show-rejected"
            >
              {showRejected ? "Collapse rejected adapters" : `Show ${list.hiddenRejected} rejected adapter${list.hiddenRejected === 1 ? "" : "s"}`}
            </button>
          )}
        </>
      )}
    </>
  );
}

/** One line for the tables: the quality check's figure and any check that failed, or the first figures of a
 * gate result of another shape. */
function gateLine(v: AdapterVersion): string {
  if (!v.eval) return "—";
  const g = summarize(v.eval);
  if (g.flat) return g.flat.slice(0, 3).map((r) => `${r.name.replace(/_/g, " ")} ${formatMetric(r.value)}`).join(" · ");
  const parts = [];
  const quality = g.checks[0];
  const gated = g.scores.find((r) => r.gated);
  if (gated && quality?.id === "margin") parts.push(`${gated.name.replace(/_/g, "-")} ${formatMetric(gated.adapter)} (base ${formatMetric(gated.base)})`);
  else if (quality?.id === "no_regression" && quality.value !== null) parts.push(`no regression (drop ≤ ${formatMetric(quality.value)})`);
  const failed = g.checks.filter((c) => c.pass === false && c !== quality).map((c) => `${c.id.replace(/_/g, " ")} failed`);
  parts.push(...failed);
  const fp8 = g.checks.find((c) => c.id === "fp8" || c.id === "fp8_agreement");
  if (!failed.length && fp8?.value != null) parts.push(`FP8 agreement ${formatPercent(fp8.value)}`);
  return parts.join(" · ") || "—";
}

function StatusCell({ v }: { v: AdapterVersion }) {
  return (
    <>
      <Badge text={v.status} />
      {isInFlight(v.status) && v.progress && <span class="muted"> {Math.round(v.progress.percent)}%</span>}
    </>
  );
}

/** An adapter's row; its versions open below it, in the same <tbody>, so a phone shows them under the card. */
function AdapterRow(props: { summary: AdapterSummary; open: boolean; onToggle: () => void; versionsBase: string }) {
  const { adapter, latest, active } = props.summary;
  const [openVersion, setOpenVersion] = useState<string | null>(null);
  const versions = [...adapter.versions].sort((a, b) => b.version - a.version);
  const shownVersion = versions.find((v) => v.id === openVersion) ?? null;
  const detailsId = `adapter-versions-${adapter.id}`;
  return (
    <tbody data-testid={`adapter-${adapter.name}`} class={props.summary.group === "rejected" ? "row-muted" : undefined}>
      <tr>
        <th scope="row" class="wrap">
          <button
            type="button"
            class="link-btn"
            aria-expanded={props.open}
            aria-controls={detailsId}
            onClick={props.onToggle}
            data-testid={`adapter-toggle-${adapter.name}`}
          >
            <span aria-hidden="true">{props.open ? "▾ " : "▸ "}</span>
            {adapter.name}
            <span class="sr-only">: {props.open ? "hide" : "show"} versions</span>
          </button>
        </th>
        <td data-label="Active" data-testid={`adapter-active-${adapter.name}`}>
          {active ? (
            <>
              <span class="sr-only">active: </span>v{active.version} <Badge text="ready" />
            </>
          ) : (
            <span class="muted">no active version</span>
          )}
        </td>
        <td data-label="Latest version">{latest ? <>v{latest.version} <StatusCell v={latest} /></> : "—"}</td>
        <td data-label="Quality gate" class="wrap gate-cell">
          {latest?.eval ? <Badge text={latest.eval.passed ? "passed" : "failed"} /> : null} <span class="muted small">{latest ? gateLine(latest) : ""}</span>
        </td>
        <td class="num" data-label="Versions">{adapter.versions.length}</td>
        <td data-label="Last upload">{formatDateTime(props.summary.lastUpload)}</td>
      </tr>
      {props.open && (
        <tr class="panel-row detail-row">
          <td colSpan={6} class="wrap" id={detailsId}>
            <div class="panel">
              <TableScroll label={`Versions of ${adapter.name}`} class="stack-on-mobile">
                <thead>
                  <tr>
                    <th scope="col">Version</th>
                    <th scope="col">Status</th>
                    <th scope="col">Quality gate</th>
                    <th scope="col">Uploaded</th>
                  </tr>
                </thead>
                <tbody>
                  {versions.map((v) => (
                    <tr key={v.id} data-testid={`version-row-${v.id}`}>
                      <th scope="row">
                        <button
                          type="button"
                          class="link-btn"
                          aria-expanded={openVersion === v.id}
                          aria-controls={`vd-${v.id}`}
                          onClick={() => setOpenVersion(openVersion === v.id ? null : v.id)}
                          data-testid={`version-toggle-${v.id}`}
                        >
                          <span aria-hidden="true">{openVersion === v.id ? "▾ " : "▸ "}</span>v{v.version}
                          <span class="sr-only"> details</span>
                        </button>
                        {adapter.active_version === v.version && <span class="muted"> (active)</span>}
                      </th>
                      <td data-label="Status">
                        <StatusCell v={v} />
                      </td>
                      <td class="wrap gate-cell" data-label="Quality gate">
                        {v.eval ? <Badge text={v.eval.passed ? "passed" : "failed"} /> : null} <span class="muted small">{gateLine(v)}</span>
                      </td>
                      <td data-label="Uploaded">{formatDateTime(v.created_at)}</td>
                    </tr>
                  ))}
                </tbody>
              </TableScroll>
              {shownVersion && (
                <div id={`vd-${shownVersion.id}`} class="version-below">
                  <VersionDetails version={shownVersion} canOverride={false} />
                  <Link to={`${props.versionsBase}/${encodeURIComponent(shownVersion.id)}`} testid={`version-page-link-${shownVersion.id}`}>
                    Open v{shownVersion.version}'s page
                  </Link>
                </div>
              )}
            </div>
          </td>
        </tr>
      )}
    </tbody>
  );
}
