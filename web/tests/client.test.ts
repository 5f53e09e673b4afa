import { describe, expect, it } from "vitest";
import { ApiClient, ApiError, buildQuery, errorFromBody, type XhrLike } from "../src/api/client";

interface Call {
  url: string;
  method: string;
  headers: Record<string, string>;
  body: unknown;
  credentials: RequestCredentials | undefined;
}

/** A fetch that answers from a route table and records what it was sent. */
function fakeFetch(routes: Record<string, (call: Call) => Response>) {
  const calls: Call[] = [];
  const fetch = async (url: string, init: RequestInit) => {
    const call: Call = {
      url,
      method: init.method ?? "GET",
      headers: { ...(init.headers as Record<string, string>) },
      body: init.body,
      credentials: init.credentials,
    };
    calls.push(call);
    const route = routes[`${call.method} ${url.split("?")[0]}`];
    if (!route) return new Response(JSON.stringify({ error: { message: `no route ${url}` } }), { status: 404 });
    return route(call);
  };
  return { fetch, calls };
}

const json = (status: number, body: unknown) =>
  new Response(JSON.stringify(body), { status, headers: { "Content-Type": "application/json" } });

const SESSION = {
  user: { id: "u1", email: "a@b.c", role: "tenant_admin", tenant_id: "t1", tenant_name: "Acme" },
  csrf_token: "csrf-123",
};

describe("CSRF header", () => {
  it("is sent on every non-GET after sign-in, and never on GET", async () => {
    const { fetch, calls } = fakeFetch({
      "POST /api/auth/login": () => json(200, SESSION),
      "GET /api/tenant/keys": () => json(200, { data: [] }),
      "POST /api/tenant/keys": () => json(201, { id: "k", name: "n", prefix: "mpx_x", key: "mpx_secret", created_at: "" }),
      "PATCH /api/admin/tenants/t1": () => json(200, {}),
      "DELETE /api/tenant/keys/k": () => new Response(null, { status: 204 }),
    });
    const client = new ApiClient({ fetch });
    await client.login("a@b.c", "pw");
    await client.get("/api/tenant/keys");
    await client.post("/api/tenant/keys", { name: "n" });
    await client.patch("/api/admin/tenants/t1", { plan: "pro" });
    await client.delete("/api/tenant/keys/k");

    const byMethod = Object.fromEntries(calls.slice(1).map((c) => [c.method, c.headers["X-CSRF-Token"]]));
    expect(byMethod).toEqual({ GET: undefined, POST: "csrf-123", PATCH: "csrf-123", DELETE: "csrf-123" });
    expect(calls.every((c) => c.credentials === "same-origin")).toBe(true);
  });

  it("is not invented before a session exists (the login itself has none)", async () => {
    const { fetch, calls } = fakeFetch({ "POST /api/auth/login": () => json(200, SESSION) });
    await new ApiClient({ fetch }).login("a@b.c", "pw");
    expect(calls[0].headers["X-CSRF-Token"]).toBeUndefined();
    expect(calls[0].headers["Content-Type"]).toBe("application/json");
    expect(JSON.parse(calls[0].body as string)).toEqual({ email: "a@b.c", password: "pw" });
  });

  it("comes from /api/auth/me when a session is restored, and is dropped on logout", async () => {
    const { fetch, calls } = fakeFetch({
      "GET /api/auth/me": () => json(200, { ...SESSION, csrf_token: "restored" }),
      "POST /api/auth/logout": () => new Response(null, { status: 204 }),
      "POST /api/tenant/keys": () => json(201, {}),
    });
    const client = new ApiClient({ fetch });
    expect((await client.me())!.user.email).toBe("a@b.c");
    await client.logout();
    expect(calls[1].headers["X-CSRF-Token"]).toBe("restored");
    expect(client.csrfToken).toBeNull();
    await client.post("/api/tenant/keys", { name: "x" });
    expect(calls[2].headers["X-CSRF-Token"]).toBeUndefined();
  });

  it("me() is null, not an error, when signed out", async () => {
    const { fetch } = fakeFetch({ "GET /api/auth/me": () => json(401, { error: { message: "Not signed in." } }) });
    expect(await new ApiClient({ fetch }).me()).toBeNull();
  });
});

