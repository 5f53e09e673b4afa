/** HTTP client for the management API: session cookie, CSRF header on writes, OpenAI-shaped errors. */
import type { Session } from "./types";

/** An API failure carrying the server's OpenAI-shaped `error` (or a synthesized one for network failures). */
export class ApiError extends Error {
  readonly status: number;
  readonly type: string | null;
  readonly code: string | null;
  readonly param: string | null;

  constructor(status: number, message: string, opts: { type?: string | null; code?: string | null; param?: string | null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.type = opts.type ?? null;
    this.code = opts.code ?? null;
    this.param = opts.param ?? null;
  }
}

const UNSAFE = new Set(["POST", "PUT", "PATCH", "DELETE"]);

/** Statuses whose generic wording is better than a bare number when the body has no message. */
const STATUS_TEXT: Record<number, string> = {
  400: "The request was not valid.",
  401: "You are not signed in.",
  403: "Your role is not allowed to do this.",
  404: "Not found.",
  409: "That conflicts with the current state.",
  413: "The upload is too large.",
  429: "Quota exceeded; try again shortly.",
  500: "The server failed.",
  502: "The gateway could not reach a service.",
  503: "A service the gateway depends on is down.",
};

/** Build an ApiError from a non-2xx response body; tolerant of bodies that are not the OpenAI shape. */
export function errorFromBody(status: number, statusText: string, bodyText: string): ApiError {
  let parsed: unknown = null;
  try {
    parsed = bodyText ? JSON.parse(bodyText) : null;
  } catch {
    parsed = null;
  }
  if (parsed && typeof parsed === "object" && "error" in parsed) {
    const err = (parsed as { error: unknown }).error;
    if (err && typeof err === "object") {
      const e = err as Record<string, unknown>;
      const message = typeof e.message === "string" && e.message ? e.message : fallbackMessage(status, statusText);
      return new ApiError(status, message, { type: str(e.type), code: str(e.code), param: str(e.param) });
    }
    if (typeof err === "string" && err) return new ApiError(status, err);
  }
  // FastAPI's default shape, in case a route escapes the gateway's error handler.
  if (parsed && typeof parsed === "object" && "detail" in parsed) {
    const detail = (parsed as { detail: unknown }).detail;
    if (typeof detail === "string" && detail) return new ApiError(status, detail);
  }
  return new ApiError(status, fallbackMessage(status, statusText));
}

function str(v: unknown): string | null {
  return typeof v === "string" ? v : null;
}

function fallbackMessage(status: number, statusText: string): string {
  const known = STATUS_TEXT[status];
  if (known) return known;
  return `Request failed: HTTP ${status}${statusText ? ` ${statusText}` : ""}.`;
}

export type Query = Record<string, string | number | null | undefined>;

/** `?a=1&b=2` without empty values; `""` when nothing is left. */
export function buildQuery(query: Query | undefined): string {
  if (!query) return "";
  const params = new URLSearchParams();
  for (const [k, v] of Object.entries(query)) {
    if (v === null || v === undefined || v === "") continue;
    params.set(k, String(v));
  }
  const s = params.toString();
  return s ? `?${s}` : "";
}

export interface RequestOptions {
  query?: Query;
  json?: unknown;
  form?: FormData;
  signal?: AbortSignal;
}

export type FetchLike = (input: string, init: RequestInit) => Promise<Response>;

/** Upload progress: `fraction` is null when the browser cannot compute the total. */
export interface UploadProgress {
  loaded: number;
  total: number | null;
  fraction: number | null;
}

export interface UploadHandle<T> {
  promise: Promise<T>;
  abort: () => void;
}

/** The subset of XMLHttpRequest the uploader uses, so tests can drive it. */
export interface XhrLike {
  open(method: string, url: string): void;
  setRequestHeader(name: string, value: string): void;
  send(body: FormData): void;
  abort(): void;
  readonly status: number;
  readonly statusText: string;
  readonly responseText: string;
  withCredentials: boolean;
  onload: ((ev: unknown) => void) | null;
  onerror: ((ev: unknown) => void) | null;
  onabort: ((ev: unknown) => void) | null;
  upload: { onprogress: ((ev: { lengthComputable: boolean; loaded: number; total: number }) => void) | null };
}

export interface ClientOptions {
  fetch?: FetchLike;
  xhr?: () => XhrLike;
  baseUrl?: string;
}

export class ApiClient {
  /** The session's CSRF token; every non-GET request sends it as X-CSRF-Token. */
  csrfToken: string | null = null;
  /** Called when an authenticated call comes back 401 (session expired or revoked). */
  onUnauthorized: (() => void) | null = null;

  private readonly fetchFn: FetchLike;
  private readonly xhrFactory: () => XhrLike;
  private readonly baseUrl: string;

