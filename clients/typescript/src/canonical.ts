/**
 * Canonical JSON and the content-derived idempotency key, byte for byte as the server computes them
 * (`ledger/canonical.py`: `dumps`, `digest`; `ledger/engine/proposal.py`: `derive_key`, `key_material`, `target_of`).
 *
 * The same logical value always gives the same bytes: object keys sorted by code point, strings in Unicode NFC,
 * integral numbers written as integers (`2.0` is `2`, `1e21` is `1000000000000000000000`), other numbers as Python
 * writes a float (`1e-05`, `0.0001`), no spaces, non-ASCII text as UTF-8.
 */

export type Json = null | boolean | number | string | Json[] | { [key: string]: Json | undefined };

const UNSTORABLE = "text contains a NUL character or a lone surrogate, which cannot be stored";

/** A normalised copy: NFC strings (keys too); refuses what the server refuses (NUL, lone surrogates, NaN). */
export function canonical(value: unknown): Json {
  if (value === null) return null;
  switch (typeof value) {
    case "string":
      return text(value);
    case "boolean":
      return value;
    case "number":
      if (!Number.isFinite(value)) throw new TypeError(`${value} is not a JSON number`);
      return value;
    case "bigint":
      throw new TypeError("a bigint is not a JSON value: send a number or a string");
    case "object": {
      if (Array.isArray(value)) return value.map((item) => (item === undefined ? null : canonical(item)));
      const out: { [key: string]: Json } = {};
      for (const [key, item] of Object.entries(value as object)) {
        if (item === undefined || typeof item === "function" || typeof item === "symbol") continue; // never sent
        out[text(key)] = canonical(item);
      }
      return out;
    }
    default:
      throw new TypeError(`${typeof value} is not a JSON value`);
  }
}

function text(value: string): string {
  if (value.includes("\u0000") || hasLoneSurrogate(value)) throw new TypeError(UNSTORABLE);
  return value.normalize("NFC");
}

function hasLoneSurrogate(value: string): boolean {
  return /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/.test(value);
}

/** Python's `str < str`: by code point (JavaScript's default sort compares UTF-16 code units). */
function byCodePoint(a: string, b: string): number {
  const x = [...a], y = [...b];
  for (let i = 0; i < Math.min(x.length, y.length); i++) {
    const d = x[i].codePointAt(0)! - y[i].codePointAt(0)!;
    if (d) return d;
  }
  return x.length - y.length;
}

/** A number as the server writes it once canonical: an integer in full, anything else as Python's `repr(float)`. */
export function pythonNumber(n: number): string {
  const [mantissa, exp] = n.toExponential().split("e"); // the shortest digits that round-trip, as repr uses
  const negative = mantissa.startsWith("-") && n !== 0;
  const digits = mantissa.replace("-", "").replace(".", "");
  const e = Number(exp);
  let body: string;
  if (Number.isInteger(n)) {
    // The server reads an integral number through Decimal(str(float)): its shortest digits, then zeros.
    body = n === 0 ? "0" : digits + "0".repeat(Math.max(0, e - (digits.length - 1)));
  } else if (e < -4 || e >= 16) {
    const lead = digits.length > 1 ? `${digits[0]}.${digits.slice(1)}` : digits;
    body = `${lead}e${e < 0 ? "-" : "+"}${String(Math.abs(e)).padStart(2, "0")}`;
  } else if (e < 0) {
    body = `0.${"0".repeat(-e - 1)}${digits}`;
  } else {
    body = `${digits.slice(0, e + 1)}.${digits.slice(e + 1)}`;
  }
  return (negative ? "-" : "") + body;
}

/** `json.dumps(canonical(value), sort_keys=True, separators=(",", ":"), ensure_ascii=False)`. */
export function dumps(value: unknown): string {
  return write(canonical(value));
}

function write(value: Json | undefined): string {
  if (value === null || value === undefined) return "null";
  if (typeof value === "number") return pythonNumber(value);
  if (typeof value === "string" || typeof value === "boolean") return JSON.stringify(value);
  if (Array.isArray(value)) return `[${value.map(write).join(",")}]`;
  const keys = Object.keys(value).sort(byCodePoint);
  return `{${keys.map((key) => `${JSON.stringify(key)}:${write(value[key])}`).join(",")}}`;
}

async function sha256Hex(textValue: string): Promise<string> {
  const bytes = new TextEncoder().encode(textValue);
  // Node 18 has Web Crypto only under node:crypto; Node 20+, browsers and edge runtimes have it global.
  const nodeCrypto = "node:crypto";
  const subtle: SubtleCrypto = globalThis.crypto?.subtle ?? (await import(nodeCrypto)).webcrypto.subtle;
  const hash = new Uint8Array(await subtle.digest("SHA-256", bytes));
  return Array.from(hash, (byte) => byte.toString(16).padStart(2, "0")).join("");
}

/** `digest(*parts)`: the SHA-256 of the canonical JSON list of the parts, in hex. */
export function digest(...parts: unknown[]): Promise<string> {
  return sha256Hex(dumps(parts));
}

/** A tool's policy as far as the key needs it (from `GET /api/v1/tools`: `policy.target.from`, `policy.idempotency.key_fields`). */
export interface KeyPolicy {
  targetFrom?: string | null;
  keyFields?: string[] | null;
}

/** Python's `str()` of a JSON scalar, as the server turns a target taken from the args into its id. */
function pythonStr(value: Json): string {
  if (typeof value === "string") return value;
  if (typeof value === "boolean") return value ? "True" : "False";
  if (typeof value === "number") return pythonNumber(value);
  throw new TypeError("a target taken from the args must be a string, a number or a boolean");
}

function first200(value: string): string {
  return [...value].slice(0, 200).join("");
}

/** The target id the server derives for a call: `target_of` (an explicit target only where the policy lets the agent name it). */
export function targetOf(policy: KeyPolicy, args: Record<string, unknown>, explicit?: string | null): string {
  const where = policy.targetFrom || "";
  if (where === "agent") return first200(explicit == null ? "" : String(explicit));
  if (!where.startsWith("args.")) return "";
  let value: Json | undefined = canonical(args);
  for (const part of where.split(".").slice(1)) {
    value = value && typeof value === "object" && !Array.isArray(value) ? value[part] : undefined;
  }
  return value === undefined || value === null ? "" : first200(pythonStr(value));
}

/** What identifies the logical action among its args: the tool's `key_fields` when declared, else all of them. */
export function keyMaterial(policy: KeyPolicy, args: Record<string, unknown>): Json {
  const clean = canonical(args) as { [key: string]: Json };
  if (!policy.keyFields || policy.keyFields.length === 0) return clean;
  return Object.fromEntries(policy.keyFields.map((name) => [name, clean[name] ?? null]));
}

export interface KeyInput {
  /** The tenant's id (the server's `run.tenant_id`). */
  tenantId: number;
  runId: number;
  tool: string;
  args: Record<string, unknown>;
  policy?: KeyPolicy;
  target?: string | null;
  repeatOf?: number | null;
}

/** The Idempotency-Key the server derives when a proposal carries none: `"uw-" + digest(tenant, run, tool, target, key material[, {repeat_of}])`. */
export async function deriveKey(input: KeyInput): Promise<string> {
  const policy = input.policy ?? {};
  const repeat = input.repeatOf != null ? [{ repeat_of: input.repeatOf }] : [];
  return "uw-" + (await digest(input.tenantId, input.runId, input.tool, targetOf(policy, input.args, input.target),
    keyMaterial(policy, input.args), ...repeat));
}
