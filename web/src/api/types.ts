/** Wire types of the management API (docs/api.md). Money is integer micro-USD; days are YYYY-MM-DD. */

export type Role = "tenant_member" | "tenant_admin" | "platform_admin" | "finance";

export interface User {
  id: string;
  email: string;
  role: Role;
  tenant_id: string | null;
  tenant_name: string | null;
}

export interface Session {
  user: User;
  csrf_token: string;
}

/** `null` means unlimited. */
export interface Limits {
  tokens_per_min: number | null;
  requests_per_min: number | null;
  concurrent_requests: number | null;
  monthly_token_budget: number | null;
}

export type TenantStatus = "active" | "suspended";

export interface Tenant {
  id: string;
  name: string;
  slug: string;
  plan: string;
  status: TenantStatus;
  limits: Limits;
}

export interface AdminTenant extends Tenant {
  usage_this_month_tokens: number;
  billed_this_month_microusd: number;
  user_count: number;
}

export interface TenantUser {
  id: string;
  email: string;
  role: Role;
  created_at: string;
  last_login_at: string | null;
  disabled: boolean;
}

export interface UsageFields {
  requests: number;
  prompt_tokens: number;
  cached_tokens: number;
  completion_tokens: number;
  billed_microusd: number;
}

export interface UsageRow extends UsageFields {
  day?: string;
  model?: string | null;
  adapter?: string | null;
}

export type UsageGroupBy = "day" | "adapter" | "model";

export interface UsageReport {
  rows: UsageRow[];
  totals: UsageFields;
  /** Batch API lines of the period (also in rows and totals, billed at the batch rate). */
  batch?: { requests: number; prompt_tokens: number; completion_tokens: number };
}

export interface Meter {
  limit: number | null;
  /** null when the gateway cannot read the live counter (Redis down). */
  used: number | null;
}

export interface Spend {
  period: { from: string; to: string };
  billed_microusd: number;
  projected_microusd: number;
  budget: { monthly_token_budget: number | null; used_tokens: number };
  /** The token budget at this month's average billed price per token (an estimate; null until there is usage). */
  budget_in_dollars?: { used_microusd: number; budget_microusd: number | null; microusd_per_million_tokens: number | null };
  meters: {
    tokens_per_min: Meter;
    requests_per_min: Meter;
    concurrent: Meter;
    monthly_tokens: Meter;
  };
}

export interface ApiKey {
  id: string;
  name: string;
  prefix: string;
  scopes: string[];
  created_at: string;
  last_used_at: string | null;
  revoked_at: string | null;
  /** Set on temporary keys only (the playground's). */
  expires_at?: string | null;
}

export interface CreatedKey {
  id: string;
  name: string;
  prefix: string;
  key: string;
  created_at: string;
}

export type VersionStatus = "uploaded" | "validating" | "evaluating" | "ready" | "rejected";

export interface Reason {
  code: string;
  message: string;
}

/** One check of the quality gate as it reported it (services/adapters/checks.py), passed or not. */
export interface GateReason {
  check: string;
  code: string;
  passed: boolean;
  message: string;
  value: number | null;
  threshold: number | null;
}

export interface GateEval {
  passed: boolean;
  metrics: Record<string, unknown>;
  thresholds: Record<string, unknown>;
  /** Every check of the gate (gates that predate it report none: the page then derives the two old checks). */
  reasons?: GateReason[];
  examples: unknown[];
}

export interface Override {
  by: string;
  reason: string;
  at: string;
}

export interface AdapterVersion {
  id: string;
  adapter_id: string;
  adapter_name: string;
  version: number;
  status: VersionStatus;
  /** The version the adapter's name routes to now. */
  active?: boolean;
  progress: { percent: number; step: string } | null;
  reasons: Reason[];
  rank: number | null;
  target_modules: string[] | null;
  content_sha256: string | null;
  eval: GateEval | null;
  override: Override | null;
  created_at: string;
  ready_at: string | null;
}

