// An OpenAI Agents SDK (JavaScript) agent whose every function-tool call goes through one Unwind run, driven by a
// stub Model (no network, no API key): it onboards a new hire; a second agent's welcome email fails and Unwind undoes
// the first steps, which the model reads as a tool output.
//   make demo                      # in one terminal
//   . var/demo.env && (cd examples/typescript && npm install && node openai_agents_agent.mjs)
import { Agent, Usage, run, setTracingDisabled, tool } from "@openai/agents";
import { Unwind } from "@unwind/client";
import { functionTools, runAgent, toolSpecs } from "@unwind/client/openai-agents";

setTracingDisabled(true);
const unwind = new Unwind(process.env.UNWIND_URL ?? "http://127.0.0.1:8000", process.env.UNWIND_AGENT_KEY ?? "");
const tag = Date.now().toString(36);

/** A Model that follows a script: each turn calls the next tool, fed by the last tool output it read. */
class ScriptedModel {
  constructor(script) { this.script = script; this.step = 0; }
  async getResponse(request) {
    const items = Array.isArray(request.input) ? request.input : [];
    const output = items.filter((i) => i.type === "function_call_result").at(-1)?.output;
    const text = typeof output === "string" ? output : output?.text;
    const last = text ? JSON.parse(text) : undefined;
    const next = this.script[this.step++]?.(last);
    if (!next || typeof next === "string") {
      return { usage: new Usage(), responseId: `r${this.step}`, output: [{ type: "message", role: "assistant",
        status: "completed", content: [{ type: "output_text", text: next ?? JSON.stringify(last) }] }] };
    }
    return { usage: new Usage(), responseId: `r${this.step}`, output: [{ type: "function_call", callId: `c${this.step}`,
      name: next.tool, arguments: JSON.stringify(next.args), status: "completed" }] };
  }
  async *getStreamedResponse() { throw new Error("the stub model does not stream"); }
}

const tools = functionTools(await toolSpecs(unwind), { tool });

async function agent(goal, script) {
  const onboarder = new Agent({ name: "onboarder", instructions: "Use the tools.", model: new ScriptedModel(script), tools });
  const { result, agentRun } = await runAgent(run, onboarder, goal, { unwind, onBehalfOf: "hr@company.com" });
  const unwindRun = await agentRun.run;
  let status = (await unwindRun.refresh()).status;
  for (let i = 0; i < 100 && status === "unwinding"; i++) {
    await new Promise((r) => setTimeout(r, 100));
    status = (await unwindRun.refresh()).status;
  }
  console.log(`${goal}\n  run ${unwindRun.id}: ${status}\n  model: ${result.finalOutput}`);
  return status;
}

const email = `ana-${tag}@company.com`;
const done = await agent("Onboard Ana Lima", [
  () => ({ tool: "hr_create_user", args: { email, name: "Ana Lima" } }),
  (user) => ({ tool: "licenses_provision", args: { user_id: user.id, sku: "workspace-standard" } }),
  (license) => `Ana is onboarded; her license is ${license.status}.`,
]);
// The welcome email is refused by the relay (on_refusal: unwind): the step fails and Unwind undoes the account.
const undone = await agent("Onboard Bo and welcome him", [
  () => ({ tool: "hr_create_user", args: { email: `bo-${tag}@company.com`, name: "Bo" } }),
  () => ({ tool: "email_send", args: { to: `bo-${tag}@company.com`, subject: "Welcome", body: "Hi", cc: "not a field" } }),
  (answer) => `I could not finish: ${answer.message}`,
]);
if (done !== "completed" || undone !== "compensated") process.exit(1);
