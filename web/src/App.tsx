/** The shell: restores the session, shows sign-in or the role's navigation, and routes to pages. */
import type { ComponentChildren } from "preact";
import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import { ApiClient } from "./api/client";
import type { Session, User } from "./api/types";
import { Link } from "./components/Link";
import { ErrorBox, Loading } from "./components/Status";
import { AppContext, useApp } from "./context";
import { AdaptersPage } from "./pages/AdaptersPage";
import { BatchesPage } from "./pages/BatchesPage";
import { EnginesPage } from "./pages/EnginesPage";
import { FinancePage } from "./pages/FinancePage";
import { KeysPage } from "./pages/KeysPage";
import { LoginPage } from "./pages/LoginPage";
import { PlaygroundPage } from "./pages/PlaygroundPage";
import { TenantsPage } from "./pages/TenantsPage";
import { UploadPage } from "./pages/UploadPage";
import { UsagePage } from "./pages/UsagePage";
import { VersionPage } from "./pages/VersionPage";
import { ROLE_LABEL, canOpen, homeFor, navFor } from "./lib/roles";
import { matchRoute, navigate, useLocation } from "./lib/router";
import { hasSessionHint, setSessionHint } from "./lib/sessionHint";

type Boot = { state: "loading" } | { state: "error"; error: Error } | { state: "signed-out"; notice: string | null } | { state: "signed-in"; session: Session };

export function App({ client }: { client?: ApiClient }) {
  const api = useMemo(() => client ?? new ApiClient(), [client]);
  const [boot, setBoot] = useState<Boot>({ state: "loading" });

  const restore = () => {
    if (!hasSessionHint()) {
      setBoot({ state: "signed-out", notice: null });
      return;
    }
    setBoot({ state: "loading" });
    api.me().then(
      (s) => {
        setSessionHint(s !== null);
        setBoot(s ? { state: "signed-in", session: s } : { state: "signed-out", notice: null });
      },
      (exc: Error) => setBoot({ state: "error", error: exc }),
    );
  };

  useEffect(() => {
    api.onUnauthorized = () => {
      setSessionHint(false);
      setBoot({ state: "signed-out", notice: "Your session has ended. Sign in again to continue." });
    };
    restore();
    return () => {
      api.onUnauthorized = null;
    };
  }, [api]);

  if (boot.state === "loading") {
    return (
      <main id="main" class="boot">
        <Loading label="Starting Multiplex…" testid="boot-loading" />
      </main>
    );
  }
  if (boot.state === "error") {
    return (
      <main id="main" class="boot">
        <ErrorBox error={boot.error} onRetry={restore} testid="boot-error" />
      </main>
    );
  }
  if (boot.state === "signed-out") {
    return (
      <LoginPage
        client={api}
        notice={boot.notice}
        onSignedIn={(s) => {
          setSessionHint(true);
          if (!canOpen(s.user.role, window.location.pathname)) navigate(homeFor(s.user.role), { replace: true });
          setBoot({ state: "signed-in", session: s });
        }}
      />
    );
  }
  return (
    <AppContext.Provider value={{ client: api, user: boot.session.user }}>
      <Shell
        user={boot.session.user}
        onSignedOut={() => {
          setSessionHint(false);
          setBoot({ state: "signed-out", notice: "You are signed out." });
        }}
      />
    </AppContext.Provider>
  );
}

interface Resolved {
  title: string;
  page: ComponentChildren;
}

