/** Which pages each role sees. The server enforces roles; this only decides what to show. */
import type { Role } from "../api/types";

export interface NavItem {
  path: string;
  label: string;
  testid: string;
}

const TENANT_NAV: NavItem[] = [
  { path: "/usage", label: "Usage", testid: "nav-usage" },
  { path: "/keys", label: "API keys", testid: "nav-keys" },
  { path: "/adapters", label: "Adapters", testid: "nav-adapters" },
  { path: "/playground", label: "Playground", testid: "nav-playground" },
  { path: "/batches", label: "Batches", testid: "nav-batches" },
];

const ADMIN_NAV: NavItem[] = [
  { path: "/admin/tenants", label: "Tenants", testid: "nav-tenants" },
  { path: "/admin/upload", label: "Upload adapter", testid: "nav-upload" },
  { path: "/admin/engines", label: "Engines", testid: "nav-engines" },
  { path: "/finance", label: "Finance", testid: "nav-finance" },
];

const FINANCE_NAV: NavItem[] = [{ path: "/finance", label: "Finance", testid: "nav-finance" }];

export function navFor(role: Role): NavItem[] {
  switch (role) {
    case "tenant_member":
    case "tenant_admin":
      return TENANT_NAV;
    case "platform_admin":
      return ADMIN_NAV;
    case "finance":
      return FINANCE_NAV;
  }
}

export function homeFor(role: Role): string {
  return navFor(role)[0].path;
}

export const isTenantRole = (role: Role): boolean => role === "tenant_member" || role === "tenant_admin";

/** Route prefixes each role may open; anything else sends the user to their home page. */
const ACCESS: Record<Role, string[]> = {
  tenant_member: ["/usage", "/keys", "/adapters", "/playground", "/batches"],
  tenant_admin: ["/usage", "/keys", "/adapters", "/playground", "/batches"],
  platform_admin: ["/admin", "/finance"],
  finance: ["/finance"],
};

export function canOpen(role: Role, path: string): boolean {
  return ACCESS[role].some((p) => path === p || path.startsWith(`${p}/`));
}

export const ROLE_LABEL: Record<Role, string> = {
  tenant_member: "Tenant member",
  tenant_admin: "Tenant admin",
  platform_admin: "Platform admin",
  finance: "Finance",
};
