/** Platform admin: tenants with plan, limits and this month's usage; create, suspend/activate, edit, add users. */
import { Fragment } from "preact";
import { useState } from "preact/hooks";
import type { AdminTenant, ListResponse, Role, Tenant, TenantUser, User } from "../api/types";
import { Link } from "../components/Link";
import { Badge } from "../components/Badge";
import { Empty, ErrorBox, FormError, LiveText, Loading, TableScroll } from "../components/Status";
import { useApp } from "../context";
import { formatDateTime, formatInt, formatLimit, relativeTime } from "../lib/format";
import { LIMIT_FIELDS, formatLimitText, givenLimits, limitsToText, parseLimits, slugify, type LimitsText } from "../lib/limits";
import { formatUsd } from "../lib/money";
import { useAction } from "../lib/useAction";
import { useApi } from "../lib/useApi";

export function TenantsPage() {
  const { client } = useApp();
  const tenants = useApi((s) => client.get<ListResponse<AdminTenant>>("/api/admin/tenants", undefined, s), []);
  const [announce, setAnnounce] = useState("");
  const [query, setQuery] = useState("");
  const changed = (msg: string) => {
    setAnnounce(msg);
    tenants.reload();
  };

  return (
    <>
      <header class="page-head">
        <h1>Tenants</h1>
      </header>
      <CreateTenant onCreated={(t) => changed(`Tenant ${t.name} created.`)} />
      <LiveText testid="tenants-status">{announce}</LiveText>
      <section class="section" aria-labelledby="tenants-title">
        <h2 id="tenants-title">All tenants</h2>
        {tenants.loading ? (
          <Loading label="Loading tenants…" testid="tenants-loading" />
        ) : tenants.error && !tenants.data ? (
          <ErrorBox error={tenants.error} onRetry={tenants.reload} testid="tenants-error" />
        ) : tenants.data && tenants.data.data.length === 0 ? (
          <Empty testid="tenants-empty">
            <p>No tenants yet. Create the first one above.</p>
          </Empty>
        ) : tenants.data ? (
          <>
            <div class="filters" role="search" aria-label="Find tenants">
              <div class="field grow">
                <label for="tenants-search">Search by name or slug</label>
                <input
                  id="tenants-search"
                  type="search"
                  value={query}
                  onInput={(e) => setQuery((e.target as HTMLInputElement).value)}
                  data-testid="tenants-search"
                />
              </div>
            </div>
            <TenantTable tenants={matching(tenants.data.data, query)} onChanged={changed} />
            <p class="muted small" aria-live="polite" data-testid="tenants-count">
              {matching(tenants.data.data, query).length} of {tenants.data.data.length} tenants
            </p>
          </>
        ) : null}
      </section>
    </>
  );
}

function matching(tenants: AdminTenant[], query: string): AdminTenant[] {
  const q = query.trim().toLowerCase();
  return q ? tenants.filter((t) => t.name.toLowerCase().includes(q) || t.slug.toLowerCase().includes(q)) : tenants;
}

function LimitInputs(props: { idPrefix: string; value: LimitsText; onChange: (v: LimitsText) => void; blank: "unlimited" | "default" }) {
  return (
    <fieldset class="limits">
      <legend>{props.blank === "default" ? "Limits (blank = the new-tenant default; edit later to make one unlimited)" : "Limits (blank = unlimited)"}</legend>
      <div class="grid-4">
        {LIMIT_FIELDS.map((f) => (
          <div class="field" key={f.key}>
            <label for={`${props.idPrefix}-${f.testid}`}>{f.label}</label>
            <input
              id={`${props.idPrefix}-${f.testid}`}
              inputMode="numeric"
              placeholder={props.blank}
              value={props.value[f.key]}
              aria-describedby={`${props.idPrefix}-${f.testid}-hint`}
              onInput={(e) => props.onChange({ ...props.value, [f.key]: (e.target as HTMLInputElement).value })}
              // Grouped as thousands once typed: 1000000 reads as 1,000,000.
              onBlur={(e) => props.onChange({ ...props.value, [f.key]: formatLimitText((e.target as HTMLInputElement).value) })}
              data-testid={`${props.idPrefix}-${f.testid}`}
            />
            <small id={`${props.idPrefix}-${f.testid}-hint`} class="muted">
              {f.unit}
            </small>
          </div>
        ))}
      </div>
    </fieldset>
  );
}

