/** Try the base model or one of the tenant's ready adapters in the browser: a chat completion streamed through the
 * real OpenAI API (/v1), its tokens and (from the ledger) its cost, and the same call as curl and Python.
 *
 * Credentials: by default a temporary key made for this browser (POST /api/tenant/playground/key: 30 minutes,
 * inference only, throttled, revoked at sign-out); or one of the tenant's own keys, pasted. Either lives in this
 * tab's memory only and is sent only to /v1 — never the session cookie (`credentials: "omit"`), so /v1 stays a
 * bearer-token API with no cross-site request surface. */
import { useEffect, useMemo, useRef, useState } from "preact/hooks";
import { errorFromBody } from "../api/client";
import type { PlaygroundKey, RequestRecord } from "../api/types";
import { CopyButton } from "../components/CopyButton";
import { Segmented } from "../components/Segmented";
import { ErrorBox, Loading } from "../components/Status";
import { useApp } from "../context";
import { formatInt } from "../lib/format";
import { formatUsd } from "../lib/money";
import { SseReader, curlSnippet, pythonSnippet, readChunk, requestBody, type PlaygroundRequest, type StreamUsage } from "../lib/playground";

type AuthMode = "session" | "key";
type Phase = "idle" | "connecting" | "streaming" | "done" | "stopped" | "error";

interface Run {
  phase: Phase;
  text: string;
  requestId: string | null;
  usage: StreamUsage | null;
  finish: string | null;
  firstTokenMs: number | null;
  totalMs: number | null;
  error: string | null;
}

const IDLE: Run = { phase: "idle", text: "", requestId: null, usage: null, finish: null, firstTokenMs: null, totalMs: null, error: null };
const MIN_KEY_LIFE_MS = 60_000; // mint a fresh temporary key rather than start a request on one about to expire

// The temporary key outlives a visit to another page of this tab (not a reload): one key per user and tab.
let cachedKey: { userId: string; key: PlaygroundKey } | null = null;