describe("errors", () => {
  it("carry the OpenAI-shaped error's message, type, code and param", async () => {
    const { fetch } = fakeFetch({
      "POST /api/tenant/keys": () =>
        json(403, { error: { message: "Only a tenant admin can create keys.", type: "permission_error", param: null, code: "forbidden" } }),
    });
    const err = await new ApiClient({ fetch }).post("/api/tenant/keys", { name: "x" }).catch((e) => e);
    expect(err).toBeInstanceOf(ApiError);
    expect(err).toMatchObject({ status: 403, message: "Only a tenant admin can create keys.", type: "permission_error", code: "forbidden", param: null });
  });

  it("fall back to a readable message when the body is not the OpenAI shape", () => {
    expect(errorFromBody(502, "Bad Gateway", "<html>nginx</html>").message).toBe("The gateway could not reach a service.");
    expect(errorFromBody(418, "I'm a teapot", "").message).toBe("Request failed: HTTP 418 I'm a teapot.");
    expect(errorFromBody(422, "", JSON.stringify({ detail: "field required" })).message).toBe("field required");
    expect(errorFromBody(400, "", JSON.stringify({ error: { message: "" } })).message).toBe("The request was not valid.");
    expect(errorFromBody(429, "", JSON.stringify({ error: "slow down" })).message).toBe("slow down");
  });

  it("turn a network failure into an ApiError with status 0", async () => {
    const client = new ApiClient({ fetch: () => Promise.reject(new TypeError("Failed to fetch")) });
    const err = await client.get("/api/tenant").catch((e) => e);
    expect(err).toMatchObject({ status: 0, code: "network_error" });
  });

  it("report a 2xx body that is not JSON instead of crashing later", async () => {
    const { fetch } = fakeFetch({ "GET /api/tenant": () => new Response("<html>", { status: 200 }) });
    await expect(new ApiClient({ fetch }).get("/api/tenant")).rejects.toMatchObject({ code: "bad_response" });
  });

  it("signal an expired session on 401 from an API call, but not from the login form", async () => {
    const { fetch } = fakeFetch({
      "GET /api/tenant": () => json(401, { error: { message: "Not signed in." } }),
      "POST /api/auth/login": () => json(401, { error: { message: "Incorrect email or password." } }),
    });
    const client = new ApiClient({ fetch });
    let expired = 0;
    client.onUnauthorized = () => expired++;
    await expect(client.login("a", "b")).rejects.toMatchObject({ status: 401, message: "Incorrect email or password." });
    expect(expired).toBe(0);
    await expect(client.get("/api/tenant")).rejects.toMatchObject({ status: 401 });
    expect(expired).toBe(1);
  });

  it("returns undefined for 204", async () => {
    const { fetch } = fakeFetch({ "DELETE /api/tenant/keys/k": () => new Response(null, { status: 204 }) });
    expect(await new ApiClient({ fetch }).delete("/api/tenant/keys/k")).toBeUndefined();
  });
});

describe("buildQuery", () => {
  it("drops empty values and encodes the rest", () => {
    expect(buildQuery({ from: "2025-01-01", to: "", group_by: undefined, x: null, q: "a b&c" })).toBe("?from=2025-01-01&q=a+b%26c");
    expect(buildQuery({})).toBe("");
    expect(buildQuery(undefined)).toBe("");
  });
});

/** Drives the uploader the way a browser's XMLHttpRequest would. */
class FakeXhr implements XhrLike {
  method = "";
  url = "";
  headers: Record<string, string> = {};
  sent: FormData | null = null;
  status = 0;
  statusText = "";
  responseText = "";
  withCredentials = false;
  onload: ((ev: unknown) => void) | null = null;
  onerror: ((ev: unknown) => void) | null = null;
  onabort: ((ev: unknown) => void) | null = null;
  upload: XhrLike["upload"] = { onprogress: null };
  open(method: string, url: string) {
    this.method = method;
    this.url = url;
  }
  setRequestHeader(name: string, value: string) {
    this.headers[name] = value;
  }
  send(body: FormData) {
    this.sent = body;
  }
  abort() {
    this.onabort?.({});
  }
  progress(loaded: number, total: number, lengthComputable = true) {
    this.upload.onprogress?.({ loaded, total, lengthComputable });
  }
  respond(status: number, body: unknown) {
    this.status = status;
    this.responseText = JSON.stringify(body);
    this.onload?.({});
  }
}

describe("upload", () => {
  function setup() {
    const xhr = new FakeXhr();
    const client = new ApiClient({ xhr: () => xhr, fetch: () => Promise.reject(new Error("unused")) });
    client.csrfToken = "csrf-up";
    return { xhr, client };
  }

  it("posts the form with the CSRF header and reports progress as it goes", async () => {
    const { xhr, client } = setup();
    const seen: (number | null)[] = [];
    const form = new FormData();
    form.append("name", "bot");
    const h = client.upload("/api/admin/tenants/t1/adapters", form, (p) => seen.push(p.fraction));
    expect(xhr.method).toBe("POST");
    expect(xhr.url).toBe("/api/admin/tenants/t1/adapters");
    expect(xhr.headers["X-CSRF-Token"]).toBe("csrf-up");
    expect(xhr.withCredentials).toBe(true);
    expect(xhr.sent).toBe(form);
    xhr.progress(0, 1000);
    xhr.progress(250, 1000);
    xhr.progress(1000, 1000);
    xhr.progress(10, 0, false);
    xhr.respond(202, { version_id: "v1", adapter_id: "a1", version: 1, status: "uploaded" });
    expect(await h.promise).toEqual({ version_id: "v1", adapter_id: "a1", version: 1, status: "uploaded" });
    expect(seen).toEqual([0, 0.25, 1, null]);
  });

  it("rejects with the server's message on 413", async () => {
    const { xhr, client } = setup();
    const h = client.upload("/api/tenant/adapters", new FormData(), () => {});
    xhr.respond(413, { error: { message: "The upload is over the 50 MB limit.", type: "invalid_request_error", code: "too_large" } });
    await expect(h.promise).rejects.toMatchObject({ status: 413, message: "The upload is over the 50 MB limit.", code: "too_large" });
  });

  it("rejects with code 'aborted' when cancelled and 'network_error' when the connection drops", async () => {
    const a = setup();
    const h1 = a.client.upload("/api/tenant/adapters", new FormData(), () => {});
    h1.abort();
    await expect(h1.promise).rejects.toMatchObject({ status: 0, code: "aborted" });

    const b = setup();
    const h2 = b.client.upload("/api/tenant/adapters", new FormData(), () => {});
    b.xhr.onerror?.({});
    await expect(h2.promise).rejects.toMatchObject({ status: 0, code: "network_error" });
  });
});