function CreateTenant({ onCreated }: { onCreated: (t: Tenant) => void }) {
  const { client } = useApp();
  const [name, setName] = useState("");
  const [slug, setSlug] = useState("");
  const [slugEdited, setSlugEdited] = useState(false);
  const [plan, setPlan] = useState("");
  const [limits, setLimits] = useState<LimitsText>(limitsToText(null));
  const action = useAction();

  const submit = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => {
      const t = await client.post<Tenant>("/api/admin/tenants", { name: name.trim(), slug: slug.trim(), plan: plan.trim(), limits: givenLimits(limitsOrThrow(limits)) });
      setName("");
      setSlug("");
      setSlugEdited(false);
      setPlan("");
      setLimits(limitsToText(null));
      onCreated(t);
    });
  };

  return (
    <details class="card create-tenant">
      <summary data-testid="create-tenant-open">Create a tenant</summary>
      <form onSubmit={submit} aria-label="Create a tenant">
        <div class="grid-3">
          <div class="field">
            <label for="tenant-name">Name</label>
            <input
              id="tenant-name"
              required
              value={name}
              onInput={(e) => {
                const v = (e.target as HTMLInputElement).value;
                setName(v);
                if (!slugEdited) setSlug(slugify(v));
              }}
              data-testid="tenant-name"
            />
          </div>
          <div class="field">
            <label for="tenant-slug">Slug</label>
            <input
              id="tenant-slug"
              required
              pattern="[a-z0-9][a-z0-9\-]*"
              title="Lower-case letters, digits and dashes"
              value={slug}
              onInput={(e) => {
                setSlug((e.target as HTMLInputElement).value);
                setSlugEdited(true);
              }}
              data-testid="tenant-slug"
            />
          </div>
          <div class="field">
            <label for="tenant-plan">Plan</label>
            <input id="tenant-plan" required list="plan-suggestions" value={plan} onInput={(e) => setPlan((e.target as HTMLInputElement).value)} data-testid="tenant-plan" />
          </div>
        </div>
        <PlanSuggestions />
        <LimitInputs idPrefix="tenant" value={limits} onChange={setLimits} blank="default" />
        <FormError error={action.error} testid="create-tenant-error" />
        <button type="submit" class="btn btn-primary" disabled={action.busy} data-testid="create-tenant">
          {action.busy ? "Creating…" : "Create tenant"}
        </button>
      </form>
    </details>
  );
}

/** The limits as the API wants them; a form mistake surfaces like an API error, in the form's error line. */
function limitsOrThrow(text: LimitsText) {
  const parsed = parseLimits(text);
  if (!parsed.ok) throw new Error(parsed.problem);
  return parsed.limits;
}

function PlanSuggestions() {
  return (
    <datalist id="plan-suggestions">
      <option value="free" />
      <option value="pro" />
      <option value="enterprise" />
    </datalist>
  );
}

function limitsSummary(t: Tenant): string {
  return `${formatLimit(t.limits.tokens_per_min)} tok/min · ${formatLimit(t.limits.requests_per_min)} req/min · ${formatLimit(t.limits.concurrent_requests)} concurrent · ${formatLimit(t.limits.monthly_token_budget)} tok/month`;
}

type PanelKind = "edit" | "user" | "status" | "users";

