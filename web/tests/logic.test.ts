import { describe, expect, it } from "vitest";
import type { FinanceRow } from "../src/api/types";
import { FINANCE_COLUMNS, columnDef, csvUrl, financeTotals, totalsMismatch } from "../src/lib/finance";
import { formatBytes, formatMetric, meterFraction, meterLevel, relativeTime } from "../src/lib/format";
import { gateRows, gateSummary } from "../src/lib/gate";
import { givenLimits, limitsToText, parseLimits, slugify } from "../src/lib/limits";
import { canOpen, homeFor, navFor } from "../src/lib/roles";
import { matchRoute } from "../src/lib/router";
import { sortRows } from "../src/lib/sort";
import { buildUploadForm, uploadProblem, type UploadFields } from "../src/lib/upload";
import { adapterLabel, fillDays, hasUsage } from "../src/lib/usage";

function frow(id: string, billed: number, cost: number, extra: Partial<FinanceRow> = {}): FinanceRow {
  return {
    tenant_id: id,
    tenant_name: id,
    requests: 1,
    prompt_tokens: 10,
    cached_tokens: 2,
    completion_tokens: 5,
    billed_microusd: billed,
    compute_cost_microusd: cost,
    margin_microusd: billed - cost,
    breakdown: [],
    ...extra,
  };
}

describe("finance", () => {
  it("totals every column in integers", () => {
    const rows = Array.from({ length: 10 }, (_, i) => frow(`t${i}`, 100_000, 33_333));
    const t = financeTotals(rows);
    expect(t.billed_microusd).toBe(1_000_000n);
    expect(t.compute_cost_microusd).toBe(333_330n);
    expect(t.margin_microusd).toBe(666_670n);
    expect(t.requests).toBe(10n);
    expect(t.prompt_tokens).toBe(100n);
  });

  it("names the fields where the server's totals disagree with its rows", () => {
    const rows = [frow("a", 5, 3), frow("b", 7, 1)];
    const ok = { requests: 2, prompt_tokens: 20, cached_tokens: 4, completion_tokens: 10, billed_microusd: 12, compute_cost_microusd: 4, margin_microusd: 8 };
    expect(totalsMismatch(financeTotals(rows), ok)).toEqual([]);
    expect(totalsMismatch(financeTotals(rows), { ...ok, billed_microusd: 13 })).toEqual(["billed_microusd"]);
    expect(totalsMismatch(financeTotals(rows), null)).toEqual([]);
  });

  it("sorts by margin %, tenants with nothing billed last", () => {
    const rows = [frow("low", 1_000_000, 900_000), frow("none", 0, 50), frow("high", 1_000_000, 100_000)];
    const key = columnDef("margin_pct").key;
    expect(sortRows(rows, key, "desc").map((r) => r.tenant_id)).toEqual(["high", "low", "none"]);
    expect(sortRows(rows, key, "asc").map((r) => r.tenant_id)).toEqual(["low", "high", "none"]);
  });

  it("has one sortable column per table column, text only for the tenant", () => {
    expect(FINANCE_COLUMNS.filter((c) => !c.numeric).map((c) => c.id)).toEqual(["tenant"]);
    expect(new Set(FINANCE_COLUMNS.map((c) => c.id)).size).toBe(FINANCE_COLUMNS.length);
  });

  it("links the CSV export for the chosen period", () => {
    expect(csvUrl({ from: "2025-01-01", to: "2025-01-31" })).toBe("/api/finance/report.csv?from=2025-01-01&to=2025-01-31");
  });
});

describe("usage", () => {
  const rows = [
    { day: "2025-01-02", requests: 2, prompt_tokens: 20, cached_tokens: 0, completion_tokens: 8, billed_microusd: 30 },
    { day: "2025-01-04", requests: 1, prompt_tokens: 5, cached_tokens: 1, completion_tokens: 2, billed_microusd: 9 },
  ];

  it("fills the days without traffic with zeros", () => {
    const days = fillDays(rows, { from: "2025-01-01", to: "2025-01-05" });
    expect(days.map((d) => d.day)).toEqual(["2025-01-01", "2025-01-02", "2025-01-03", "2025-01-04", "2025-01-05"]);
    expect(days.map((d) => d.prompt_tokens)).toEqual([0, 20, 0, 5, 0]);
  });

  it("leaves out days after today instead of plotting them as zero", () => {
    expect(fillDays(rows, { from: "2025-01-01", to: "2025-01-31" }, "2025-01-04").map((d) => d.day)).toEqual([
      "2025-01-01",
      "2025-01-02",
      "2025-01-03",
      "2025-01-04",
    ]);
  });

  it("keeps a row outside the period rather than losing it", () => {
    expect(fillDays(rows, { from: "2025-01-03", to: "2025-01-04" }).map((d) => d.day)).toEqual(["2025-01-02", "2025-01-03", "2025-01-04"]);
  });

  it("labels base-model rows and detects empty periods", () => {
    expect(adapterLabel(null)).toBe("base model");
    expect(adapterLabel("bot")).toBe("bot");
    expect(hasUsage({ requests: 0, prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0, billed_microusd: 0 })).toBe(false);
    expect(hasUsage({ requests: 1, prompt_tokens: 0, cached_tokens: 0, completion_tokens: 0, billed_microusd: 0 })).toBe(true);
  });
});

