/** API keys: list with last use; tenant admins create (secret shown once) and revoke. */
import { useState } from "preact/hooks";
import type { ApiKey, CreatedKey, ListResponse } from "../api/types";
import { Badge } from "../components/Badge";
import { CopyButton } from "../components/CopyButton";
import { Empty, ErrorBox, FormError, LiveText, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { formatDateTime, relativeTime } from "../lib/format";
import { useAction } from "../lib/useAction";
import { useApi } from "../lib/useApi";

export function KeysPage() {
  const { client, user } = useApp();
  const isAdmin = user.role === "tenant_admin";
  const keys = useApi((s) => client.get<ListResponse<ApiKey>>("/api/tenant/keys", undefined, s), []);
  const [created, setCreated] = useState<CreatedKey | null>(null);
  const [announce, setAnnounce] = useState("");

  return (
    <>
      <header class="page-head">
        <h1>API keys</h1>
        <p class="muted">
          Keys authenticate calls to the OpenAI-compatible API: <code>Authorization: Bearer mpx_…</code>.
        </p>
      </header>

      {isAdmin ? (
        <CreateKey
          onCreated={(k) => {
            setCreated(k);
            setAnnounce(`Key ${k.name} created.`);
            keys.reload();
          }}
        />
      ) : (
        <p class="notice" data-testid="keys-readonly">
          Only a tenant admin can create or revoke keys.
        </p>
      )}

      {created && (
        <NewKeySecret
          created={created}
          onDone={() => {
            setCreated(null);
            setAnnounce("The new key's secret is hidden now.");
          }}
        />
      )}
      <LiveText testid="keys-status">{announce}</LiveText>

      <section class="section" aria-labelledby="keys-list-title">
        <h2 id="keys-list-title">Keys</h2>
        {keys.loading ? (
          <Loading label="Loading keys…" testid="keys-loading" />
        ) : keys.error && !keys.data ? (
          <ErrorBox error={keys.error} onRetry={keys.reload} testid="keys-error" />
        ) : keys.data && keys.data.data.length === 0 ? (
          <Empty testid="keys-empty">
            <p>No API keys yet.{isAdmin ? " Create one above to start calling the API." : " Ask a tenant admin for one."}</p>
          </Empty>
        ) : keys.data ? (
          <KeyTable
            keys={keys.data.data}
            canRevoke={isAdmin}
            onRevoked={(k) => {
              setAnnounce(`Key ${k.name} revoked. It stops working within a few seconds.`);
              keys.reload();
            }}
          />
        ) : null}
      </section>
    </>
  );
}

function CreateKey({ onCreated }: { onCreated: (k: CreatedKey) => void }) {
  const { client } = useApp();
  const [name, setName] = useState("");
  const action = useAction();
  const submit = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => {
      onCreated(await client.post<CreatedKey>("/api/tenant/keys", { name: name.trim() }));
      setName("");
    });
  };
  return (
    <form class="card inline-form" onSubmit={submit} aria-labelledby="create-key-title">
      <h2 id="create-key-title" class="h3">
        Create a key
      </h2>
      <div class="row">
        <div class="field grow">
          <label for="create-key-name">Key name</label>
          <input
            id="create-key-name"
            required
            maxLength={100}
            placeholder="e.g. production backend"
            value={name}
            onInput={(e) => setName((e.target as HTMLInputElement).value)}
            data-testid="create-key-name"
          />
        </div>
        <button type="submit" class="btn btn-primary" disabled={action.busy} data-testid="create-key">
          {action.busy ? "Creating…" : "Create key"}
        </button>
      </div>
      <FormError error={action.error} testid="create-key-error" />
    </form>
  );
}

function NewKeySecret({ created, onDone }: { created: CreatedKey; onDone: () => void }) {
  return (
    <section class="card secret" aria-labelledby="new-key-title" data-testid="new-key">
      <h2 id="new-key-title" class="h3">
        Your new key “{created.name}”
      </h2>
      <p>
        <strong>Copy it now.</strong> This is the only time the full key is shown; we keep only its hash.
      </p>
      <div class="row">
        <label class="sr-only" for="new-key-secret">
          New API key
        </label>
        <input id="new-key-secret" class="mono grow" readOnly value={created.key} data-testid="new-key-secret" onFocus={(e) => (e.target as HTMLInputElement).select()} />
        <CopyButton text={created.key} inputId="new-key-secret" testid="copy-key" />
      </div>
      <button type="button" class="btn btn-ghost" onClick={onDone} data-testid="dismiss-new-key">
        I have stored it — hide the key
      </button>
    </section>
  );
}