function TenantTable({ tenants, onChanged }: { tenants: AdminTenant[]; onChanged: (msg: string) => void }) {
  const [panel, setPanel] = useState<{ id: string; kind: PanelKind } | null>(null);
  const toggle = (id: string, kind: PanelKind) => setPanel(panel && panel.id === id && panel.kind === kind ? null : { id, kind });
  return (
    <TableScroll label="Tenants" testid="tenants-table" class="stack-on-mobile">
      <thead>
        <tr>
          <th scope="col">Tenant</th>
          <th scope="col">Plan</th>
          <th scope="col">Status</th>
          <th scope="col">Limits</th>
          <th scope="col" class="num">Tokens this month</th>
          <th scope="col" class="num">Billed this month</th>
          <th scope="col" class="num">Users</th>
          <th scope="col">
            <span class="sr-only">Actions</span>
          </th>
        </tr>
      </thead>
      <tbody>
        {tenants.map((t) => (
          <Fragment key={t.id}>
            <tr data-testid={`tenant-row-${t.slug}`}>
              <th scope="row">
                {t.name}
                <div class="muted small mono">{t.slug}</div>
              </th>
              <td data-label="Plan" data-testid={`tenant-plan-${t.slug}`}>{t.plan}</td>
              <td data-label="Status">
                <Badge text={t.status} testid={`tenant-status-${t.slug}`} />
              </td>
              <td class="small limits-cell wrap" data-label="Limits">{limitsSummary(t)}</td>
              <td class="num" data-label="Tokens this month">{formatInt(t.usage_this_month_tokens)}</td>
              <td class="num" data-label="Billed this month" data-testid={`tenant-billed-${t.slug}`} data-microusd={String(t.billed_this_month_microusd)}>
                {formatUsd(t.billed_this_month_microusd)}
              </td>
              <td class="num" data-label="Users">
                <button
                  type="button"
                  class="link-btn"
                  aria-expanded={panel?.id === t.id && panel.kind === "users"}
                  onClick={() => toggle(t.id, "users")}
                  data-testid={`tenant-users-${t.slug}`}
                >
                  {formatInt(t.user_count)}
                  <span class="sr-only"> users of {t.name}: {panel?.id === t.id && panel.kind === "users" ? "hide" : "show"}</span>
                </button>
              </td>
              <td class="actions">
                <Link to={`/admin/tenants/${encodeURIComponent(t.id)}/adapters`} class="btn btn-small" testid={`tenant-adapters-${t.slug}`}>
                  Adapters<span class="sr-only"> of {t.name}</span>
                </Link>
                <button type="button" class="btn btn-small" aria-expanded={panel?.id === t.id && panel.kind === "edit"} onClick={() => toggle(t.id, "edit")} data-testid={`tenant-edit-${t.slug}`}>
                  Edit<span class="sr-only"> {t.name}</span>
                </button>
                <button type="button" class="btn btn-small" aria-expanded={panel?.id === t.id && panel.kind === "user"} onClick={() => toggle(t.id, "user")} data-testid={`tenant-add-user-${t.slug}`}>
                  Add user<span class="sr-only"> to {t.name}</span>
                </button>
                <button
                  type="button"
                  class={t.status === "active" ? "btn btn-small btn-danger-ghost" : "btn btn-small"}
                  aria-expanded={panel?.id === t.id && panel.kind === "status"}
                  onClick={() => toggle(t.id, "status")}
                  data-testid={`tenant-toggle-${t.slug}`}
                >
                  {t.status === "active" ? "Suspend" : "Activate"}
                  <span class="sr-only"> {t.name}</span>
                </button>
              </td>
            </tr>
            {panel?.id === t.id && (
              <tr class="panel-row">
                <td colSpan={8} class="wrap">
                  {panel.kind === "users" && <UserList tenant={t} />}
                  {panel.kind === "edit" && <EditTenant tenant={t} onDone={(msg) => { setPanel(null); if (msg) onChanged(msg); }} />}
                  {panel.kind === "user" && <AddUser tenant={t} onDone={(msg) => { setPanel(null); if (msg) onChanged(msg); }} />}
                  {panel.kind === "status" && <ToggleStatus tenant={t} onDone={(msg) => { setPanel(null); if (msg) onChanged(msg); }} />}
                </td>
              </tr>
            )}
          </Fragment>
        ))}
      </tbody>
    </TableScroll>
  );
}

function EditTenant({ tenant, onDone }: { tenant: Tenant; onDone: (msg: string | null) => void }) {
  const { client } = useApp();
  const [name, setName] = useState(tenant.name);
  const [plan, setPlan] = useState(tenant.plan);
  const [limits, setLimits] = useState<LimitsText>(limitsToText(tenant.limits));
  const action = useAction();
  const submit = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => {
      const body = { name: name.trim(), plan: plan.trim(), limits: limitsOrThrow(limits) };
      const t = await client.patch<Tenant>(`/api/admin/tenants/${encodeURIComponent(tenant.id)}`, body);
      onDone(`Tenant ${t.name} saved.`);
    });
  };
  return (
    <form class="panel" onSubmit={submit} aria-label={`Edit ${tenant.name}`} data-testid="edit-tenant-form">
      <div class="grid-3">
        <div class="field">
          <label for={`edit-name-${tenant.id}`}>Name</label>
          <input id={`edit-name-${tenant.id}`} required value={name} onInput={(e) => setName((e.target as HTMLInputElement).value)} data-testid="edit-tenant-name" />
        </div>
        <div class="field">
          <label for={`edit-plan-${tenant.id}`}>Plan</label>
          <input id={`edit-plan-${tenant.id}`} required list="plan-suggestions" value={plan} onInput={(e) => setPlan((e.target as HTMLInputElement).value)} data-testid="edit-tenant-plan" />
        </div>
      </div>
      <PlanSuggestions />
      <LimitInputs idPrefix="edit" value={limits} onChange={setLimits} blank="unlimited" />
      <FormError error={action.error} testid="edit-tenant-error" />
      <div class="row">
        <button type="submit" class="btn btn-primary" disabled={action.busy} data-testid="edit-tenant-save">
          {action.busy ? "Saving…" : "Save"}
        </button>
        <button type="button" class="btn btn-ghost" onClick={() => onDone(null)}>
          Cancel
        </button>
      </div>
    </form>
  );
}