  constructor(opts: ClientOptions = {}) {
    this.fetchFn = opts.fetch ?? ((input, init) => fetch(input, init));
    this.xhrFactory = opts.xhr ?? (() => new XMLHttpRequest() as unknown as XhrLike);
    this.baseUrl = opts.baseUrl ?? "";
  }

  url(path: string, query?: Query): string {
    return `${this.baseUrl}${path}${buildQuery(query)}`;
  }

  private headersFor(method: string, hasJson: boolean): Record<string, string> {
    const headers: Record<string, string> = { Accept: "application/json" };
    if (hasJson) headers["Content-Type"] = "application/json";
    if (UNSAFE.has(method) && this.csrfToken) headers["X-CSRF-Token"] = this.csrfToken;
    return headers;
  }

  async request<T>(method: string, path: string, opts: RequestOptions = {}): Promise<T> {
    const hasJson = opts.json !== undefined;
    const init: RequestInit = {
      method,
      headers: this.headersFor(method, hasJson),
      credentials: "same-origin",
      signal: opts.signal,
    };
    if (hasJson) init.body = JSON.stringify(opts.json);
    else if (opts.form) init.body = opts.form;

    let res: Response;
    try {
      res = await this.fetchFn(this.url(path, opts.query), init);
    } catch (exc) {
      if (exc instanceof DOMException && exc.name === "AbortError") throw exc;
      throw new ApiError(0, "Could not reach the server. Check your connection and try again.", { code: "network_error" });
    }
    return this.parse<T>(res.status, res.statusText, await res.text(), path);
  }

  private parse<T>(status: number, statusText: string, text: string, path: string): T {
    if (status >= 200 && status < 300) {
      if (status === 204 || !text) return undefined as T;
      try {
        return JSON.parse(text) as T;
      } catch {
        throw new ApiError(status, "The server sent a response that is not JSON.", { code: "bad_response" });
      }
    }
    const err = errorFromBody(status, statusText, text);
    if (status === 401 && !path.startsWith("/api/auth/")) this.onUnauthorized?.();
    throw err;
  }

  get<T>(path: string, query?: Query, signal?: AbortSignal): Promise<T> {
    return this.request<T>("GET", path, { query, signal });
  }

  post<T>(path: string, json?: unknown): Promise<T> {
    return this.request<T>("POST", path, { json: json ?? {} });
  }

  patch<T>(path: string, json: unknown): Promise<T> {
    return this.request<T>("PATCH", path, { json });
  }

  delete<T = void>(path: string): Promise<T> {
    return this.request<T>("DELETE", path);
  }

  async login(email: string, password: string): Promise<Session> {
    const session = await this.post<Session>("/api/auth/login", { email, password });
    this.csrfToken = session.csrf_token;
    return session;
  }

  /** The current session, or null when not signed in. */
  async me(): Promise<Session | null> {
    try {
      const session = await this.get<Session>("/api/auth/me");
      this.csrfToken = session.csrf_token;
      return session;
    } catch (exc) {
      if (exc instanceof ApiError && exc.status === 401) {
        this.csrfToken = null;
        return null;
      }
      throw exc;
    }
  }

  async logout(): Promise<void> {
    try {
      await this.request<void>("POST", "/api/auth/logout");
    } finally {
      this.csrfToken = null;
    }
  }

  /**
   * Multipart upload through XMLHttpRequest, because fetch reports no upload progress.
   * Errors arrive as ApiError exactly as from `request`.
   */
  upload<T>(path: string, form: FormData, onProgress: (p: UploadProgress) => void): UploadHandle<T> {
    const xhr = this.xhrFactory();
    const promise = new Promise<T>((resolve, reject) => {
      xhr.open("POST", this.url(path));
      xhr.withCredentials = true;
      xhr.setRequestHeader("Accept", "application/json");
      if (this.csrfToken) xhr.setRequestHeader("X-CSRF-Token", this.csrfToken);
      xhr.upload.onprogress = (ev) => {
        const total = ev.lengthComputable && ev.total > 0 ? ev.total : null;
        onProgress({ loaded: ev.loaded, total, fraction: total ? Math.min(1, ev.loaded / total) : null });
      };
      xhr.onload = () => {
        try {
          resolve(this.parse<T>(xhr.status, xhr.statusText, xhr.responseText, path));
        } catch (exc) {
          reject(exc);
        }
      };
      xhr.onerror = () =>
        reject(new ApiError(0, "The upload failed: the connection to the server was lost.", { code: "network_error" }));
      xhr.onabort = () => reject(new ApiError(0, "The upload was cancelled.", { code: "aborted" }));
      xhr.send(form);
    });
    return { promise, abort: () => xhr.abort() };
  }
}
