/** Identifiers as the API writes them. */

const UUID_RE = /^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$/i;

/** Whether `s` can be a resource id at all (versions, adapters, tenants and keys are UUIDs). */
export function isUuid(s: string): boolean {
  return UUID_RE.test(s);
}
