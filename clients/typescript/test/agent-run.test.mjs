// The adapters' shared core (AgentRun) on the live server: what the model reads for each outcome, and the
// compensations of client-executed tools run by the agent when Unwind asks for them.
import { test } from "node:test";
import assert from "node:assert/strict";
import { AgentRun } from "../dist/agent-run.js";
import { unwindTools } from "../dist/ai-sdk.js";
import { functionTools, toolSpecs } from "../dist/openai-agents.js";
import { client, decide, settled, unique } from "./helpers.mjs";

const unwind = client();

test("a policy refusal, an ordering refusal and a rejection come back to the model as tool results", async () => {
  const agentRun = new AgentRun(unwind, { goal: "the model reads refusals" });
  const denied = await agentRun.call("payments.capture", { customer: "cus_carol", amount_cents: 2500, currency: "USD" });
  assert.equal(denied.kind, "refused");
  assert.equal(denied.data.code, "policy_denied");
  assert.match(denied.data.message, /^refused: extras are charged in EUR only/);
  await agentRun.call("travel.book_flight", { passenger: "Carol", flight: unique("TP"), date: "2026-12-04" });
  const pending = await agentRun.call("payments.charge", { customer: "cus_carol", amount_cents: 48000, currency: "EUR" });
  assert.equal(pending.kind, "pending_approval");
  const order = await agentRun.call("travel.reserve_hotel", { guest: "Carol", hotel: unique("Hotel"), nights: 2 });
  assert.equal(order.kind, "refused");
  assert.equal(order.data.code, "ordering_violation");
  const action = await unwind.action(pending.data.action_id);
  await decide(action.approval.id, false, "not this month");
  const again = await agentRun.call("payments.charge", { customer: "cus_carol", amount_cents: 48000, currency: "EUR" });
  assert.equal(again.kind, "rejected");
  assert.match(again.data.message, /^rejected: not this month\. .*do not retry it/);
  const after = await agentRun.call("travel.book_flight", { passenger: "Carol", flight: unique("TP"), date: "2026-12-05" });
  assert.equal(after.kind, "run_over");
  assert.equal((await settled(unwind, (await agentRun.run).id)).status, "compensated");
});

test("client-executed tools: the AI SDK tool's own execute runs, and its compensation runs on rollback", async () => {
  const agentRun = new AgentRun(unwind, { goal: "notes" });
  const written = [], erased = [];
  const tools = unwindTools(agentRun, {
    write: { description: "Write a note", execute: async ({ text }) => { written.push(text); return { id: `n-${text}` }; } },
    erase: { description: "Erase a note", execute: async ({ note_id }) => { erased.push(note_id); return { erased: note_id }; } },
  }, { names: { write: "notes.write", erase: "notes.erase" } });
  const text = unique("hello");
  assert.deepEqual(await tools.write.execute({ text }, {}), { id: `n-${text}` });
  assert.deepEqual(await tools.write.execute({ text }, {}), { id: `n-${text}` }, "the same call again is the same step");
  assert.deepEqual(written, [text], "executed once");
  const run = await agentRun.rollback("the user changed their mind");
  assert.deepEqual(erased, [`n-${text}`], "the compensation ran, with the args Unwind resolved");
  assert.equal((await settled(unwind, run.id)).status, "compensated");
});

test("the Agents SDK tools: one per Unwind tool, named for the model, proposing through the run", async () => {
  const specs = await toolSpecs(unwind, ["hr.create_user", "payments.charge"]);
  const made = functionTools(specs, { tool: (options) => options });
  assert.deepEqual(made.map((t) => t.name), ["hr_create_user", "payments_charge"]);
  assert.match(made[1].description, /may wait for a person's approval/);
  const agentRun = new AgentRun(unwind, { goal: "agents sdk tool" });
  const out = JSON.parse(await made[0].execute({ email: `${unique("ivy")}@company.com`, name: "Ivy" }, { context: agentRun }));
  assert.equal(out.name, "Ivy");
  const bad = JSON.parse(await made[0].execute("not json", { context: agentRun }));
  assert.equal(bad.code, "invalid_json");
  assert.equal((await agentRun.commit()).status, "completed");
  await assert.rejects(made[0].execute({}, { context: {} }), /no Unwind run/);
});