function resolve(user: User, path: string): Resolved | null {
  if (!canOpen(user.role, path)) return null;
  const exact: Record<string, () => Resolved> = {
    "/usage": () => ({ title: "Usage", page: <UsagePage /> }),
    "/keys": () => ({ title: "API keys", page: <KeysPage /> }),
    "/adapters": () => ({ title: "Adapters", page: <AdaptersPage /> }),
    "/playground": () => ({ title: "Playground", page: <PlaygroundPage /> }),
    "/batches": () => ({ title: "Batches", page: <BatchesPage /> }),
    "/admin/tenants": () => ({ title: "Tenants", page: <TenantsPage /> }),
    "/admin/upload": () => ({ title: "Upload adapter", page: <UploadPage scope="admin" /> }),
    "/admin/engines": () => ({ title: "Engines", page: <EnginesPage /> }),
    "/finance": () => ({ title: "Finance", page: <FinancePage /> }),
  };
  const clean = path.replace(/\/+$/, "") || "/";
  if (exact[clean]) return exact[clean]();
  if (clean === "/adapters/upload" && user.role === "tenant_admin") return { title: "Upload adapter", page: <UploadPage scope="tenant" /> };
  const tenantAdapters = matchRoute("/admin/tenants/:id/adapters", clean);
  if (tenantAdapters) return { title: "Adapters", page: <AdaptersPage key={tenantAdapters.id} tenantId={tenantAdapters.id} /> };
  for (const pattern of ["/admin/versions/:id", "/adapters/versions/:id"]) {
    const m = matchRoute(pattern, clean);
    if (m) return { title: "Adapter version", page: <VersionPage key={m.id} versionId={m.id} /> };
  }
  return null;
}

/** Paths that only mean "wherever this user starts"; redirected, never shown as not found. */
const isRoot = (path: string) => path === "/" || path === "" || path === "/login";

function Shell({ user, onSignedOut }: { user: User; onSignedOut: () => void }) {
  const { path } = useLocation();
  const main = useRef<HTMLElement>(null);
  const first = useRef(true);
  const nav = navFor(user.role);

  useEffect(() => {
    if (isRoot(path)) navigate(homeFor(user.role), { replace: true });
  }, [path, user.role]);

  const resolved = resolve(user, path);
  useEffect(() => {
    document.title = `${resolved?.title ?? "Not found"} · Multiplex`;
    // Move focus to the new page for keyboard and screen-reader users, but not on first load.
    if (!first.current) main.current?.focus();
    first.current = false;
  }, [path]);

  return (
    <div class="layout">
      <a href="#main" class="skip-link">
        Skip to content
      </a>
      <header class="topbar">
        <div class="topbar-inner">
          <Link to={homeFor(user.role)} class="brand">
            <span class="brand-mark" aria-hidden="true">
              ◆
            </span>{" "}
            Multiplex
          </Link>
          <nav aria-label="Main" class="nav">
            <ul>
              {nav.map((n) => (
                <li key={n.path}>
                  <Link to={n.path} testid={n.testid} current={path === n.path || path.startsWith(`${n.path}/`)}>
                    {n.label}
                  </Link>
                </li>
              ))}
            </ul>
          </nav>
          <UserMenu user={user} onSignedOut={onSignedOut} />
        </div>
      </header>
      <main id="main" ref={main} tabIndex={-1} class="content">
        {resolved ? resolved.page : isRoot(path) ? null : <NotFound home={homeFor(user.role)} />}
      </main>
    </div>
  );
}

function UserMenu({ user, onSignedOut }: { user: User; onSignedOut: () => void }) {
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const { client } = useApp();
  return (
    <div class="user">
      <span class="user-who" data-testid="current-user">
        <span class="user-email">{user.email}</span>
        <span class="muted small" data-testid="current-user-role">
          {ROLE_LABEL[user.role]}
          {user.tenant_name ? ` · ${user.tenant_name}` : ""}
        </span>
      </span>
      <button
        type="button"
        class="btn btn-small"
        disabled={busy}
        data-testid="sign-out"
        onClick={async () => {
          setBusy(true);
          setError(null);
          try {
            await client.logout();
            onSignedOut();
          } catch (exc) {
            setError(`Sign-out failed: ${(exc as Error).message}`);
            setBusy(false);
          }
        }}
      >
        Sign out
      </button>
      {error && (
        <p class="form-error" role="alert">
          {error}
        </p>
      )}
    </div>
  );
}

function NotFound({ home }: { home: string }) {
  return (
    <div data-testid="not-found">
      <h1>Page not found</h1>
      <p>This page does not exist or is not available to your role.</p>
      <p>
        <Link to={home}>Go to your start page</Link>
      </p>
    </div>
  );
}
