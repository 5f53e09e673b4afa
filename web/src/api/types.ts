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
}

export interface Meter {
  limit: number | null;
  used: number;
}

export interface Spend {
  period: { from: string; to: string };
  billed_microusd: number;
  projected_microusd: number;
  budget: { monthly_token_budget: number | null; used_tokens: number };
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

export interface GateEval {
  passed: boolean;
  metrics: Record<string, unknown>;
  thresholds: Record<string, unknown>;
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
}

export interface ListResponse<T> {
  data: T[];
}
