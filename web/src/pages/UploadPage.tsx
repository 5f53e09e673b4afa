/** Upload an adapter (admins for any tenant, tenant admins for their own) and watch it go through the gate. */
import { useState } from "preact/hooks";
import type { UploadAccepted, VersionStatus } from "../api/types";
import { Link } from "../components/Link";
import { UploadForm } from "../components/UploadForm";
import { useApp } from "../context";
import { navigate } from "../lib/router";
import { VersionStatusPanel } from "./VersionPage";

interface RecentUpload {
  versionId: string;
  name: string;
  version: number;
  at: string;
}

const RECENT_KEY = "mplex.recentUploads";

// Remembered per browser tab so an admin can get back to an upload's status page after navigating away.
function loadRecent(): RecentUpload[] {
  try {
    const raw = sessionStorage.getItem(RECENT_KEY);
    const parsed: unknown = raw ? JSON.parse(raw) : [];
    return Array.isArray(parsed) ? (parsed as RecentUpload[]) : [];
  } catch {
    return [];
  }
}

export function UploadPage({ scope }: { scope: "admin" | "tenant" }) {
  const { user } = useApp();
  const [recent, setRecent] = useState<RecentUpload[]>(loadRecent);
  const [current, setCurrent] = useState<string | null>(null);
  const [currentStatus, setCurrentStatus] = useState<VersionStatus | null>(null);
  const [lookup, setLookup] = useState("");
  const versionsBase = scope === "admin" ? "/admin/versions" : "/adapters/versions";

  const onAccepted = (a: UploadAccepted, name: string) => {
    const next = [{ versionId: a.version_id, name, version: a.version, at: new Date().toISOString() }, ...recent].slice(0, 10);
    setRecent(next);
    try {
      sessionStorage.setItem(RECENT_KEY, JSON.stringify(next));
    } catch {
      // storage full or disabled: the list just is not remembered
    }
    setCurrentStatus(a.status);
    setCurrent(a.version_id);
  };

  return (
    <>
      <header class="page-head">
        {scope === "tenant" && (
          <Link to="/adapters" class="back">
            ← Back to adapters
          </Link>
        )}
        <h1>Upload adapter</h1>
        {scope === "tenant" && user.tenant_name && <p class="muted">For {user.tenant_name}</p>}
      </header>
      <UploadForm scope={scope} onAccepted={onAccepted} versionStatus={currentStatus} />
      {current && (
        <section class="section" aria-labelledby="current-upload-title">
          <h2 id="current-upload-title">Status</h2>
          <VersionStatusPanel versionId={current} onVersion={(v) => v.id === current && setCurrentStatus(v.status)} />
          <p>
            <Link to={`${versionsBase}/${encodeURIComponent(current)}`} testid="version-link">
              Open this version's page
            </Link>
          </p>
        </section>
      )}
      {recent.length > 0 && (
        <section class="section" aria-labelledby="recent-title">
          <h2 id="recent-title">Uploaded from this tab</h2>
          <ul class="plain-list" data-testid="recent-uploads">
            {recent.map((r) => (
              <li key={r.versionId}>
                <Link to={`${versionsBase}/${encodeURIComponent(r.versionId)}`}>
                  {r.name} v{r.version}
                </Link>{" "}
                <span class="muted small">{r.at.slice(0, 16).replace("T", " ")} UTC</span>
              </li>
            ))}
          </ul>
        </section>
      )}
      {scope === "admin" && (
        <form
          class="row section"
          onSubmit={(ev) => {
            ev.preventDefault();
            if (lookup.trim()) navigate(`${versionsBase}/${encodeURIComponent(lookup.trim())}`);
          }}
        >
          <div class="field grow">
            <label for="version-lookup">Open a version by id</label>
            <input id="version-lookup" class="mono" value={lookup} onInput={(e) => setLookup((e.target as HTMLInputElement).value)} data-testid="version-lookup" />
          </div>
          <button type="submit" class="btn">
            Open
          </button>
        </form>
      )}
    </>
  );
}