function ToggleStatus({ tenant, onDone }: { tenant: Tenant; onDone: (msg: string | null) => void }) {
  const { client } = useApp();
  const action = useAction();
  const next = tenant.status === "active" ? "suspended" : "active";
  const go = () =>
    action.run(async () => {
      const t = await client.patch<Tenant>(`/api/admin/tenants/${encodeURIComponent(tenant.id)}`, { status: next });
      onDone(`Tenant ${t.name} is now ${t.status}.`);
    });
  return (
    <div class="panel">
      <p>
        {next === "suspended"
          ? `Suspend ${tenant.name}? Its API keys stop working until it is activated again; data is kept.`
          : `Activate ${tenant.name}? Its API keys work again.`}
      </p>
      <div class="row">
        <button type="button" class={next === "suspended" ? "btn btn-danger" : "btn btn-primary"} disabled={action.busy} onClick={go} autoFocus data-testid="tenant-status-confirm">
          {next === "suspended" ? "Suspend" : "Activate"} {tenant.name}
        </button>
        <button type="button" class="btn btn-ghost" onClick={() => onDone(null)}>
          Cancel
        </button>
      </div>
      <FormError error={action.error} testid="tenant-status-error" />
    </div>
  );
}

/** The people who sign in for one tenant. */
function UserList({ tenant }: { tenant: AdminTenant }) {
  const { client } = useApp();
  const users = useApi((s) => client.get<ListResponse<TenantUser>>(`/api/admin/tenants/${encodeURIComponent(tenant.id)}/users`, undefined, s), [tenant.id]);
  const now = new Date();
  return (
    <div class="panel" data-testid="tenant-users-panel">
      <h3 class="h4">Users of {tenant.name}</h3>
      {users.loading ? (
        <Loading label="Loading users…" />
      ) : users.error ? (
        <ErrorBox error={users.error} onRetry={users.reload} />
      ) : users.data && users.data.data.length === 0 ? (
        <p class="muted">No users yet: add one with “Add user”.</p>
      ) : (
        <ul class="plain-list user-list" data-testid="tenant-users-list">
          {users.data?.data.map((u) => (
            <li key={u.id} data-testid={`tenant-user-${u.email}`}>
              <strong>{u.email}</strong> <Badge text={u.role.replace("tenant_", "")} tone="info" />
              {u.disabled && (
                <>
                  {" "}
                  <Badge text="disabled" tone="bad" />
                </>
              )}
              <span class="muted small">
                {" "}
                · added {formatDateTime(u.created_at).slice(0, 10)} · last sign-in{" "}
                <span title={formatDateTime(u.last_login_at)}>{relativeTime(u.last_login_at, now)}</span>
              </span>
            </li>
          ))}
        </ul>
      )}
    </div>
  );
}

const USER_ROLES: Role[] = ["tenant_admin", "tenant_member"];

function AddUser({ tenant, onDone }: { tenant: Tenant; onDone: (msg: string | null) => void }) {
  const { client } = useApp();
  const [email, setEmail] = useState("");
  const [password, setPassword] = useState("");
  const [role, setRole] = useState<Role>("tenant_member");
  const action = useAction();
  const submit = (ev: Event) => {
    ev.preventDefault();
    void action.run(async () => {
      const u = await client.post<User>(`/api/admin/tenants/${encodeURIComponent(tenant.id)}/users`, { email: email.trim(), password, role });
      onDone(`User ${u.email} added to ${tenant.name} as ${u.role}.`);
    });
  };
  return (
    <form class="panel" onSubmit={submit} aria-label={`Add a user to ${tenant.name}`} data-testid="add-user-form">
      <div class="grid-3">
        <div class="field">
          <label for={`user-email-${tenant.id}`}>Email</label>
          <input id={`user-email-${tenant.id}`} type="email" required autocomplete="off" value={email} onInput={(e) => setEmail((e.target as HTMLInputElement).value)} data-testid="user-email" />
        </div>
        <div class="field">
          <label for={`user-password-${tenant.id}`}>Initial password</label>
          <input id={`user-password-${tenant.id}`} type="password" required minLength={8} autocomplete="new-password" value={password} onInput={(e) => setPassword((e.target as HTMLInputElement).value)} data-testid="user-password" />
        </div>
        <div class="field">
          <label for={`user-role-${tenant.id}`}>Role</label>
          <select id={`user-role-${tenant.id}`} value={role} onChange={(e) => setRole((e.target as HTMLSelectElement).value as Role)} data-testid="user-role">
            {USER_ROLES.map((r) => (
              <option key={r} value={r}>
                {r}
              </option>
            ))}
          </select>
        </div>
      </div>
      <FormError error={action.error} testid="add-user-error" />
      <div class="row">
        <button type="submit" class="btn btn-primary" disabled={action.busy} data-testid="add-user-submit">
          {action.busy ? "Adding…" : "Add user"}
        </button>
        <button type="button" class="btn btn-ghost" onClick={() => onDone(null)}>
          Cancel
        </button>
      </div>
    </form>
  );
}
