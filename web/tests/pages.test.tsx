// @vitest-environment happy-dom
/** Role gating and the once-only key secret, rendered with the real components and API client. */
import { render } from "preact";
import { act } from "preact/test-utils";
import { afterEach, describe, expect, it } from "vitest";
import { ApiClient } from "../src/api/client";
import type { Role, User } from "../src/api/types";
import { AppContext } from "../src/context";
import { KeysPage } from "../src/pages/KeysPage";

const KEYS = {
  data: [
    { id: "k1", name: "prod", prefix: "mpx_ab12", scopes: ["inference"], created_at: "2025-01-01T00:00:00Z", last_used_at: null, revoked_at: null },
  ],
};

function user(role: Role): User {
  return { id: "u", email: "u@acme.test", role, tenant_id: "t1", tenant_name: "Acme" };
}

/** Answers like the gateway would for these routes, recording method, path and CSRF header. */
function gateway() {
  const seen: { method: string; path: string; csrf: string | null }[] = [];
  const fetch = async (url: string, init: RequestInit) => {
    const method = init.method ?? "GET";
    const headers = (init.headers ?? {}) as Record<string, string>;
    seen.push({ method, path: url, csrf: headers["X-CSRF-Token"] ?? null });
    if (method === "GET" && url === "/api/tenant/keys") return Response.json(KEYS);
    if (method === "POST" && url === "/api/tenant/keys") {
      return Response.json({ id: "k2", name: JSON.parse(init.body as string).name, prefix: "mpx_cd34", key: "mpx_cd34_SECRET", created_at: "2025-01-02T00:00:00Z" }, { status: 201 });
    }
    return Response.json({ error: { message: "nope" } }, { status: 404 });
  };
  const client = new ApiClient({ fetch });
  client.csrfToken = "tok";
  return { client, seen };
}

const settle = () => act(() => new Promise<void>((r) => setTimeout(r, 0)));
const byTestId = (root: ParentNode, id: string) => root.querySelector(`[data-testid="${id}"]`);

let root: HTMLElement;
afterEach(() => {
  render(null, root);
  root.remove();
});

async function mount(role: Role) {
  const gw = gateway();
  root = document.createElement("div");
  document.body.append(root);
  await act(() => {
    render(
      <AppContext.Provider value={{ client: gw.client, user: user(role) }}>
        <KeysPage />
      </AppContext.Provider>,
      root,
    );
  });
  await settle();
  return gw;
}

describe("KeysPage", () => {
  it("hides create and revoke from a tenant member", async () => {
    await mount("tenant_member");
    expect(byTestId(root, "keys-table")).not.toBeNull();
    expect(byTestId(root, "create-key")).toBeNull();
    expect(byTestId(root, "revoke-key-k1")).toBeNull();
    expect(byTestId(root, "keys-readonly")).not.toBeNull();
  });

  it("lets a tenant admin create a key, shows the secret once, and hides it for good", async () => {
    const gw = await mount("tenant_admin");
    expect(byTestId(root, "revoke-key-k1")).not.toBeNull();
    const name = byTestId(root, "create-key-name") as HTMLInputElement;
    await act(() => {
      name.value = "ci";
      name.dispatchEvent(new Event("input", { bubbles: true }));
    });
    await act(() => {
      (byTestId(root, "create-key") as HTMLButtonElement).click();
    });
    await settle();
    const secret = byTestId(root, "new-key-secret") as HTMLInputElement;
    expect(secret.value).toBe("mpx_cd34_SECRET");
    const post = gw.seen.find((s) => s.method === "POST")!;
    expect(post).toEqual({ method: "POST", path: "/api/tenant/keys", csrf: "tok" });
    // the list is reloaded after creating
    expect(gw.seen.filter((s) => s.method === "GET" && s.path === "/api/tenant/keys")).toHaveLength(2);

    await act(() => {
      (byTestId(root, "dismiss-new-key") as HTMLButtonElement).click();
    });
    expect(byTestId(root, "new-key-secret")).toBeNull();
    expect(root.textContent).not.toContain("mpx_cd34_SECRET");
  });

  it("shows the API's error message when the list cannot load", async () => {
    root = document.createElement("div");
    document.body.append(root);
    const client = new ApiClient({
      fetch: async () => Response.json({ error: { message: "Redis is down", type: "api_error", code: "dependency_down" } }, { status: 503 }),
    });
    await act(() => {
      render(
        <AppContext.Provider value={{ client, user: user("tenant_admin") }}>
          <KeysPage />
        </AppContext.Provider>,
        root,
      );
    });
    await settle();
    expect(byTestId(root, "keys-error")?.getAttribute("role")).toBe("alert");
    expect(byTestId(root, "error-message")?.textContent).toBe("Redis is down");
  });
});

