/** A tenant's adapters: every version with its status and quality-gate verdict; refreshes while any is in flight.
 * Tenant roles see their own (/adapters); platform admins open any tenant's (/admin/tenants/:id/adapters). */
import { useState } from "preact/hooks";
import type { Adapter, AdapterVersion, AdminTenant, ListResponse } from "../api/types";
import { Badge, isInFlight } from "../components/Badge";
import { Link } from "../components/Link";
import { Empty, ErrorBox, Loading, TableScroll } from "../components/Status";
import { VersionDetails } from "../components/VersionDetails";
import { useApp } from "../context";
import { formatDateTime, formatMetric, formatPercent } from "../lib/format";
import { gateSummary as summarize } from "../lib/gate";
import { useApi } from "../lib/useApi";

export function AdaptersPage({ tenantId }: { tenantId?: string }) {
  const { client, user } = useApp();
  const [polling, setPolling] = useState(false);
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
          <p class="muted">Call one with <code>model: "name"</code> (active version) or <code>"name@version"</code>.</p>
        </div>
        {(user.role === "tenant_admin" || tenantId) && (
          <Link to={tenantId ? "/admin/upload" : "/adapters/upload"} class="btn btn-primary" testid="adapters-upload">
            Upload adapter
          </Link>
        )}
      </header>
      {adapters.loading ? (
        <Loading label="Loading adapters…" testid="adapters-loading" />
      ) : adapters.error && !adapters.data ? (
        <ErrorBox error={adapters.error} onRetry={adapters.reload} testid="adapters-error" />
      ) : adapters.data && adapters.data.data.length === 0 ? (
        <Empty testid="adapters-empty">
          <p>No adapters yet. Calls can use the base model meanwhile.</p>
        </Empty>
      ) : adapters.data ? (
        <ul class="adapter-list" data-testid="adapters-list">
          {adapters.data.data.map((a) => (
            <AdapterCard key={a.id} adapter={a} versionsBase={versionsBase} />
          ))}
        </ul>
      ) : null}
    </>
  );
}

/** One line for the versions table: the gate's two checks, or its first figures when they are of another shape. */
function gateLine(v: AdapterVersion): string {
  if (!v.eval) return "—";
  const g = summarize(v.eval);
  if (g.flat) return g.flat.slice(0, 3).map((r) => `${r.name.replace(/_/g, " ")} ${formatMetric(r.value)}`).join(" · ");
  const margin = g.checks.find((c) => c.id === "margin");
  const fp8 = g.checks.find((c) => c.id === "fp8");
  const gated = g.scores.find((r) => r.gated);
  const parts = [];
  if (gated && margin?.value != null) parts.push(`${gated.name.replace(/_/g, "-")} ${formatMetric(gated.adapter)} (base ${formatMetric(gated.base)})`);
  if (fp8?.value != null) parts.push(`FP8 agreement ${formatPercent(fp8.value)}`);
  return parts.join(" · ") || "—";
}

function AdapterCard({ adapter, versionsBase }: { adapter: Adapter; versionsBase: string }) {
  const [open, setOpen] = useState<string | null>(null);
  const versions = [...adapter.versions].sort((a, b) => b.version - a.version);
  const openVersion = versions.find((v) => v.id === open) ?? null;
  return (
    <li class="card adapter" data-testid={`adapter-${adapter.name}`}>
      <div class="row-between">
        <h2 class="h3">{adapter.name}</h2>
        <span class="muted" data-testid={`adapter-active-${adapter.name}`}>
          {adapter.active_version === null ? "no active version" : `active: v${adapter.active_version}`}
        </span>
      </div>
      <TableScroll label={`Versions of ${adapter.name}`}>
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
                {/* The version itself toggles its details, so the control is in the first column even on a phone. */}
                <button
                  type="button"
                  class="link-btn"
                  aria-expanded={open === v.id}
                  aria-controls={`vd-${v.id}`}
                  onClick={() => setOpen(open === v.id ? null : v.id)}
                  data-testid={`version-toggle-${v.id}`}
                >
                  <span aria-hidden="true">{open === v.id ? "▾ " : "▸ "}</span>v{v.version}
                  <span class="sr-only"> details</span>
                </button>
                {adapter.active_version === v.version && <span class="muted"> (active)</span>}
              </th>
              <td>
                <Badge text={v.status} />
                {isInFlight(v.status) && v.progress && <span class="muted"> {Math.round(v.progress.percent)}%</span>}
              </td>
              <td class="wrap gate-cell">
                {v.eval ? <Badge text={v.eval.passed ? "passed" : "failed"} /> : null} <span class="muted small">{gateLine(v)}</span>
              </td>
              <td>{formatDateTime(v.created_at)}</td>
            </tr>
          ))}
        </tbody>
      </TableScroll>
      {openVersion && (
        // Below the table, not in a row of it: on a phone the table scrolls sideways, the details should not.
        <div id={`vd-${openVersion.id}`} class="version-below">
          <VersionDetails version={openVersion} canOverride={false} />
          <Link to={`${versionsBase}/${encodeURIComponent(openVersion.id)}`}>Open this version's page</Link>
        </div>
      )}
    </li>
  );
}
