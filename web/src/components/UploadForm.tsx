/** Adapter upload with a real transfer progress bar (XMLHttpRequest upload events). */
import { useRef, useState } from "preact/hooks";
import type { AdminTenant, ListResponse, UploadAccepted, VersionStatus } from "../api/types";
import type { UploadHandle, UploadProgress } from "../api/client";
import { useApp } from "../context";
import { formatBytes } from "../lib/format";
import { buildUploadForm, totalBytes, uploadProblem, type UploadMode } from "../lib/upload";
import { useApi } from "../lib/useApi";
import { ErrorBox, FormError, Loading } from "./Status";

type Phase = "idle" | "sending" | "processing" | "done";

/** What the status line says once the transfer is done: the accepted version's status, as the panel below polls it. */
export function doneMessage(status: VersionStatus | null | undefined): string {
  if (status === "ready") return "Upload complete; the version passed the quality gate and is ready.";
  if (status === "rejected") return "Upload complete; the version was rejected (the reasons are below).";
  if (status === "evaluating") return "Upload complete; the quality gate is evaluating the version.";
  return "Upload complete; the version is being validated.";
}

export function UploadForm(props: {
  scope: "admin" | "tenant";
  onAccepted: (a: UploadAccepted, name: string) => void;
  /** The accepted version's current status (the page polls it), so the status line never goes stale. */
  versionStatus?: VersionStatus | null;
}) {
  const { client } = useApp();
  const tenants = useApi(
    (s) => (props.scope === "admin" ? client.get<ListResponse<AdminTenant>>("/api/admin/tenants", undefined, s) : Promise.resolve(null)),
    [props.scope],
  );
  const [tenantId, setTenantId] = useState("");
  const [name, setName] = useState("");
  const [mode, setMode] = useState<UploadMode>("archive");
  const [files, setFiles] = useState<File[]>([]);
  const [evalSet, setEvalSet] = useState<File | null>(null);
  const [minMargin, setMinMargin] = useState("");
  const [minFp8, setMinFp8] = useState("");
  const [phase, setPhase] = useState<Phase>("idle");
  const [progress, setProgress] = useState<UploadProgress | null>(null);
  const [error, setError] = useState<Error | null>(null);
  const handle = useRef<UploadHandle<UploadAccepted> | null>(null);
  const fileInput = useRef<HTMLInputElement>(null);

  const tenantList = tenants.data?.data ?? [];
  const selectedTenant = tenantId || (tenantList.length === 1 ? tenantList[0].id : "");

  const submit = async (ev: Event) => {
    ev.preventDefault();
    setError(null);
    const fields = { name, mode, files, evalSet, minMargin, minFp8Agreement: minFp8 };
    const problem = props.scope === "admin" && !selectedTenant ? "Choose the tenant the adapter belongs to." : uploadProblem(fields);
    if (problem) {
      setError(new Error(problem));
      return;
    }
    const path =
      props.scope === "admin" ? `/api/admin/tenants/${encodeURIComponent(selectedTenant)}/adapters` : "/api/tenant/adapters";
    setPhase("sending");
    setProgress({ loaded: 0, total: totalBytes(files) + (evalSet?.size ?? 0), fraction: 0 });
    const h = client.upload<UploadAccepted>(path, buildUploadForm(fields), (p) => {
      setProgress(p);
      if (p.fraction !== null && p.fraction >= 1) setPhase("processing");
    });
    handle.current = h;
    try {
      const accepted = await h.promise;
      setFiles([]);
      setEvalSet(null);
      if (fileInput.current) fileInput.current.value = "";
      // The bar stays at 100% so the finished transfer remains visible next to the status below.
      setProgress((p) => ({ loaded: p?.total ?? p?.loaded ?? 0, total: p?.total ?? null, fraction: 1 }));
      setPhase("done");
      props.onAccepted(accepted, name.trim());
    } catch (exc) {
      setError(exc as Error);
      setPhase("idle");
    } finally {
      handle.current = null;
    }
  };

  const busy = phase === "sending" || phase === "processing";
  const pct = progress?.fraction != null ? Math.round(progress.fraction * 100) : null;

  if (props.scope === "admin" && tenants.loading) return <Loading label="Loading tenants…" />;
  if (props.scope === "admin" && tenants.error) return <ErrorBox error={tenants.error} onRetry={tenants.reload} />;

  return (
    <form class="card upload" onSubmit={submit} aria-labelledby="upload-title" data-testid="upload-form">
      <h2 id="upload-title" class="h3">
        Upload a LoRA adapter
      </h2>
      <p class="muted">
        PEFT format: <code>adapter_config.json</code> + <code>adapter_model.safetensors</code>, loose or in one archive. It is
        validated, then evaluated by the quality gate, before any traffic can reach it.
      </p>
      {/* Editing any field clears the previous attempt's error: it described other input. */}
      <fieldset disabled={busy} onInput={() => setError(null)} onChange={() => setError(null)}>
        <legend class="sr-only">Adapter</legend>
        <div class="grid-2">
          {props.scope === "admin" && (
            <div class="field">
              <label for="upload-tenant">Tenant</label>
              <select
                id="upload-tenant"
                required
                value={selectedTenant}
                onChange={(e) => setTenantId((e.target as HTMLSelectElement).value)}
                data-testid="upload-tenant"
              >
                <option value="">Choose a tenant…</option>
                {tenantList.map((t) => (
                  <option key={t.id} value={t.id}>
                    {t.name} ({t.slug})
                  </option>
                ))}
              </select>
            </div>
          )}
          <div class="field">
            <label for="upload-name">Adapter name</label>
            <input
              id="upload-name"
              required
              value={name}
              pattern="[A-Za-z0-9][A-Za-z0-9._\-]*"
              title="Letters, digits, dot, dash and underscore"
              aria-describedby="upload-name-help"
              onInput={(e) => setName((e.target as HTMLInputElement).value)}
              data-testid="upload-name"
            />
            <small id="upload-name-help" class="muted">
              Callers use it as <code>model</code>; uploading an existing name adds a new version.
            </small>
          </div>
        </div>

        <fieldset class="radios">
          <legend>Files</legend>
          <label>
            <input type="radio" name="upload-mode" checked={mode === "archive"} onChange={() => { setMode("archive"); setFiles([]); }} data-testid="upload-mode-archive" />
            One archive (.tar.gz or .zip)
          </label>
          <label>
            <input type="radio" name="upload-mode" checked={mode === "files"} onChange={() => { setMode("files"); setFiles([]); }} data-testid="upload-mode-files" />
            Two files
          </label>
        </fieldset>
        <div class="field">
          <label for="upload-file">{mode === "archive" ? "Adapter archive" : "adapter_config.json and adapter_model.safetensors"}</label>
          <input
            id="upload-file"
            ref={fileInput}
            type="file"
            key={mode}
            multiple={mode === "files"}
            accept={mode === "archive" ? ".tar.gz,.tgz,.zip,application/gzip,application/zip" : ".json,.safetensors"}
            onChange={(e) => setFiles(Array.from((e.target as HTMLInputElement).files ?? []))}
            data-testid="upload-file"
          />
          {files.length > 0 && (
            <small class="muted" data-testid="upload-selected">
              {files.map((f) => `${f.name} (${formatBytes(f.size)})`).join(", ")}
            </small>
          )}
        </div>

        <details class="advanced">
          <summary>Quality gate options</summary>
          <div class="grid-3">
            <div class="field">
              <label for="upload-eval-set">Eval set (JSONL, optional)</label>
              <input
                id="upload-eval-set"
                type="file"
                accept=".jsonl,application/jsonl,application/x-ndjson"
                onChange={(e) => setEvalSet((e.target as HTMLInputElement).files?.[0] ?? null)}
                data-testid="upload-eval-set"
              />
            </div>
            <div class="field">
              <label for="upload-min-margin">Minimum margin over base</label>
              <input id="upload-min-margin" type="number" step="any" inputMode="decimal" value={minMargin} placeholder="default" onInput={(e) => setMinMargin((e.target as HTMLInputElement).value)} data-testid="upload-min-margin" />
            </div>
            <div class="field">
              <label for="upload-min-fp8">Minimum FP8 agreement</label>
              <input id="upload-min-fp8" type="number" step="any" min="0" max="1" inputMode="decimal" value={minFp8} placeholder="default" onInput={(e) => setMinFp8((e.target as HTMLInputElement).value)} data-testid="upload-min-fp8" />
            </div>
          </div>
        </details>
      </fieldset>

      {phase !== "idle" && (
        <div class="upload-progress">
          <label for="upload-progress-bar">{phase === "sending" ? "Sending" : phase === "processing" ? "Sent; waiting for the server" : "Uploaded"}</label>
          <progress
            id="upload-progress-bar"
            max={100}
            value={pct ?? undefined}
            data-testid="upload-progress"
            data-phase={phase}
            aria-valuetext={pct === null ? "size unknown" : `${pct}%`}
          />
          <span data-testid="upload-percent">
            {pct === null ? "…" : `${pct}%`}
            {progress && progress.total ? ` · ${formatBytes(progress.loaded)} of ${formatBytes(progress.total)}` : ""}
          </span>
        </div>
      )}
      <p class="live" aria-live="polite" data-testid="upload-status">
        {phase === "sending"
          ? `Uploading: ${Math.floor((pct ?? 0) / 25) * 25}%` /* coarse steps: a screen reader should not read every event */
          : phase === "processing"
            ? "Upload sent; the server is storing it."
            : phase === "done"
              ? doneMessage(props.versionStatus)
              : ""}
      </p>
      <FormError error={error} testid="upload-error" />
      <div class="row">
        <button type="submit" class="btn btn-primary" disabled={busy} data-testid="upload-submit">
          {busy ? "Uploading…" : "Upload"}
        </button>
        {busy && (
          <button type="button" class="btn btn-ghost" onClick={() => handle.current?.abort()} data-testid="upload-cancel">
            Cancel upload
          </button>
        )}
      </div>
    </form>
  );
}
