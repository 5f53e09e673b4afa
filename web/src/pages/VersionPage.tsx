/** Live status of one adapter version, polled until it is ready or rejected. Admins pick which version is active
 * from the adapter's list and, in a separate danger zone, delete the adapter after confirming its name. */
import type { ComponentChildren } from "preact";
import { useEffect, useRef, useState } from "preact/hooks";
import { ApiError } from "../api/client";
import type { Adapter, AdapterVersion, AdminAdapter, VersionStatus } from "../api/types";
import { Badge, isInFlight } from "../components/Badge";
import { Link } from "../components/Link";
import { ErrorBox, FormError, Loading } from "../components/Status";
import { VersionDetails } from "../components/VersionDetails";
import { useApp } from "../context";
import { setFlash } from "../lib/flash";
import { formatDateTime } from "../lib/format";
import { isUuid } from "../lib/ids";
import { navigate } from "../lib/router";
import { useAction } from "../lib/useAction";
import { useApi } from "../lib/useApi";

export const POLL_MS = 1000;

/** "Not found" without a retry: asking again will not make a missing version appear. */
function VersionMissing({ testid, children }: { testid: string; children: ComponentChildren }) {
  const { user } = useApp();
  const home = user.role === "platform_admin" ? { to: "/admin/tenants", label: "Go to the tenants and their adapters" } : { to: "/adapters", label: "Go to your adapters" };
  return (
    <div class="state state-empty" role="alert" data-testid={testid}>
      {children}
      <p>
        <Link to={home.to}>{home.label}</Link>
      </p>
    </div>
  );
}

/** The polling status panel, embeddable (the upload page shows it right under the form). */
export function VersionStatusPanel(props: { versionId: string; onVersion?: (v: AdapterVersion) => void; reloadToken?: number }) {
  const { client, user } = useApp();
  const admin = user.role === "platform_admin";
  const base = admin ? "/api/admin/adapter-versions" : "/api/tenant/adapter-versions";
  const [override, setOverride] = useState<AdapterVersion | null>(null);
  const [polling, setPolling] = useState(true);
  const state = useApi(
    async (s) => {
      let v: AdapterVersion;
      try {
        v = await client.get<AdapterVersion>(`${base}/${encodeURIComponent(props.versionId)}`, undefined, s);
      } catch (exc) {
        // A missing version stays missing: stop polling (the page says so and offers no retry).
        if (exc instanceof ApiError && exc.status === 404) setPolling(false);
        throw exc;
      }
      setPolling(isInFlight(v.status));
      setOverride(null);
      return v;
    },
    [props.versionId, base, props.reloadToken],
    { intervalMs: polling ? POLL_MS : null },
  );
  const v = override ?? state.data;
  useEffect(() => {
    if (v) props.onVersion?.(v);
  }, [v]);
  if (state.loading) return <Loading label="Loading the version…" testid="version-loading" />;
  if (!v) {
    if (state.error instanceof ApiError && state.error.status === 404) {
      return (
        <VersionMissing testid="version-not-found">
          <p>
            <strong>No adapter version has this id.</strong> It may belong to an adapter that was deleted, or the link is
            wrong.
          </p>
        </VersionMissing>
      );
    }
    return state.error ? <ErrorBox error={state.error} onRetry={state.reload} testid="version-error" /> : null;
  }
  return (
    <section class="card" aria-label="Version status" data-testid="version-panel">
      <VersionDetails version={v} canOverride={admin} onChanged={setOverride} />
      {state.error && (
        <p class="form-error" role="alert" data-testid="version-poll-error">
          Could not refresh the status: {state.error.message} (retrying)
        </p>
      )}
    </section>
  );
}

export function VersionPage({ versionId }: { versionId: string }) {
  const { client, user } = useApp();
  const admin = user.role === "platform_admin";
  const valid = isUuid(versionId);
  const [version, setVersion] = useState<AdapterVersion | null>(null);
  const [reloadToken, setReloadToken] = useState(0);
  const adapterId = version?.adapter_id ?? null;
  const adapter = useApi(
    (s) => (admin && adapterId ? client.get<AdminAdapter>(`/api/admin/adapters/${encodeURIComponent(adapterId)}`, undefined, s) : Promise.resolve(null)),
    [adapterId, reloadToken, version?.status],
  );
  // While the adapter reloads after a change, keep showing the last answer: the controls (and the message
  // the change left) stay put instead of unmounting for a moment.
  const last = useRef<AdminAdapter | null>(null);
  if (adapter.data) last.current = adapter.data;
  const a = adapter.data ?? (last.current?.id === adapterId ? last.current : null);
  const back = admin
    ? a
      ? { to: `/admin/tenants/${encodeURIComponent(a.tenant_id)}/adapters`, label: `Adapters of ${a.tenant_name}` }
      : { to: "/admin/tenants", label: "Tenants" }
    : { to: "/adapters", label: "Adapters" };

  return (
    <>
      <header class="page-head">
        <Link to={back.to} class="back" testid="version-back">
          ← {back.label}
        </Link>
        <h1>{version ? `${version.adapter_name} v${version.version}` : "Adapter version"}</h1>
        {version && (
          <p data-testid="version-active">
            {version.active ? (
              <>
                <Badge text="active" /> Calls to <code>{version.adapter_name}</code> use this version.
              </>
            ) : (
              <span class="muted">
                Not active{a?.active_version != null ? `: calls to ${version.adapter_name} use v${a.active_version}` : ""}.
              </span>
            )}
          </p>
        )}
        <p class="muted mono small">{versionId}</p>
      </header>
      {!valid ? (
        <VersionMissing testid="version-invalid">
          <p>
            <strong>“{versionId}” is not a version id.</strong> Version ids look like <code>0192f3c4-…</code>; copy the link from
            the adapters page.
          </p>
        </VersionMissing>
      ) : (
        <VersionStatusPanel versionId={versionId} onVersion={setVersion} reloadToken={reloadToken} />
      )}
      {admin && version && !isInFlight(version.status) && a && (
        <>
          <ActiveVersion adapter={a} onChanged={() => setReloadToken((n) => n + 1)} />
          <DangerZone adapter={a} />
        </>
      )}
    </>
  );
}

