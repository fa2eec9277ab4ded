// The client against a live Unwind (scripts/test.mjs): sagas that complete and unwind, approvals decided by a person
// over the API, replays by key and by content, a held step stopped, and every error class.
import { createServer } from "node:http";
import { test } from "node:test";
import assert from "node:assert/strict";
import {
  ApprovalPending, IdempotencyMismatch, InFlight, NotAllowed, NotFound, OrderingViolation, PolicyDenied, Rejected,
  ReportRequired, RunNotActive, ToolRefused, Unavailable, Unwind, Unwound, ValidationFailed,
} from "../dist/index.js";
import { client, decide, sandbox, settled, unique, URL_, KEY } from "./helpers.mjs";

const unwind = client();

test("a saga that completes", async () => {
  const email = `${unique("ana")}@company.com`;
  const trail = await unwind.withRun({ goal: "Onboard Ana", onBehalfOf: "hr@company.com" }, async (run) => {
    const user = await run.act("hr.create_user", { email, name: "Ana Lima" });
    const license = await run.act("licenses.provision", { user_id: user.id, sku: "workspace-standard" });
    assert.equal(license.status, "active");
    return run;
  });
  assert.equal((await trail.refresh()).status, "completed");
  const words = await trail.trail();
  assert.ok(JSON.stringify(words).includes("Ana Lima"), "the trail names what was done");
  const world = await sandbox("GET", "state");
  assert.equal(world.users.filter((u) => u.email === email).length, 1);
});

test("a saga that unwinds: the failed step throws Unwound and the earlier steps are undone newest first", async () => {
  const email = `${unique("bo")}@company.com`;
  await sandbox("POST", "faults", { tool: "email.send", mode: "status", status: 504, times: 0 });
  let runId;
  try {
    await assert.rejects(unwind.withRun({ goal: "Onboard Bo" }, async (run) => {
      runId = run.id;
      const user = await run.act("hr.create_user", { email, name: "Bo" });
      await run.act("licenses.provision", { user_id: user.id, sku: "workspace-standard" });
      await run.act("email.send", { to: email, subject: "Welcome", body: "Hi" });
    }), (error) => error instanceof Unwound && error.errorClass === "http_504" && /Tell the user/.test(error.next));
  } finally {
    await sandbox("POST", "faults/clear", { tool: "email.send" });
  }
  const run = await settled(unwind, runId);
  assert.equal(run.status, "compensated");
  const undo = run.data.actions.filter((a) => a.kind === "compensation").map((a) => a.tool);
  assert.deepEqual(undo, ["licenses.revoke", "hr.delete_user"]);
  const world = await sandbox("GET", "state");
  assert.equal(world.users.filter((u) => u.email === email).length, 0);
});

test("an error thrown in withRun cancels the run, which unwinds", async () => {
  const email = `${unique("cy")}@company.com`;
  let runId;
  await assert.rejects(unwind.withRun({ goal: "Onboard Cy" }, async (run) => {
    runId = run.id;
    await run.act("hr.create_user", { email, name: "Cy" });
    throw new Error("the agent changed its mind");
  }), /changed its mind/);
  assert.equal((await settled(unwind, runId)).status, "compensated");
});

async function chargeWaiting(goal) {
  const run = await unwind.run({ goal, onBehalfOf: "carol@company.com" });
  await run.act("travel.book_flight", { passenger: "Carol", flight: unique("TP"), date: "2026-12-04" });
  const pending = await run.act("payments.charge", { customer: "cus_carol", amount_cents: 48000, currency: "EUR" })
    .then(() => assert.fail("the charge ran without approval"), (error) => error);
  assert.ok(pending instanceof ApprovalPending, String(pending));
  assert.match(pending.url, /\/approvals\/\d+\/$/);
  return { run, pending };
}

test("an approval approved by a person: wait() returns the tool's result", async () => {
  const { run, pending } = await chargeWaiting("Trip to Lisbon");
  await decide(pending.approvalId, true, "within budget");
  const charge = await pending.wait(30);
  assert.equal(charge.status, "captured");
  await run.complete();
  assert.equal((await settled(unwind, run.id)).status, "completed");
});

test("an approval rejected by a person: Rejected with their reason, and the run unwinds", async () => {
  const { run, pending } = await chargeWaiting("Trip to Porto");
  await decide(pending.approvalId, false, "over the travel budget");
  await assert.rejects(pending.wait(30), (error) => error instanceof Rejected && error.reason === "over the travel budget");
  assert.equal((await settled(unwind, run.id)).status, "compensated");
});