describe("FinancePage", () => {
  const row = (id: string, name: string, billed: number, cost: number) => ({
    tenant_id: id,
    tenant_name: name,
    requests: 1,
    prompt_tokens: 10,
    cached_tokens: 0,
    completion_tokens: 5,
    billed_microusd: billed,
    compute_cost_microusd: cost,
    margin_microusd: billed - cost,
    breakdown: [],
  });
  const REPORT = {
    period: { from: "2025-01-01", to: "2025-01-31" },
    // 0.1 + 0.2 in dollars: a float sum would print 0.30000000000000004
    rows: [row("t1", "Beta", 100_000, 50_000), row("t2", "alpha", 200_000, 250_000), row("t3", "Gamma", 3, 1)],
    totals: null,
    unallocated_cost_microusd: 7,
    net_margin_microusd: -5,
  };
  const day = (d: string, billed: number, cost: number, idle: number) => ({
    day: d, requests: 1, billed_microusd: billed, compute_cost_microusd: cost, margin_microusd: billed - cost,
    unallocated_cost_microusd: idle, net_margin_microusd: billed - cost - idle,
  });
  const TREND = { period: REPORT.period, rows: [day("2025-01-01", 300_000, 250_000, 5), day("2025-01-02", 3, 1, 2)] };

  async function mountFinance() {
    const { FinancePage } = await import("../src/pages/FinancePage");
    const queries: string[] = [];
    const client = new ApiClient({
      fetch: async (url: string) => {
        queries.push(url);
        if (url.startsWith("/api/finance/trend")) return Response.json(TREND);
        return Response.json(REPORT);
      },
    });
    root = document.createElement("div");
    document.body.append(root);
    await act(() => {
      render(
        <AppContext.Provider value={{ client, user: { ...user("finance"), tenant_id: null, tenant_name: null } }}>
          <FinancePage />
        </AppContext.Provider>,
        root,
      );
    });
    await settle();
    return queries;
  }

  const order = () => [...root.querySelectorAll('[data-testid^="finance-row-"] th')].map((th) => th.textContent);

  it("totals the rows exactly and links the CSV for the same period as the page", async () => {
    const queries = await mountFinance();
    expect(byTestId(root, "finance-total-billed")!.textContent).toBe("$0.300003");
    expect(byTestId(root, "finance-total-billed")!.getAttribute("data-microusd")).toBe("300003");
    expect(byTestId(root, "finance-total-margin")!.textContent).toBe("$0.000002");
    expect(byTestId(root, "finance-unallocated")!.textContent).toBe("$0.000007");
    // After the idle cost no tenant used: the server's net margin, negative here and said so.
    expect(byTestId(root, "finance-net-margin")!.textContent).toBe("-$0.000005");
    expect(byTestId(root, "finance-net-negative")).not.toBeNull();
    const period = new URL(queries[0], "http://x").searchParams;
    const csv = new URL((byTestId(root, "download-csv") as HTMLAnchorElement).getAttribute("href")!, "http://x");
    expect(csv.pathname).toBe("/api/finance/report.csv");
    expect(csv.searchParams.get("from")).toBe(period.get("from"));
    expect(csv.searchParams.get("to")).toBe(period.get("to"));
  });

  it("sorts by billed descending first, then by any column header, both ways", async () => {
    await mountFinance();
    expect(order()).toEqual(["alpha", "Beta", "Gamma"]);
    await act(() => (byTestId(root, "sort-tenant") as HTMLButtonElement).click());
    expect(order()).toEqual(["alpha", "Beta", "Gamma"]);
    await act(() => (byTestId(root, "sort-tenant") as HTMLButtonElement).click());
    expect(order()).toEqual(["Gamma", "Beta", "alpha"]);
    await act(() => (byTestId(root, "sort-margin") as HTMLButtonElement).click());
    expect(order()).toEqual(["Beta", "Gamma", "alpha"]);
    expect(byTestId(root, "sort-margin")!.closest("th")!.getAttribute("aria-sort")).toBe("descending");
  });
});

