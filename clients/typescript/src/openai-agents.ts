/**
 * Unwind for the OpenAI Agents SDK for JavaScript (`@openai/agents`): every function-tool call goes through one
 * Unwind run per agent run (mirrors `unwind_client/openai_agents.py`). No dependency on the SDK: its `tool` and
 * `run` are handed in.
 *
 *     import { Agent, run, tool } from "@openai/agents";
 *     import { Unwind } from "@unwind/client";
 *     import { functionTools, runAgent, toolSpecs } from "@unwind/client/openai-agents";
 *
 *     const agent = new Agent({ name: "onboarder", instructions: "…", tools: functionTools(await toolSpecs(unwind), { tool }) });
 *     const { result, agentRun } = await runAgent(run, agent, "Onboard Ashu", { unwind, onBehalfOf: "carol@company.com" });
 *
 * The run opens on the agent's first tool call, with the agent's input as its goal; `runAgent` completes it when the
 * agent finishes and cancels it (Unwind undoes its steps) when `run` throws. A call waiting for a person, a
 * rejection, a refusal and a failed step come back to the model as tool outputs (JSON with `status` and `message`).
 */
import type { Unwind } from "./client.js";
import { UnwindClientError } from "./errors.js";
import { AgentRun, type AgentRunOptions, type ToolFunction, type ToolSpec } from "./agent-run.js";

export { AgentRun, modelName, toolSpecs, type ToolAnswer, type ToolSpec } from "./agent-run.js";

/** The SDK's `tool()` helper, as far as the adapter uses it. */
export type ToolHelper<T> = (options: {
  name: string;
  description: string;
  parameters: any;
  strict: boolean;
  execute: (input: any, runContext?: { context?: unknown }) => Promise<string>;
}) => T;

/** The AgentRun a run context carries: the context itself, or its `unwindRun` property. */
export function agentRunOf(context: unknown): AgentRun | undefined {
  if (context instanceof AgentRun) return context;
  const found = (context as { unwindRun?: unknown } | undefined)?.unwindRun;
  return found instanceof AgentRun ? found : undefined;
}

/**
 * The SDK's function tools for these Unwind tools. Each call goes through `run`, or (by default) through the
 * AgentRun given to the SDK's `run` as its `context` (or found as `context.unwindRun`). `functions` are the bodies of
 * client-executed tools (and of the compensations Unwind may ask for), by Unwind tool name.
 */
export function functionTools<T>(specs: ToolSpec[], options: { tool: ToolHelper<T>; run?: AgentRun;
  functions?: Record<string, ToolFunction> }): T[] {
  return specs.map((spec) => options.tool({
    name: spec.modelName,
    description: spec.description || spec.name,
    parameters: spec.parameters,
    strict: false, // Unwind's schemas may use what strict mode refuses (formats, patterns)
    execute: async (input, runContext) => {
      const agentRun = options.run ?? agentRunOf(runContext?.context);
      if (!agentRun) {
        throw new UnwindClientError(`${spec.modelName}: no Unwind run; pass { context: new AgentRun(...) } to run(), ` +
          "or use runAgent");
      }
      for (const [name, fn] of Object.entries(options.functions ?? {})) agentRun.register(name, fn);
      let args = input;
      if (typeof input === "string") {
        try { args = JSON.parse(input || "{}"); } catch {
          return JSON.stringify({ status: "refused", code: "invalid_json", message: "refused: the arguments are not JSON; send a JSON object" });
        }
      }
      if (!args || typeof args !== "object" || Array.isArray(args)) {
        return JSON.stringify({ status: "refused", code: "invalid_json", message: "refused: the arguments must be a JSON object" });
      }
      return (await agentRun.call(spec.name, args as Record<string, unknown>, options.functions?.[spec.name])).text;
    },
  }));
}

/**
 * Run the agent with one Unwind run: completed when the agent finishes, cancelled and unwound if it throws. `run` is
 * the SDK's `run`. Returns `{ result, agentRun }` (`await agentRun.run` is undefined when no tool was called).
 */
export async function runAgent<A, R>(run: (agent: A, input: any, options?: any) => Promise<R>, agent: A, input: string | unknown[],
  options: AgentRunOptions & { unwind: Unwind; runOptions?: Record<string, unknown> }): Promise<{ result: R; agentRun: AgentRun }> {
  const { unwind, runOptions, ...rest } = options;
  const agentRun = new AgentRun(unwind, { ...rest, goal: rest.goal || (typeof input === "string" ? input : "") });
  const result = await agentRun.around(() => run(agent, input, { ...runOptions, context: agentRun }));
  return { result, agentRun };
}
