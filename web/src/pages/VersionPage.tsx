/** Live status of one adapter version, polled until it is ready or rejected. Admins can override and roll back. */
import { useState } from "preact/hooks";
import type { Adapter, AdapterVersion } from "../api/types";
import { isInFlight } from "../components/Badge";
import { Link } from "../components/Link";
import { ErrorBox, FormError, Loading } from "../components/Status";
import { VersionDetails } from "../components/VersionDetails";
import { useApp } from "../context";
import { navigate } from "../lib/router";
import { useAction } from "../lib/useAction";
import { useApi } from "../lib/useApi";

export const POLL_MS = 1000;

/** The polling status panel, embeddable (the upload page shows it right under the form). */
export function VersionStatusPanel({ versionId }: { versionId: string }) {
  const { client, user } = useApp();
  const admin = user.role === "platform_admin";
  const base = admin ? "/api/admin/adapter-versions" : "/api/tenant/adapter-versions";
  const [override, setOverride] = useState<AdapterVersion | null>(null);
  const [polling, setPolling] = useState(true);
  const state = useApi(
    async (s) => {
      const v = await client.get<AdapterVersion>(`${base}/${encodeURIComponent(versionId)}`, undefined, s);
      setPolling(isInFlight(v.status));
      setOverride(null);
      return v;
    },
    [versionId, base],
    { intervalMs: polling ? POLL_MS : null },
  );
  const v = override ?? state.data;
  if (state.loading) return <Loading label="Loading the version…" testid="version-loading" />;
  if (!v) return state.error ? <ErrorBox error={state.error} onRetry={state.reload} testid="version-error" /> : null;
  return (
    <section class="card" aria-label="Version status" data-testid="version-panel">
      <VersionDetails version={v} canOverride={admin} onChanged={setOverride} />
      {state.error && (
        <p class="form-error" role="alert" data-testid="version-poll-error">
          Could not refresh the status: {state.error.message} (retrying)
        </p>
      )}
      {admin && !isInFlight(v.status) && <AdapterActions version={v} />}
    </section>
  );
}

export function VersionPage({ versionId }: { versionId: string }) {
  const { user } = useApp();
  const back = user.role === "platform_admin" ? { to: "/admin/upload", label: "Back to uploads" } : { to: "/adapters", label: "Back to adapters" };
  return (
    <>
      <header class="page-head">
        <Link to={back.to} class="back">
          ← {back.label}
        </Link>
        <h1>Adapter version</h1>
        <p class="muted mono small">{versionId}</p>
      </header>
      <VersionStatusPanel versionId={versionId} />
    </>
  );
}

/** Roll the active pointer back to another version, or stop routing the adapter altogether. */
function AdapterActions({ version }: { version: AdapterVersion }) {
  const { client } = useApp();
  const [target, setTarget] = useState("");
  const action = useAction();
  const [msg, setMsg] = useState("");
  const [confirmDelete, setConfirmDelete] = useState(false);
  const adapterPath = `/api/admin/adapters/${encodeURIComponent(version.adapter_id)}`;

  const rollback = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => {
      const a = await client.post<Adapter>(`${adapterPath}/rollback`, { version: Number(target) });
      setMsg(`Active version of ${a.name} is now v${a.active_version}.`);
    });
  };
  const remove = () =>
    action.run(async () => {
      await client.delete(adapterPath);
      navigate("/admin/upload");
    });

  return (
    <div class="adapter-actions">
      <h3 class="h4">Adapter “{version.adapter_name}”</h3>
      <form class="row" onSubmit={rollback}>
        <div class="field">
          <label for="rollback-version">Make this version active</label>
          <input id="rollback-version" type="number" min={1} step={1} required value={target} onInput={(e) => setTarget((e.target as HTMLInputElement).value)} data-testid="rollback-version" />
        </div>
        <button type="submit" class="btn" disabled={action.busy} data-testid="rollback-submit">
          Roll back
        </button>
      </form>
      <div class="row">
        {!confirmDelete ? (
          <button type="button" class="btn btn-danger-ghost" onClick={() => setConfirmDelete(true)} data-testid="delete-adapter">
            Delete adapter…
          </button>
        ) : (
          <>
            <button type="button" class="btn btn-danger" disabled={action.busy} onClick={remove} autoFocus data-testid="confirm-delete-adapter">
              Delete “{version.adapter_name}” and stop routing it
            </button>
            <button type="button" class="btn btn-ghost" onClick={() => setConfirmDelete(false)}>
              Cancel
            </button>
          </>
        )}
      </div>
      <FormError error={action.error} testid="adapter-action-error" />
      <p class="live" aria-live="polite">
        {msg}
      </p>
    </div>
  );
}
