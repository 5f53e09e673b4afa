/** Pure logic behind the issue-26 views: money columns, the period in the URL, the adapters table, the playground's
 * stream reader and snippets, formatted limits, ids, and the upload status line. */
import { describe, expect, it } from "vitest";
import type { Adapter, AdapterVersion, VersionStatus } from "../src/api/types";
import { doneMessage } from "../src/components/UploadForm";
import { adapterRows, paginate, summarize } from "../src/lib/adapters";
import { gateSummary } from "../src/lib/gate";
import { periodFromSearch, searchWithPeriod } from "../src/lib/dates";
import { isUuid } from "../src/lib/ids";
import { formatLimitText, limitsToText, parseLimits } from "../src/lib/limits";
import { columnDecimals, formatUsdFixed } from "../src/lib/money";
import { SseReader, curlSnippet, pythonSnippet, readChunk } from "../src/lib/playground";

describe("money columns", () => {
  it("use the decimals their most precise figure needs, at least cents", () => {
    expect(columnDecimals([1_234_500_000, 2_000_000])).toBe(2);
    expect(columnDecimals([1_234_500_000, 1_234])).toBe(6);
    expect(columnDecimals([10_000, 5_000_000])).toBe(2); // $0.01
    expect(columnDecimals([1_000, -250_000n])).toBe(3); // $0.001, -$0.25
    expect(columnDecimals([])).toBe(2);
    expect([1_234_500_000, 1_234].map((v) => formatUsdFixed(v, 6))).toEqual(["$1,234.500000", "$0.001234"]);
  });
});

describe("the period in the URL", () => {
  const month = { from: "2025-03-01", to: "2025-03-31" };
  it("is read back, and an invalid one falls back", () => {
    expect(periodFromSearch("?from=2025-01-02&to=2025-01-09", month)).toEqual({ from: "2025-01-02", to: "2025-01-09" });
    expect(periodFromSearch("?from=2025-01-09&to=2025-01-02", month)).toEqual(month);
    expect(periodFromSearch("?from=2025-02-30&to=2025-03-01", month)).toEqual(month);
    expect(periodFromSearch("", month)).toEqual(month);
  });
  it("is written without dropping other parameters", () => {
    expect(searchWithPeriod("?by=key", month)).toBe("?by=key&from=2025-03-01&to=2025-03-31");
  });
});

let n = 0;
function version(v: number, status: VersionStatus, created = `2025-01-0${v}T00:00:00Z`): AdapterVersion {
  return {
    id: `v${++n}`, adapter_id: "a", adapter_name: "x", version: v, status, progress: null, reasons: [], rank: 8,
    target_modules: null, content_sha256: null, eval: null, override: null, created_at: created, ready_at: null,
  };
}
function adapter(name: string, active: number | null, ...versions: AdapterVersion[]): Adapter {
  return { id: name, name, active_version: active, versions };
}

describe("the adapters table", () => {
  const list = [
    adapter("zeta-test", null, version(1, "rejected")),
    adapter("support", 2, version(1, "ready"), version(2, "ready"), version(3, "evaluating")),
    adapter("alpha-broken", null, version(1, "rejected"), version(2, "rejected")),
    adapter("new-one", null, version(1, "validating")),
    adapter("billing", 1, version(1, "ready")),
  ];

  it("summarizes an adapter: active, latest, group", () => {
    const s = summarize(list[1]);
    expect([s.active?.version, s.latest?.version, s.group, s.inFlight]).toEqual([2, 3, "live", true]);
    expect(summarize(list[2]).group).toBe("rejected");
    expect(summarize(list[3]).group).toBe("in_progress");
  });

  it("lists routable adapters first, then those on their way; rejected ones collapsed", () => {
    const r = adapterRows(list, { query: "", status: "all", showRejected: false });
    expect(r.rows.map((s) => s.adapter.name)).toEqual(["billing", "support", "new-one"]);
    expect([r.hiddenRejected, r.matching]).toEqual([2, 5]);
    const all = adapterRows(list, { query: "", status: "all", showRejected: true });
    expect(all.rows.map((s) => s.adapter.name)).toEqual(["billing", "support", "new-one", "alpha-broken", "zeta-test"]);
  });

  it("filters by status and searches by name (a search shows rejected matches too)", () => {
    const names = (q: Parameters<typeof adapterRows>[1]) => adapterRows(list, q).rows.map((s) => s.adapter.name);
    expect(names({ query: "", status: "in_progress", showRejected: false })).toEqual(["support", "new-one"]);
    expect(names({ query: "", status: "rejected", showRejected: false })).toEqual(["alpha-broken", "zeta-test"]);
    expect(names({ query: "", status: "live", showRejected: false })).toEqual(["billing", "support"]);
    expect(names({ query: "TEST", status: "all", showRejected: false })).toEqual(["zeta-test"]);
  });

  it("pages", () => {
    const rows = Array.from({ length: 47 }, (_, i) => i);
    expect(paginate(rows, 1, 20)).toMatchObject({ page: 1, pages: 3, first: 1, last: 20 });
    expect(paginate(rows, 3, 20)).toMatchObject({ page: 3, first: 41, last: 47, items: rows.slice(40) });
    expect(paginate(rows, 9, 20).page).toBe(3);
    expect(paginate([], 1, 20)).toMatchObject({ page: 1, pages: 1, first: 0, last: 0 });
  });
});