describe("gateRows", () => {
  it("pairs metrics with min_/max_ thresholds and judges them", () => {
    const rows = gateRows({
      passed: false,
      metrics: { margin: 0.01, fp8_agreement: 0.99, latency_ms: 40, loss: 1.2 },
      thresholds: { min_margin: 0.05, min_fp8_agreement: 0.98, max_latency_ms: 30, loss: 2, min_examples: 16 },
      examples: [],
    });
    const by = Object.fromEntries(rows.map((r) => [r.name, r]));
    expect(by.margin).toMatchObject({ threshold: 0.05, kind: "min", pass: false });
    expect(by.fp8_agreement).toMatchObject({ kind: "min", pass: true });
    expect(by.latency_ms).toMatchObject({ kind: "max", pass: false });
    expect(by.loss).toMatchObject({ threshold: 2, kind: null, pass: null });
    expect(by.min_examples).toMatchObject({ value: undefined, threshold: 16, pass: null });
    expect(rows).toHaveLength(5);
  });
});

describe("gateSummary", () => {
  const gate = {
    passed: true,
    metrics: {
      adapter: { exact_match: 0.75, rouge_l: 0.8375, token_f1: 0.84 },
      base: { exact_match: 0, rouge_l: 0.1, token_f1: 0.05 },
      full_precision: { exact_match: 0.75, rouge_l: 0.85, token_f1: 0.84 },
      fp8_token_agreement: 0.97,
      fp8_exact_output_match: 0.9167,
      served_weight_dtype: "fp8",
      latency: { base_ms_per_token: 3.456, adapter_ms_per_token: 5.43, adapter_overhead: 1.571 },
      n_examples: 12,
      n_skipped: 0,
      eval_set: "tenant",
      extra_thing: 3,
    },
    thresholds: { metric: "rouge_l", min_margin: 0.05, min_fp8_agreement: 0.9 },
    examples: [],
  };

  it("turns the gate's nested metrics into its two checks and a score table", () => {
    const s = gateSummary(gate);
    expect(s.flat).toBeNull();
    const margin = s.checks.find((c) => c.id === "margin")!;
    expect(margin.value).toBeCloseTo(0.7375);
    expect(margin).toMatchObject({ threshold: 0.05, pass: true });
    expect(s.checks.find((c) => c.id === "fp8")).toMatchObject({ value: 0.97, threshold: 0.9, pass: true });
    expect(s.scores.map((r) => r.name)).toEqual(["exact_match", "rouge_l", "token_f1"]);
    expect(s.scores.find((r) => r.gated)?.name).toBe("rouge_l");
    expect(s.scores[0]).toMatchObject({ base: 0, adapter: 0.75, full: 0.75, delta: 0.75 });
    const facts = Object.fromEntries(s.facts.map((f) => [f.label, f.value]));
    expect(facts.Examples).toBe("12 from the eval set uploaded with this version");
    expect(facts["Adapter overhead"]).toBe("×1.571");
    expect(facts["extra thing"]).toBe("3"); // nothing the gate reported is hidden
  });

  it("fails a check below its threshold and falls back to flat rows for other shapes", () => {
    const low = gateSummary({ ...gate, passed: false, metrics: { ...gate.metrics, fp8_token_agreement: 0.5 } });
    expect(low.checks.find((c) => c.id === "fp8")?.pass).toBe(false);
    const flat = gateSummary({ passed: null as unknown as boolean, metrics: { margin: 0.1 }, thresholds: { min_margin: 0.05 }, examples: [] });
    expect(flat.flat).toHaveLength(1);
  });
});

describe("limits", () => {
  it("turns blanks into unlimited and accepts thousands separators", () => {
    expect(parseLimits({ tokens_per_min: "100,000", requests_per_min: "", concurrent_requests: " 8 ", monthly_token_budget: "1_000_000" })).toEqual({
      ok: true,
      limits: { tokens_per_min: 100000, requests_per_min: null, concurrent_requests: 8, monthly_token_budget: 1000000 },
    });
  });

  it("refuses fractions, negatives and words", () => {
    for (const bad of ["1.5", "-3", "lots", "1e6"]) {
      const r = parseLimits({ tokens_per_min: bad, requests_per_min: "", concurrent_requests: "", monthly_token_budget: "" });
      expect(r.ok).toBe(false);
    }
  });

  it("round-trips through the form text", () => {
    const l = { tokens_per_min: 5, requests_per_min: null, concurrent_requests: 0, monthly_token_budget: 7 };
    expect(parseLimits(limitsToText(l))).toEqual({ ok: true, limits: l });
  });

  it("sends only the filled-in windows when creating, so the rest get the server's defaults", () => {
    expect(givenLimits({ tokens_per_min: 0, requests_per_min: null, concurrent_requests: 8, monthly_token_budget: null })).toEqual({
      tokens_per_min: 0,
      concurrent_requests: 8,
    });
  });

  it("suggests URL-safe slugs", () => {
    expect(slugify("  Acme Corp. (EU) ")).toBe("acme-corp-eu");
    expect(slugify("Café Über")).toBe("cafe-uber");
  });
});