describe("FinancePage money columns", () => {
  it("print one fixed number of decimals per column, totals included", async () => {
    const { FinancePage } = await import("../src/pages/FinancePage");
    const report = {
      period: { from: "2025-01-01", to: "2025-01-31" },
      rows: [
        { tenant_id: "a", tenant_name: "A", requests: 1, prompt_tokens: 1, cached_tokens: 0, completion_tokens: 1,
          billed_microusd: 1_234_500_000, compute_cost_microusd: 2_000_000, margin_microusd: 1_232_500_000, breakdown: [] },
        { tenant_id: "b", tenant_name: "B", requests: 1, prompt_tokens: 1, cached_tokens: 0, completion_tokens: 1,
          billed_microusd: 1_234, compute_cost_microusd: 1_000_000, margin_microusd: -998_766, breakdown: [] },
      ],
      totals: null, unallocated_cost_microusd: 0, net_margin_microusd: 1_231_501_234,
    };
    const client = new ApiClient({
      fetch: async (url: string) => Response.json(url.startsWith("/api/finance/trend") ? { period: report.period, rows: [] } : report),
    });
    root = document.createElement("div");
    document.body.append(root);
    await act(() => {
      render(
        <AppContext.Provider value={{ client, user: { ...user("finance"), tenant_id: null, tenant_name: null } }}>
          <FinancePage />
        </AppContext.Provider>,
        root,
      );
    });
    await settle();
    const cells = (id: string) => [...root.querySelectorAll(`[data-testid="${id}"] td`)].map((td) => td.textContent);
    // billed needs six decimals for B's $0.001234, so A's $1,234.50 prints $1,234.500000; cost needs only cents.
    expect(cells("finance-row-a").slice(4, 7)).toEqual(["$1,234.500000", "$2.00", "$1,232.500000"]);
    expect(cells("finance-row-b").slice(4, 7)).toEqual(["$0.001234", "$1.00", "-$0.998766"]);
    expect(cells("finance-totals").slice(4, 7)).toEqual(["$1,234.501234", "$3.00", "$1,231.501234"]);
  });
});

describe("PeriodPicker", () => {
  it("highlights no preset once the dates are edited, valid or not (bug: a chip stayed pressed)", async () => {
    const { PeriodPicker } = await import("../src/components/PeriodPicker");
    const { periodPresets } = await import("../src/lib/dates");
    const last7 = periodPresets(new Date()).find((p) => p.id === "last-7")!.period;
    const applied: { from: string; to: string }[] = [];
    root = document.createElement("div");
    document.body.append(root);
    await act(() => render(<PeriodPicker value={last7} onApply={(p) => applied.push(p)} idPrefix="t" />, root));
    const chip = () => byTestId(root, "period-last-7")!.getAttribute("aria-pressed");
    expect(chip()).toBe("true");
    const from = byTestId(root, "period-from") as HTMLInputElement;
    await act(() => {
      from.value = "2999-01-01"; // after `to`: an invalid range
      from.dispatchEvent(new Event("input", { bubbles: true }));
    });
    await act(() => (byTestId(root, "period-apply") as HTMLButtonElement).click());
    expect(byTestId(root, "period-error")!.textContent).toContain("start date");
    expect(applied).toEqual([]);
    expect(root.querySelectorAll('[aria-pressed="true"]')).toHaveLength(0);
  });
});

describe("VersionPage", () => {
  async function mountVersion(id: string, status: number) {
    const { VersionPage } = await import("../src/pages/VersionPage");
    const calls: string[] = [];
    const client = new ApiClient({
      fetch: async (url: string) => {
        calls.push(url);
        return Response.json({ error: { message: status === 404 ? "Adapter version not found." : "boom" } }, { status });
      },
    });
    root = document.createElement("div");
    document.body.append(root);
    await act(() => {
      render(
        <AppContext.Provider value={{ client, user: user("tenant_admin") }}>
          <VersionPage versionId={id} />
        </AppContext.Provider>,
        root,
      );
    });
    await settle();
    return calls;
  }

  it("says a malformed id is not a version id, without asking the server (bug: raw validation text)", async () => {
    const calls = await mountVersion("not-a-uuid", 400);
    expect(calls).toEqual([]);
    expect(byTestId(root, "version-invalid")!.textContent).toContain("is not a version id");
    expect(root.textContent).not.toContain("Try again");
  });

  it("says an unknown version is not found, with no useless retry (bug: 'Something went wrong')", async () => {
    await mountVersion("0192f3c4-0000-7000-8000-000000000000", 404);
    expect(byTestId(root, "version-not-found")!.textContent).toContain("No adapter version has this id");
    expect(root.textContent).not.toContain("Something went wrong");
    expect(root.textContent).not.toContain("Try again");
  });
});

describe("lifecycle steps", () => {
  it("show where a rejected version stopped", async () => {
    const { stepState } = await import("../src/components/VersionDetails");
    // Refused by validation: never evaluated.
    expect(["uploaded", "validating", "evaluating", "final"].map((s) => stepState(s, "rejected", false))).toEqual([
      "done", "failed", "skipped", "done",
    ]);
    // Refused by the quality gate: every step ran.
    expect(["uploaded", "validating", "evaluating", "final"].map((s) => stepState(s, "rejected", true))).toEqual([
      "done", "done", "done", "done",
    ]);
    expect(["uploaded", "validating", "evaluating", "final"].map((s) => stepState(s, "validating", false))).toEqual([
      "done", "current", "todo", "todo",
    ]);
  });
});