const READY: VersionStatus = "ready";

/** Pick which version the adapter's name routes to, from its versions (only ready ones can be picked). */
function ActiveVersion({ adapter, onChanged }: { adapter: AdminAdapter; onChanged: () => void }) {
  const { client } = useApp();
  const versions = [...adapter.versions].sort((x, y) => y.version - x.version);
  const [target, setTarget] = useState<number | null>(null);
  const [msg, setMsg] = useState("");
  const action = useAction();
  const submit = (ev: Event) => {
    ev.preventDefault();
    if (target === null) return;
    setMsg(""); // a message belongs to the action that wrote it
    void action.run(async () => {
      const updated = await client.post<Adapter>(`/api/admin/adapters/${encodeURIComponent(adapter.id)}/rollback`, { version: target });
      setMsg(`Calls to ${updated.name} now use v${updated.active_version}.`);
      setTarget(null);
      onChanged();
    });
  };
  return (
    <section class="card section" aria-labelledby="active-title" data-testid="rollback-form">
      <h2 id="active-title" class="h3">
        Active version of “{adapter.name}”
      </h2>
      <form onSubmit={submit}>
        <fieldset class="version-choices">
          <legend>Route calls to</legend>
          {versions.map((v) => {
            const isActive = v.version === adapter.active_version;
            return (
              <label key={v.id} class={v.status !== READY ? "choice choice-disabled" : "choice"}>
                <input
                  type="radio"
                  name="rollback-version"
                  value={v.version}
                  checked={target === null ? isActive : target === v.version}
                  disabled={v.status !== READY}
                  onChange={() => setTarget(v.version)}
                  data-testid={`rollback-version-${v.version}`}
                />
                <span>
                  <strong>v{v.version}</strong> <Badge text={v.status} /> {isActive && <Badge text="active" testid={`rollback-active-${v.version}`} />}
                  <span class="muted small"> uploaded {formatDateTime(v.created_at)}</span>
                  {v.status !== READY && <span class="muted small"> · only a ready version can be active</span>}
                </span>
              </label>
            );
          })}
        </fieldset>
        <button type="submit" class="btn btn-primary" disabled={action.busy || target === null || target === adapter.active_version} data-testid="rollback-submit">
          {target !== null && target !== adapter.active_version ? `Make v${target} active` : "Make active"}
        </button>
      </form>
      <FormError error={action.error} testid="adapter-action-error" />
      <p class="live" aria-live="polite" data-testid="rollback-status">
        {msg}
      </p>
    </section>
  );
}

/** Deleting stops routing the adapter for good: kept apart from the routine controls, and confirmed by name. */
function DangerZone({ adapter }: { adapter: AdminAdapter }) {
  const { client } = useApp();
  const [confirming, setConfirming] = useState(false);
  const [typed, setTyped] = useState("");
  const action = useAction();
  const remove = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => {
      await client.delete(`/api/admin/adapters/${encodeURIComponent(adapter.id)}`);
      setFlash(`Adapter “${adapter.name}” was deleted: calls to it now fail as unknown; its versions and usage stay for billing.`);
      navigate(`/admin/tenants/${encodeURIComponent(adapter.tenant_id)}/adapters`);
    });
  };
  return (
    <section class="card section danger-zone" aria-labelledby="danger-title" data-testid="danger-zone">
      <h2 id="danger-title" class="h3">
        Delete this adapter
      </h2>
      <p>
        Stops routing <strong>every</strong> version of “{adapter.name}” at once; engines unload it. Versions and usage stay for
        billing. This cannot be undone.
      </p>
      {!confirming ? (
        <button type="button" class="btn btn-danger-ghost" onClick={() => setConfirming(true)} data-testid="delete-adapter">
          Delete adapter…
        </button>
      ) : (
        <form onSubmit={remove} class="row" data-testid="delete-confirm">
          <div class="field grow">
            <label for="delete-confirm-name">Type “{adapter.name}” to confirm</label>
            <input
              id="delete-confirm-name"
              autoComplete="off"
              value={typed}
              onInput={(e) => setTyped((e.target as HTMLInputElement).value)}
              data-testid="delete-confirm-name"
              autoFocus
            />
          </div>
          <button type="submit" class="btn btn-danger" disabled={action.busy || typed !== adapter.name} data-testid="confirm-delete-adapter">
            Delete “{adapter.name}”
          </button>
          <button
            type="button"
            class="btn btn-ghost"
            onClick={() => {
              setConfirming(false);
              setTyped("");
            }}
            data-testid="cancel-delete-adapter"
          >
            Cancel
          </button>
        </form>
      )}
      <FormError error={action.error} testid="delete-adapter-error" />
    </section>
  );
}