export function PlaygroundPage() {
  const { client, user } = useApp();
  const [auth, setAuth] = useState<AuthMode>("session");
  const [ownKey, setOwnKey] = useState("");
  const [models, setModels] = useState<string[] | null>(null);
  const [modelsError, setModelsError] = useState<Error | null>(null);
  const [model, setModel] = useState("");
  const [system, setSystem] = useState("");
  const [prompt, setPrompt] = useState("");
  const [maxTokens, setMaxTokens] = useState("64");
  const [temperature, setTemperature] = useState("0.7");
  const [run, setRun] = useState<Run>(IDLE);
  const [record, setRecord] = useState<RequestRecord | null>(null);
  const [recordNote, setRecordNote] = useState("");
  const [snippet, setSnippet] = useState<"curl" | "python">("curl");
  const [keyInfo, setKeyInfo] = useState<PlaygroundKey | null>(cachedKey?.userId === user.id ? cachedKey.key : null);
  const controller = useRef<AbortController | null>(null);
  const baseUrl = `${window.location.origin}/v1`;

  /** The bearer token for /v1: the pasted key, or a temporary key (minted when missing, expiring or refused). */
  const credential = async (fresh = false): Promise<string> => {
    if (auth === "key") {
      const k = ownKey.trim();
      if (!k) throw new Error("Paste one of your API keys first (it starts with mpx_).");
      return k;
    }
    const cached = cachedKey?.userId === user.id ? cachedKey.key : null;
    if (!fresh && cached && new Date(cached.expires_at).getTime() - Date.now() > MIN_KEY_LIFE_MS) return cached.key;
    const minted = await client.post<PlaygroundKey>("/api/tenant/playground/key");
    cachedKey = { userId: user.id, key: minted };
    setKeyInfo(minted);
    return minted.key;
  };

  /** A /v1 call with the credential; a temporary key refused (replaced by another tab, expired) is renewed once. */
  const v1 = async (path: string, init: RequestInit = {}): Promise<Response> => {
    const call = async (fresh: boolean) =>
      fetch(path, {
        ...init,
        credentials: "omit",
        headers: { ...(init.headers as Record<string, string>), Authorization: `Bearer ${await credential(fresh)}` },
      });
    const res = await call(false);
    return res.status === 401 && auth === "session" ? call(true) : res;
  };

  const loadModels = async () => {
    setModelsError(null);
    setModels(null);
    try {
      const res = await v1("/v1/models", { headers: { Accept: "application/json" } });
      const text = await res.text();
      if (!res.ok) throw errorFromBody(res.status, res.statusText, text);
      const ids = (JSON.parse(text) as { data: { id: string }[] }).data.map((m) => m.id);
      setModels(ids);
      setModel((m) => (m && ids.includes(m) ? m : (ids[0] ?? "")));
    } catch (exc) {
      setModelsError(exc as Error);
      setModels([]);
    }
  };

  useEffect(() => {
    if (auth === "session") void loadModels();
    else setModels(null);
    return () => controller.current?.abort();
  }, [auth]);

  const request: PlaygroundRequest = useMemo(
    () => ({
      model: model || "MODEL",
      messages: [...(system.trim() ? [{ role: "system" as const, content: system.trim() }] : []), { role: "user" as const, content: prompt || "Hello!" }],
      max_tokens: Math.max(1, Math.min(4096, Math.round(Number(maxTokens)) || 64)),
      temperature: Math.max(0, Math.min(2, Number(temperature) || 0)),
    }),
    [model, system, prompt, maxTokens, temperature],
  );

  /** The ledger's record of the request (written just after the stream ends): tokens and the price of this call. */
  const fetchRecord = async (id: string) => {
    setRecordNote("Looking up the cost in the usage ledger…");
    for (let attempt = 0; attempt < 20; attempt++) {
      try {
        const r = await client.get<RequestRecord>(`/api/tenant/requests/${encodeURIComponent(id)}`);
        setRecord(r);
        setRecordNote("");
        return;
      } catch {
        await new Promise((resolve) => setTimeout(resolve, 500));
      }
    }
    setRecordNote("Not in this tenant's ledger yet (a key of another tenant is billed there).");
  };

  const send = async (ev: Event) => {
    ev.preventDefault();
    if (!model || !prompt.trim()) return;
    controller.current?.abort();
    const ctl = new AbortController();
    controller.current = ctl;
    setRecord(null);
    setRecordNote("");
    setRun({ ...IDLE, phase: "connecting" });
    const t0 = performance.now();
    let requestId: string | null = null;
    try {
      const res = await v1("/v1/chat/completions", {
        method: "POST",
        headers: { "Content-Type": "application/json", Accept: "text/event-stream" },
        body: JSON.stringify(requestBody(request)),
        signal: ctl.signal,
      });
      if (!res.ok || !res.body) throw errorFromBody(res.status, res.statusText, await res.text());
      requestId = res.headers.get("x-request-id");
      setRun((r) => ({ ...r, phase: "streaming", requestId }));
      const reader = res.body.getReader();
      const decoder = new TextDecoder();
      const sse = new SseReader();
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        for (const payload of sse.push(decoder.decode(value, { stream: true }))) {
          const c = readChunk(payload);
          if (!c) continue;
          requestId = requestId ?? c.id;
          setRun((r) => ({
            ...r,
            text: r.text + c.text,
            firstTokenMs: r.firstTokenMs ?? (c.text ? Math.round(performance.now() - t0) : null),
            finish: c.finish ?? r.finish,
            usage: c.usage ?? r.usage,
            requestId: r.requestId ?? c.id,
          }));
        }
      }
      setRun((r) => ({ ...r, phase: "done", totalMs: Math.round(performance.now() - t0) }));
    } catch (exc) {
      if (exc instanceof DOMException && exc.name === "AbortError") {
        setRun((r) => ({ ...r, phase: "stopped", totalMs: Math.round(performance.now() - t0) }));
      } else {
        setRun((r) => ({ ...r, phase: "error", error: (exc as Error).message }));
        return;
      }
    } finally {
      if (controller.current === ctl) controller.current = null;
    }
    if (requestId) void fetchRecord(requestId);
  };

  const busy = run.phase === "connecting" || run.phase === "streaming";
  const u = run.usage;
  const cached = u?.prompt_tokens_details?.cached_tokens ?? record?.cached_tokens ?? 0;
  const tps = u && run.totalMs && run.firstTokenMs !== null && run.totalMs > run.firstTokenMs ? (u.completion_tokens / ((run.totalMs - run.firstTokenMs) / 1000)) : null;

  return (
    <>
      <header class="page-head">
        <h1>Playground</h1>
        <p class="muted">
          Try the base model or one of your ready adapters. Requests go through the OpenAI-compatible API, count toward your
          tenant's quotas and are billed like any other call.
        </p>
      </header>

      <section class="card" aria-labelledby="pg-auth-title">
        <div class="row-between">
          <h2 id="pg-auth-title" class="h3">
            Credentials
          </h2>
          <Segmented
            label="Call the API with"
            options={[
              { id: "session", label: "Temporary key" },
              { id: "key", label: "My API key" },
            ]}
            value={auth}
            onChange={(m) => setAuth(m)}
            testidPrefix="playground-auth"
          />
        </div>
        {auth === "session" ? (
          <p class="small" data-testid="playground-auth-note">
            A temporary key made for this browser: inference only, valid 30 minutes, at most 30 requests a minute, revoked when
            you sign out. It stays in this page's memory and is listed on the API keys page as “Playground · {user.email}”.
            {keyInfo && (
              <span class="muted" data-testid="playground-key-info">
                {" "}
                Current: <span class="mono">{keyInfo.prefix}…</span>, until {keyInfo.expires_at.slice(11, 16)} UTC.
              </span>
            )}
          </p>
        ) : (
          <form
            class="row"
            onSubmit={(e) => {
              e.preventDefault();
              void loadModels();
            }}
          >
            <div class="field grow">
              <label for="playground-key">API key</label>
              <input
                id="playground-key"
                type="password"
                class="mono"
                autoComplete="off"
                spellcheck={false}
                placeholder="mpx_…"
                value={ownKey}
                onInput={(e) => setOwnKey((e.target as HTMLInputElement).value)}
                aria-describedby="playground-key-help"
                data-testid="playground-key"
              />
              <small id="playground-key-help" class="muted">
                Kept in this page's memory only and sent only to /v1; gone when you leave or reload.
              </small>
            </div>
            <button type="submit" class="btn" data-testid="playground-use-key">
              Use this key
            </button>
          </form>
        )}
      </section>

      <form class="card section playground" onSubmit={send} aria-labelledby="pg-request-title" data-testid="playground-form">
        <h2 id="pg-request-title" class="h3">
          Request
        </h2>
        {modelsError && <ErrorBox error={modelsError} onRetry={() => void loadModels()} testid="playground-models-error" />}
        <div class="grid-3">
          <div class="field">
            <label for="playground-model">Model</label>
            {models === null ? (
              auth === "key" && !ownKey.trim() ? (
                <p class="muted small">Paste a key to list its models.</p>
              ) : (
                <Loading label="Loading models…" testid="playground-models-loading" />
              )
            ) : (
              <select id="playground-model" value={model} onChange={(e) => setModel((e.target as HTMLSelectElement).value)} data-testid="playground-model">
                {models.map((m, i) => (
                  <option key={m} value={m}>
                    {m}
                    {i === 0 ? " (base model)" : ""}
                  </option>
                ))}
              </select>
            )}
          </div>
          <div class="field">
            <label for="playground-max-tokens">Max tokens</label>
            <input
              id="playground-max-tokens"
              type="number"
              min={1}
              max={4096}
              step={1}
              value={maxTokens}
              onInput={(e) => setMaxTokens((e.target as HTMLInputElement).value)}
              data-testid="playground-max-tokens"
            />
          </div>
          <div class="field">
            <label for="playground-temperature">Temperature</label>
            <input
              id="playground-temperature"
              type="number"
              min={0}
              max={2}
              step={0.1}
              value={temperature}
              onInput={(e) => setTemperature((e.target as HTMLInputElement).value)}
              data-testid="playground-temperature"
            />
          </div>
        </div>
        <div class="field">
          <label for="playground-system">System message (optional)</label>
          <textarea id="playground-system" rows={2} value={system} onInput={(e) => setSystem((e.target as HTMLTextAreaElement).value)} data-testid="playground-system" />
        </div>
        <div class="field">
          <label for="playground-prompt">Your message</label>
          <textarea
            id="playground-prompt"
            rows={4}
            required
            value={prompt}
            onInput={(e) => setPrompt((e.target as HTMLTextAreaElement).value)}
            data-testid="playground-prompt"
          />
        </div>
        <div class="row">
          <button type="submit" class="btn btn-primary" disabled={busy || !model} data-testid="playground-send">
            {busy ? "Generating…" : "Send"}
          </button>
          {busy && (
            <button type="button" class="btn btn-ghost" onClick={() => controller.current?.abort()} data-testid="playground-stop">
              Stop
            </button>
          )}
        </div>
      </form>

      <section class="card section" aria-labelledby="pg-response-title">
        <h2 id="pg-response-title" class="h3">
          Response
        </h2>
        {run.phase === "error" && (
          <p class="form-error" role="alert" data-testid="playground-error">
            {run.error}
          </p>
        )}
        <pre class="playground-output" aria-busy={busy} data-testid="playground-output" data-phase={run.phase}>
          {run.text || (run.phase === "idle" ? "The streamed answer appears here." : run.phase === "connecting" ? "Connecting…" : "")}
        </pre>
        <p class="sr-only" aria-live="polite">
          {run.phase === "done" ? `Response complete: ${u ? `${u.completion_tokens} tokens.` : ""}` : run.phase === "stopped" ? "Stopped." : ""}
        </p>
        {(u || record) && (
          <dl class="totals" data-testid="playground-usage">
            <div>
              <dt>Tokens in</dt>
              <dd data-testid="playground-prompt-tokens">{formatInt(u?.prompt_tokens ?? record?.prompt_tokens)}</dd>
            </div>
            <div>
              <dt>of which cached</dt>
              <dd data-testid="playground-cached-tokens">{formatInt(cached)}</dd>
            </div>
            <div>
              <dt>Tokens out</dt>
              <dd data-testid="playground-completion-tokens">{formatInt(u?.completion_tokens ?? record?.completion_tokens)}</dd>
            </div>
            <div>
              <dt>First token</dt>
              <dd>{run.firstTokenMs === null ? "—" : `${formatInt(run.firstTokenMs)} ms`}</dd>
            </div>
            <div>
              <dt>Speed</dt>
              <dd>{tps === null ? "—" : `${tps.toFixed(1)} tokens/s`}</dd>
            </div>
            <div>
              <dt>Cost</dt>
              <dd data-testid="playground-cost" data-microusd={record?.billed_microusd == null ? undefined : String(record.billed_microusd)}>
                {record ? (record.billed_microusd === null ? "no price" : formatUsd(record.billed_microusd)) : "…"}
              </dd>
            </div>
          </dl>
        )}
        <p class="muted small" aria-live="polite" data-testid="playground-record">
          {recordNote}
          {record && (
            <>
              Recorded in the ledger as <span class="mono" data-testid="playground-request-id">{record.request_id}</span>
              {record.adapter ? ` (adapter ${record.adapter})` : " (base model)"}; the cost is this request priced on its own —
              statements round once per day and model.
            </>
          )}
        </p>
      </section>

      <section class="card section" aria-labelledby="pg-code-title">
        <div class="row-between">
          <h2 id="pg-code-title" class="h3">
            The same request in code
          </h2>
          <Segmented
            label="Language"
            options={[
              { id: "curl", label: "curl" },
              { id: "python", label: "Python" },
            ]}
            value={snippet}
            onChange={setSnippet}
            testidPrefix="playground-snippet"
          />
        </div>
        <p class="muted small">
          Set <code>MULTIPLEX_API_KEY</code> to one of your API keys; the snippet never contains a key.
        </p>
        <pre class="code" tabIndex={0} aria-label={`${snippet} snippet`} data-testid={`playground-${snippet}`}>
          {snippet === "curl" ? curlSnippet(baseUrl, request) : pythonSnippet(baseUrl, request)}
        </pre>
        <CopyButton text={snippet === "curl" ? curlSnippet(baseUrl, request) : pythonSnippet(baseUrl, request)} testid="playground-copy" label="Copy snippet" />
      </section>
    </>
  );
}