test("a replay by key: the same key and content return the recorded outcome; other content is refused", async () => {
  const email = `${unique("di")}@company.com`;
  const run = await unwind.run({ goal: "replay by key" });
  const key = unique("key");
  const first = await run.act("hr.create_user", { email, name: "Di" }, { idempotencyKey: key });
  const again = await run.act("hr.create_user", { name: "Di", email }, { idempotencyKey: key });
  assert.deepEqual(again, first);
  await assert.rejects(run.act("hr.create_user", { email, name: "Someone else" }, { idempotencyKey: key }),
    (error) => error instanceof IdempotencyMismatch && error.status === 422);
  const world = await sandbox("GET", "state");
  assert.equal(world.users.filter((u) => u.email === email).length, 1, "one user, however often it was asked");
  await run.complete();
});

test("a replay by content: the key is derived from the content exactly as the client computes it", async () => {
  const run = await unwind.run({ goal: "replay by content" });
  let ran = 0;
  const execute = async (args) => ({ id: `note-${++ran}`, text: args.text });
  // Keys in another order, text in another Unicode form, 2.0 for 2: the same content, the same key.
  const text = unique("Olá Zoë");
  const args = { text, meta: { ratio: 0.00001, big: 1e21, huge: 2 ** 60, n: 2, "é": "x", list: [0.1, -0, true, null] } };
  const variant = { meta: { list: [0.1, 0, true, null], n: 2.0, huge: 1152921504606847000, big: 1e21, ratio: 1e-5,
    "e\u0301": "x" }, text: text.normalize("NFD") };
  const first = await run.act("notes.write", args, { execute });
  const step = (await run.refresh()).data.actions.find((a) => a.tool === "notes.write");
  assert.equal(step.key_source, "derived");
  assert.equal(await run.derivedKey("notes.write", variant), step.idempotency_key, "the client's key is the server's");
  assert.deepEqual(await run.act("notes.write", variant, { execute }), first, "the same content replays");
  // The same key, sent by the client: a replay by key.
  const answer = await unwind.request("POST", `/api/v1/runs/${run.id}/actions`, { json: { tool: "notes.write", args: variant },
    headers: { "Idempotency-Key": await run.derivedKey("notes.write", variant) } });
  assert.equal(answer.status, 200);
  assert.equal(answer.headers.get("Unwind-Matched-By"), "key");
  assert.equal(ran, 1, "executed once");
  // A target taken from the args is part of the key.
  await run.act("crm.update_ticket", { ticket_id: "T-204", priority: "high" });
  const ticket = (await run.refresh()).data.actions.find((a) => a.tool === "crm.update_ticket");
  assert.equal(ticket.target.id, "T-204");
  assert.equal(await run.derivedKey("crm.update_ticket", { priority: "high", ticket_id: "T-204" }), ticket.idempotency_key);
  // key_fields: only `to` and `subject` identify the call.
  const to = `${unique("ed")}@example.com`;
  await run.act("email.send_keyed", { to, subject: "k", body: "one" });
  const keyed = (await run.refresh()).data.actions.find((a) => a.tool === "email.send_keyed");
  assert.equal(await run.derivedKey("email.send_keyed", { subject: "k", to, body: "another" }), keyed.idempotency_key);
  assert.equal((await sandbox("GET", `email/messages?to=${encodeURIComponent(to)}`)).results.length, 1, "sent once");
  await run.cancel("done testing");
  await settled(unwind, run.id);
});

test("a held step stopped by the agent: InFlight while held, then Rejected (stopped_by agent); never sent", async () => {
  const run = await unwind.run({ goal: "held" });
  const to = `${unique("fay")}@example.com`;
  const held = await run.act("email.send_held", { to, subject: "Later", body: "b" }, { timeout: 0 })
    .then(() => assert.fail("sent at once"), (error) => error);
  assert.ok(held instanceof InFlight, String(held));
  assert.equal((await unwind.action(held.actionId)).status, "held");
  await run.cancel("the user asked us not to send it");
  await assert.rejects(held.wait(20), (error) => error instanceof Rejected && error.stoppedBy === "agent");
  assert.equal((await sandbox("GET", `email/messages?to=${encodeURIComponent(to)}`)).results.length, 0);
});

test("OrderingViolation: a compensatable step after the pivot is refused, nothing done", async () => {
  const { run } = await chargeWaiting("Trip to Faro");
  await assert.rejects(run.act("travel.reserve_hotel", { guest: "Carol", hotel: unique("Hotel"), nights: 2 }),
    (error) => error instanceof OrderingViolation && error.status === 409 && /law order/.test(error.next));
  await run.cancel();
  assert.equal((await settled(unwind, run.id)).status, "compensated");
});

