// What the tests share: the live server scripts/test.mjs started, its people, and the sandbox world.
import { Unwind } from "../dist/index.js";

export const URL_ = process.env.UNWIND_URL;
export const KEY = process.env.UNWIND_AGENT_KEY;
export const TENANT_ID = Number(process.env.UNWIND_TENANT_ID);
const PASSWORD = process.env.UNWIND_PASSWORD;
if (!URL_ || !KEY) throw new Error("run these tests with `npm test` (scripts/test.mjs starts the server)");

export const client = (options = {}) => new Unwind(URL_, KEY, { tenantId: TENANT_ID, ...options });

/** A request as a person of the tenant (HTTP basic auth, as the Python tests decide). */
export async function asPerson(username, method, path, body) {
  const response = await fetch(URL_ + path, { method, headers: {
    Authorization: "Basic " + Buffer.from(`${username}:${PASSWORD}`).toString("base64"),
    "Content-Type": "application/json", Accept: "application/json" },
    body: body === undefined ? undefined : JSON.stringify(body) });
  const text = await response.text();
  if (!response.ok) throw new Error(`${method} ${path} as ${username}: ${response.status} ${text}`);
  return text ? JSON.parse(text) : null;
}

/** The approver decides the action's approval request over the API. */
export async function decide(approvalId, approve, reason = "") {
  return asPerson("approver", "POST", `/api/v1/approvals/${approvalId}/${approve ? "approve" : "reject"}`, { reason });
}

/** The sandbox world (as the operator): its state, faults. */
export const sandbox = (method, path, body) => asPerson("operator", method, `/sandbox/${path}`, body);

/** The run's status once it stops moving (unwinds finish in the worker). */
export async function settled(unwind, runId, timeout = 30) {
  const deadline = Date.now() + timeout * 1000;
  for (;;) {
    const run = await unwind.getRun(runId);
    if (!["unwinding", "running", "awaiting_approval"].includes(run.status) || Date.now() > deadline) return run;
    await new Promise((r) => setTimeout(r, 150));
  }
}

let counter = 0;
/** A name no other test uses (the sandbox world is shared by every test of the run). */
export const unique = (prefix) => `${prefix}-${process.pid}-${Date.now().toString(36)}-${++counter}`;