export interface Adapter {
  id: string;
  name: string;
  active_version: number | null;
  versions: AdapterVersion[];
}

export interface AdminAdapter extends Adapter {
  tenant_id: string;
  tenant_name: string;
}

export interface UploadAccepted {
  version_id: string;
  adapter_id: string;
  version: number;
  status: VersionStatus;
}

export interface Engine {
  id: string;
  url: string;
  base_model: string;
  running: number;
  waiting: number;
  /** Fraction of KV blocks in use, 0..1. */
  kv_usage: number;
  slot_adapters: string[];
  host_adapters: string[];
  updated_at: string;
  slots_total?: number | null;
  /** Every content id above, with the adapter versions (name@version) and tenants it is. */
  adapters?: EngineAdapter[];
  health?: { state: "healthy" | "degraded" | "unhealthy"; reasons: string[] } | null;
}

export interface EngineAdapter {
  content_id: string;
  names: string[];
  tenants: string[];
}

export interface EngineSample {
  ts: string;
  tokens_per_s: number | null;
  running: number;
  waiting: number;
  kv_usage: number;
  slots_used: number;
  slots_total: number | null;
}

export interface EngineHistory {
  id: string;
  samples: EngineSample[];
}

export interface FinanceFields {
  requests: number;
  prompt_tokens: number;
  cached_tokens: number;
  completion_tokens: number;
  billed_microusd: number;
  compute_cost_microusd: number;
  margin_microusd: number;
}

export interface FinanceBreakdown extends FinanceFields {
  model: string | null;
  adapter: string | null;
  /** "batch": the model's Batch API lines (at the batch rate), apart from its live ("default") ones */
  service_tier?: "default" | "batch";
}

export interface FinanceRow extends FinanceFields {
  tenant_id: string;
  tenant_name: string;
  breakdown: FinanceBreakdown[];
}

export interface FinanceReport {
  period: { from: string; to: string };
  rows: FinanceRow[];
  totals: FinanceFields | null;
  unallocated_cost_microusd: number | null;
  /** Margin after the idle engine time no tenant used (the unallocated cost). */
  net_margin_microusd?: number;
}

export interface TrendDay {
  day: string;
  requests: number;
  billed_microusd: number;
  compute_cost_microusd: number;
  margin_microusd: number;
  unallocated_cost_microusd: number;
  net_margin_microusd: number;
}

export interface FinanceTrend {
  period: { from: string; to: string };
  rows: TrendDay[];
}

export interface KeyUsageRow extends UsageFields {
  key_id: string | null;
  key_name: string | null;
  key_prefix: string | null;
  revoked: boolean;
}

export interface KeyUsageReport {
  from: string;
  to: string;
  rows: KeyUsageRow[];
  totals: UsageFields;
}

export interface RequestRecord {
  request_id: string;
  model: string;
  adapter: string | null;
  status: string;
  http_status: number;
  prompt_tokens: number;
  cached_tokens: number;
  completion_tokens: number;
  billed_microusd: number | null;
  created_at: string;
  first_token_ms: number | null;
  finished_ms: number | null;
}

export interface PlaygroundKey {
  id: string;
  name: string;
  prefix: string;
  key: string;
  created_at: string;
  expires_at: string;
  limits: { requests_per_min: number | null; concurrent_requests: number | null };
}

export interface ListResponse<T> {
  data: T[];
}

/** A Batch API batch as `/api/tenant/batches` lists it (OpenAI's batch object, plus the page's ETA). */
export interface BatchJob {
  id: string;
  endpoint: string;
  status: "validating" | "failed" | "in_progress" | "finalizing" | "completed" | "expired" | "cancelling" | "cancelled";
  input_file_id: string;
  output_file_id: string | null;
  error_file_id: string | null;
  created_at: number;
  expires_at: number;
  completed_at: number | null;
  request_counts: { total: number; completed: number; failed: number };
  usage: { input_tokens: number; output_tokens: number; total_tokens: number };
  metadata: Record<string, string> | null;
  eta_s: number | null;
}