describe("roles", () => {
  it("shows each role only its own pages", () => {
    expect(navFor("tenant_member").map((n) => n.testid)).toEqual(["nav-usage", "nav-keys", "nav-adapters", "nav-playground", "nav-batches"]);
    expect(navFor("finance").map((n) => n.path)).toEqual(["/finance"]);
    expect(navFor("platform_admin").map((n) => n.path)).toContain("/admin/engines");
    expect(homeFor("platform_admin")).toBe("/admin/tenants");
  });

  it("lets no role open another's pages", () => {
    expect(canOpen("tenant_member", "/admin/tenants")).toBe(false);
    expect(canOpen("tenant_admin", "/finance")).toBe(false);
    expect(canOpen("finance", "/usage")).toBe(false);
    expect(canOpen("finance", "/admin/engines")).toBe(false);
    expect(canOpen("platform_admin", "/finance")).toBe(true);
    expect(canOpen("tenant_member", "/adapters/versions/v1")).toBe(true);
    expect(canOpen("tenant_member", "/adaptersX")).toBe(false);
  });
});

describe("matchRoute", () => {
  it("extracts decoded params and refuses other shapes", () => {
    expect(matchRoute("/admin/versions/:id", "/admin/versions/av_1%2F2")).toEqual({ id: "av_1/2" });
    expect(matchRoute("/admin/versions/:id", "/admin/versions/av_1/")).toEqual({ id: "av_1" });
    expect(matchRoute("/admin/versions/:id", "/admin/versions")).toBeNull();
    expect(matchRoute("/admin/versions/:id", "/adapters/versions/x")).toBeNull();
    expect(matchRoute("/admin/versions/:id", "/admin/versions/%E0%A4%A")).toBeNull();
  });
});

describe("upload form", () => {
  const file = (name: string, bytes = 3) => new File([new Uint8Array(bytes)], name);
  const base: UploadFields = { name: "bot", mode: "archive", files: [file("a.tar.gz")], evalSet: null, minMargin: "", minFp8Agreement: "" };

  it("uses the field names of the API: name, file, files, eval_set, thresholds", () => {
    const one = buildUploadForm({ ...base, evalSet: file("eval.jsonl"), minMargin: "0.05", minFp8Agreement: " 0.98 " });
    expect([...one.keys()]).toEqual(["name", "file", "eval_set", "min_margin", "min_fp8_agreement"]);
    expect(one.get("min_fp8_agreement")).toBe("0.98");
    expect((one.get("file") as File).name).toBe("a.tar.gz");

    const two = buildUploadForm({ ...base, mode: "files", files: [file("adapter_config.json"), file("adapter_model.safetensors")] });
    expect(two.getAll("files").map((f) => (f as File).name)).toEqual(["adapter_config.json", "adapter_model.safetensors"]);
    expect(two.has("file")).toBe(false);
    expect(two.has("min_margin")).toBe(false);
  });

  it("catches incomplete forms before sending bytes", () => {
    expect(uploadProblem(base)).toBeNull();
    expect(uploadProblem({ ...base, name: " " })).toMatch(/name/);
    expect(uploadProblem({ ...base, files: [] })).toMatch(/archive/);
    expect(uploadProblem({ ...base, files: [file("model.bin")] })).toMatch(/\.tar\.gz or \.zip/);
    expect(uploadProblem({ ...base, mode: "files", files: [file("adapter_config.json")] })).toMatch(/both/);
    expect(uploadProblem({ ...base, minMargin: "abc" })).toMatch(/Minimum margin/);
  });
});

describe("format", () => {
  it("formats metrics, bytes, meters and ages", () => {
    expect(formatMetric(0.123456)).toBe("0.1235");
    expect(formatMetric(12000)).toBe("12,000");
    expect(formatMetric(true)).toBe("yes");
    expect(formatBytes(1536)).toBe("1.5 KB");
    expect(formatBytes(512)).toBe("512 B");
    expect(meterFraction(50, null)).toBeNull();
    expect(meterFraction(150, 100)).toBe(1);
    expect(meterFraction(1, 0)).toBe(1);
    expect(meterLevel(0.79)).toBe("ok");
    expect(meterLevel(0.8)).toBe("warn");
    expect(meterLevel(1)).toBe("over");
    const now = new Date("2025-01-01T12:00:00Z");
    expect(relativeTime(null, now)).toBe("never");
    expect(relativeTime("2025-01-01T11:55:00Z", now)).toBe("5 min ago");
    expect(relativeTime("2024-12-29T12:00:00Z", now)).toBe("3 d ago");
  });
});