/** A key's state as a word: revoked, expired (temporary keys), or active. */
function keyState(k: ApiKey, now: Date): "revoked" | "expired" | "active" {
  if (k.revoked_at) return "revoked";
  if (k.expires_at && new Date(k.expires_at).getTime() <= now.getTime()) return "expired";
  return "active";
}

function KeyTable({ keys, canRevoke, onRevoked }: { keys: ApiKey[]; canRevoke: boolean; onRevoked: (k: ApiKey) => void }) {
  const now = new Date();
  return (
    // On a phone every key is a card (label: value lines), not a table to scroll sideways.
    <TableScroll label="API keys" testid="keys-table" class="stack-on-mobile">
      <thead>
        <tr>
          <th scope="col">Name</th>
          <th scope="col">Key</th>
          <th scope="col">Scopes</th>
          <th scope="col">Created</th>
          <th scope="col">Last used</th>
          <th scope="col">Status</th>
          {canRevoke && (
            <th scope="col">
              <span class="sr-only">Actions</span>
            </th>
          )}
        </tr>
      </thead>
      <tbody>
        {keys.map((k) => {
          const state = keyState(k, now);
          return (
            <tr key={k.id} data-testid={`key-row-${k.id}`} class={state !== "active" ? "row-muted" : undefined}>
              <th scope="row" class="wrap">
                {k.name}
              </th>
              <td class="mono" data-label="Key">
                {k.prefix}…
              </td>
              <td data-label="Scopes">{k.scopes.length ? k.scopes.join(", ") : "—"}</td>
              <td data-label="Created">{formatDateTime(k.created_at)}</td>
              <td title={formatDateTime(k.last_used_at)} data-testid={`key-last-used-${k.id}`} data-label="Last used">
                {relativeTime(k.last_used_at, now)}
              </td>
              <td data-label="Status">
                <Badge text={state} />
                {k.expires_at && state === "active" && (
                  <span class="muted small" data-testid={`key-expires-${k.id}`}>
                    {" "}
                    temporary, until {formatDateTime(k.expires_at).slice(11)}
                  </span>
                )}
              </td>
              {canRevoke && (
                <td data-label="Actions" class="actions-cell">
                  {state === "active" && <RevokeButton apiKey={k} onRevoked={onRevoked} />}
                </td>
              )}
            </tr>
          );
        })}
      </tbody>
    </TableScroll>
  );
}

/** Two-step revoke: the first press asks, the second does it. No modal to trap focus. */
function RevokeButton({ apiKey, onRevoked }: { apiKey: ApiKey; onRevoked: (k: ApiKey) => void }) {
  const { client } = useApp();
  const [confirming, setConfirming] = useState(false);
  const action = useAction();
  if (!confirming) {
    return (
      <button type="button" class="btn btn-small btn-danger-ghost" onClick={() => setConfirming(true)} data-testid={`revoke-key-${apiKey.id}`}>
        Revoke<span class="sr-only"> {apiKey.name}</span>
      </button>
    );
  }
  return (
    <span class="confirm">
      <button
        type="button"
        class="btn btn-small btn-danger"
        disabled={action.busy}
        autoFocus
        data-testid={`confirm-revoke-${apiKey.id}`}
        onClick={() =>
          action.run(async () => {
            await client.delete(`/api/tenant/keys/${encodeURIComponent(apiKey.id)}`);
            onRevoked(apiKey);
          })
        }
      >
        {action.busy ? "Revoking…" : `Revoke “${apiKey.name}”`}
      </button>
      <button type="button" class="btn btn-small btn-ghost" onClick={() => setConfirming(false)} disabled={action.busy}>
        Cancel
      </button>
      <FormError error={action.error} testid={`revoke-error-${apiKey.id}`} />
    </span>
  );
}