test("PolicyDenied: a rule of the tool's policy refuses the call and the run stays open", async () => {
  const run = await unwind.run({ goal: "a seat in dollars" });
  await assert.rejects(run.act("payments.capture", { customer: "cus_carol", amount_cents: 2500, currency: "USD" }),
    (error) => error instanceof PolicyDenied && error.status === 403 && error.reason.includes("EUR only"));
  assert.equal((await run.refresh()).status, "running");
  await run.complete();
});

test("ToolRefused: the tool turned the call down (4xx), nothing done, the run stays open", async () => {
  await sandbox("POST", "faults", { tool: "hr.create_user", mode: "status", status: 409, times: 1 });
  const run = await unwind.run({ goal: "refused" });
  try {
    await assert.rejects(run.act("hr.create_user", { email: `${unique("gus")}@company.com`, name: "Gus" }),
      (error) => error instanceof ToolRefused && error.status === 422);
  } finally {
    await sandbox("POST", "faults/clear", { tool: "hr.create_user" });
  }
  assert.equal((await run.refresh()).status, "running");
  await run.complete();
});

test("ValidationFailed, NotFound, RunNotActive, NotAllowed", async () => {
  const run = await unwind.run({ goal: "errors" });
  await assert.rejects(run.act("hr.create_user", { email: "x@company.com" }),
    (error) => error instanceof ValidationFailed && error.status === 400 && error.field.startsWith("args"));
  await assert.rejects(run.act("no.such_tool", {}), (error) => error instanceof ValidationFailed && error.code === "unknown_tool");
  const other = new Unwind(URL_, process.env.UNWIND_OTHER_AGENT_KEY);
  await assert.rejects(other.getRun(run.id), (error) => error instanceof NotFound && error.status === 404);
  await run.complete();
  await assert.rejects(run.act("hr.create_user", { email: `${unique("hal")}@company.com`, name: "Hal" }),
    (error) => error instanceof RunNotActive && error.status === 409);
  await assert.rejects(new Unwind(URL_, "uw_wrong_key").tools(), (error) => error instanceof NotAllowed && error.status === 401);
  await assert.rejects(unwind.putTool("hr.create_user", {}), (error) => error instanceof NotAllowed && error.code === "agents_cannot_govern");
});

test("ReportRequired, and a client-executed step run by `execute` and reported", async () => {
  const run = await unwind.run({ goal: "notes" });
  const pending = await run.act("notes.write", { text: "one" }).then(() => assert.fail("no report asked"), (e) => e);
  assert.ok(pending instanceof ReportRequired, String(pending));
  assert.deepEqual(pending.toolArgs, { text: "one" });
  const reported = await pending.report({ ok: true, result: { id: "n1" } });
  assert.equal(reported.status, "succeeded");
  let ran = 0;
  const result = await run.act("notes.write", { text: "two" }, { execute: async (args) => ({ id: `n-${args.text}`, n: ++ran }) });
  assert.deepEqual(result, { id: "n-two", n: 1 });
  await run.complete();
});

test("Unavailable after the retries; 503 and 429 are retried after their Retry-After", async () => {
  const closed = new Unwind("http://127.0.0.1:9", KEY, { retries: 2, backoff: 0.01 });
  await assert.rejects(closed.tools(), (error) => error instanceof Unavailable);
  const answers = [[503, { "Retry-After": "1" }], [429, { "Retry-After": "1" }], [200, {}]];
  const seen = [];
  const server = createServer((request, response) => {
    seen.push(Date.now());
    const [status, headers] = answers[Math.min(seen.length - 1, answers.length - 1)];
    response.writeHead(status, { "Content-Type": "application/json", ...headers });
    response.end(status === 200 ? "[]" : JSON.stringify({ code: "busy", detail: "busy" }));
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  try {
    const flaky = new Unwind(`http://127.0.0.1:${server.address().port}`, KEY, { backoff: 0.01 });
    assert.deepEqual(await flaky.tools(), []);
    assert.equal(seen.length, 3);
    assert.ok(seen[1] - seen[0] >= 900 && seen[2] - seen[1] >= 900, "each retry waited for its Retry-After");
    const impatient = new Unwind(`http://127.0.0.1:${server.address().port}`, KEY, { retries: 1 });
    answers.unshift([503, {}]); seen.length = 0;
    await assert.rejects(impatient.tools(), (error) => error instanceof Unavailable && /503/.test(error.message));
  } finally {
    server.close();
  }
});
