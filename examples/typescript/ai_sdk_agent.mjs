// A Vercel AI SDK agent whose every tool call goes through one Unwind run, driven by a stub model (no network, no
// API key): it onboards a new hire, then buys a trip whose charge waits for a person.
//   make demo                      # in one terminal
//   . var/demo.env && (cd examples/typescript && npm install && node ai_sdk_agent.mjs)
import { generateText, jsonSchema, stepCountIs } from "ai";
import { MockLanguageModelV3 } from "ai/test";
import { Unwind } from "@unwind/client";
import { AgentRun, serverTools, unwindTools } from "@unwind/client/ai-sdk";

const unwind = new Unwind(process.env.UNWIND_URL ?? "http://127.0.0.1:8000", process.env.UNWIND_AGENT_KEY ?? "");
const tag = Date.now().toString(36);

/** A model that follows a script: each step calls the next tool, fed by the last tool result it read. */
function scriptedModel(script) {
  let step = 0;
  return new MockLanguageModelV3({
    doGenerate: async ({ prompt }) => {
      const results = prompt.filter((m) => m.role === "tool").flatMap((m) => m.content);
      const last = results.at(-1)?.output?.value;
      const next = script[step++]?.(last);
      const usage = { inputTokens: { total: 1, noCache: 1, cacheRead: 0, cacheWrite: 0 },
        outputTokens: { total: 1, text: 1, reasoning: 0 } };
      if (!next || typeof next === "string") {
        return { content: [{ type: "text", text: next ?? `done: ${JSON.stringify(last)}` }],
          finishReason: { unified: "stop", raw: "stop" }, usage, warnings: [] };
      }
      return { content: [{ type: "tool-call", toolCallId: `call-${step}`, toolName: next.tool, input: JSON.stringify(next.args) }],
        finishReason: { unified: "tool-calls", raw: "tool_calls" }, usage, warnings: [] };
    },
  });
}

async function agent(goal, script) {
  const agentRun = new AgentRun(unwind, { goal, onBehalfOf: "carol@company.com" });
  const tools = unwindTools(agentRun, await serverTools(unwind, { jsonSchema }));
  const result = await agentRun.around(() => generateText({ model: scriptedModel(script), tools, prompt: goal, stopWhen: stepCountIs(6) }));
  const run = await (await agentRun.run).refresh();
  console.log(`${goal}\n  run ${run.id}: ${run.status}`);
  for (const step of result.steps) for (const out of step.toolResults) console.log(`  ${out.toolName} -> ${JSON.stringify(out.output)}`);
  console.log(`  model: ${result.text}`);
  return run;
}

const onboarded = await agent("Onboard Ana Lima", [
  () => ({ tool: "hr_create_user", args: { email: `ana-${tag}@company.com`, name: "Ana Lima" } }),
  (user) => ({ tool: "licenses_provision", args: { user_id: user.id, sku: "workspace-standard" } }),
  (license) => `Ana is onboarded; her license is ${license.status}.`,
]);
const trip = await agent("Book Carol's trip to Lisbon", [
  () => ({ tool: "travel_book_flight", args: { passenger: "Carol", flight: `TP${tag}`, date: "2026-12-04" } }),
  () => ({ tool: "payments_charge", args: { customer: "cus_carol", amount_cents: 48000, currency: "EUR" } }),
  (answer) => `The charge waits for a person: ${answer.message}`,
]);
if (onboarded.status !== "completed" || trip.status !== "awaiting_approval") process.exit(1);