describe("the playground's stream", () => {
  it("reads events however the bytes are split", () => {
    const r = new SseReader();
    const chunk = (text: string, extra = "") => `data: {"id":"chatcmpl-req_1","choices":[{"delta":{"content":${JSON.stringify(text)}},"finish_reason":null}]${extra}}\n\n`;
    const stream = chunk("Hel") + chunk("lo") + `data: {"id":"chatcmpl-req_1","choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}\n\ndata: [DONE]\n\n`;
    const payloads: string[] = [];
    for (let i = 0; i < stream.length; i += 7) payloads.push(...r.push(stream.slice(i, i + 7)));
    expect(payloads.at(-1)).toBe("[DONE]");
    const deltas = payloads.map(readChunk).filter((d) => d !== null);
    expect(deltas.map((d) => d!.text).join("")).toBe("Hello");
    expect(deltas[0]!.id).toBe("chatcmpl-req_1");
    expect(deltas.at(-1)!.usage).toEqual({ prompt_tokens: 5, completion_tokens: 2, total_tokens: 7 });
  });

  it("surfaces an error event", () => {
    expect(() => readChunk('{"error":{"message":"engine overloaded"}}')).toThrow("engine overloaded");
  });

  it("writes the same request as curl and Python, with no key in them", () => {
    const req = { model: "support@2", messages: [{ role: "user" as const, content: "It's \"quoted\"" }], max_tokens: 32, temperature: 0.5 };
    const curl = curlSnippet("https://mplex.example/v1", req);
    expect(curl).toContain("curl 'https://mplex.example/v1/chat/completions'");
    expect(curl).toContain("$MULTIPLEX_API_KEY");
    expect(curl).toContain(`It'\\''s`); // the single quote survives the shell quoting
    const body = curl.slice(curl.indexOf("-d '") + 4, curl.lastIndexOf("'")).replace(/'\\''/g, "'");
    expect(JSON.parse(body)).toMatchObject({ model: "support@2", max_tokens: 32, stream: true, stream_options: { include_usage: true } });
    const py = pythonSnippet("https://mplex.example/v1", req);
    expect(py).toContain('base_url="https://mplex.example/v1"');
    expect(py).toContain('model="support@2"');
    expect(py).toContain('{"role": "user", "content": "It\'s \\"quoted\\""}');
    expect(py).toContain('os.environ["MULTIPLEX_API_KEY"]');
  });
});

describe("limit inputs", () => {
  it("group thousands, and still parse", () => {
    expect(formatLimitText("1000000")).toBe("1,000,000");
    expect(formatLimitText(" 12 500 ")).toBe("12,500");
    expect(formatLimitText("1e6")).toBe("1e6"); // left for parseLimits to refuse
    expect(formatLimitText("")).toBe("");
    const text = limitsToText({ tokens_per_min: 100_000, requests_per_min: null, concurrent_requests: 4, monthly_token_budget: 1_000_000 });
    expect(text.tokens_per_min).toBe("100,000");
    expect(parseLimits(text)).toEqual({ ok: true, limits: { tokens_per_min: 100_000, requests_per_min: null, concurrent_requests: 4, monthly_token_budget: 1_000_000 } });
  });
});

describe("ids and upload status", () => {
  it("knows a version id when it sees one", () => {
    expect(isUuid("0192f3c4-5d6e-7f80-9a1b-2c3d4e5f6a7b")).toBe(true);
    expect(isUuid("not-a-uuid")).toBe(false);
  });
  it("says what the upload became, not what it was (bug: 'validation has started' after ready)", () => {
    expect(doneMessage("ready")).toContain("ready");
    expect(doneMessage("rejected")).toContain("rejected");
    expect(doneMessage("validating")).toContain("validated");
    for (const s of ["ready", "rejected"] as const) expect(doneMessage(s)).not.toContain("has started");
  });
});

describe("the gate's checks", () => {
  it("are the gate's own list when it reports one, every check with its verdict", () => {
    const s = gateSummary({
      passed: true,
      metrics: { check: "no_regression", adapter: { rouge_l: 0.9 }, base: { rouge_l: 0.92 }, n_examples: 200,
        regression: { n: 200, mean_drop: 0.02, upper_bound: 0.031, confidence: 0.95, worse: 9, better: 3, tied: 188 },
        malformed: { count: 0, rate: 0 }, degenerate_logits: { tokens: 0, checked: 4000, outputs: 0 } },
      thresholds: { metric: "rouge_l", max_regression: 0.05 },
      reasons: [
        { check: "no_regression", code: "no_regression_ok", passed: true, message: "within tolerance", value: 0.031, threshold: 0.05 },
        { check: "well_formed", code: "well_formed_ok", passed: true, message: "0 of 200", value: 0, threshold: 0.02 },
        { check: "logits", code: "logits_ok", passed: true, message: "finite", value: 0, threshold: 0 },
        { check: "fp8_agreement", code: "fp8_agreement_ok", passed: true, message: "not applicable", value: 1, threshold: 0.9 },
      ],
      examples: [],
    });
    expect(s.checks.map((c) => [c.id, c.cmp, c.pass])).toEqual([
      ["no_regression", "max", true], ["well_formed", "max", true], ["logits", "max", true], ["fp8_agreement", "min", true],
    ]);
    expect(s.checks[0].message).toBe("within tolerance");
    // A margin row the gate never applied (no task eval set) is not made up from the scores.
    expect(s.checks.some((c) => c.id === "margin")).toBe(false);
    const facts = Object.fromEntries(s.facts.map((f) => [f.label, f.value]));
    expect(facts["Quality check"]).toContain("no regression");
    expect(facts["Paired drop vs the base"]).toContain("95% upper bound 0.031 over 200 items (9 worse, 3 better, 188 unchanged)");
    expect(facts["Degenerate logits"]).toBe("0 of 4,000 tokens");
  });
});
