/**
 * Unwind for the Vercel AI SDK (`ai`): every tool call of `generateText`/`streamText` is proposed through one
 * Unwind run per agent run. No dependency on `ai`: its tools are plain objects, and `jsonSchema` is handed in.
 *
 *     import { generateText, jsonSchema, stepCountIs } from "ai";
 *     import { Unwind } from "@unwind/client";
 *     import { AgentRun, serverTools, unwindTools } from "@unwind/client/ai-sdk";
 *
 *     const agentRun = new AgentRun(unwind, { goal: "Onboard Ashu", onBehalfOf: "carol@company.com" });
 *     const tools = unwindTools(agentRun, await serverTools(unwind, { jsonSchema }));
 *     await agentRun.around(() => generateText({ model, tools, prompt: "Onboard Ashu", stopWhen: stepCountIs(5) }));
 *
 * A call waiting for a person, a rejection, a refusal and a failed step come back to the model as the tool's result
 * (`{status, message, …}`: see `AgentRun.call`); only a wrong key or Unwind being down throw.
 */
import type { Unwind } from "./client.js";
import { AgentRun, toolSpecs } from "./agent-run.js";

export { AgentRun, modelName, toolSpecs, type ToolAnswer, type ToolSpec } from "./agent-run.js";

/** An AI SDK tool as far as the adapter needs it (structural: the SDK's `Tool` fits). */
export interface AiTool {
  description?: string;
  inputSchema?: unknown;
  execute?: (input: any, options: any) => unknown;
  /** The Unwind tool this tool calls (set by `serverTools`; else the record's key, or `names`). */
  unwindTool?: string;
  [other: string]: unknown;
}

/**
 * The tools record with every call proposed through `agentRun`. A tool Unwind executes (HTTP, Python, MCP) is run
 * by Unwind, not by its `execute`; a client-executed one (`executor: client`) runs its own `execute`, reported to
 * Unwind, which also calls these functions back when a compensation names them. `names` maps a record key to an
 * Unwind tool name where they differ (`{ createUser: "hr.create_user" }`).
 */
export function unwindTools<T extends Record<string, AiTool>>(agentRun: AgentRun, tools: T,
  options: { names?: Record<string, string> } = {}): T {
  const wrapped: Record<string, AiTool> = {};
  for (const [key, tool] of Object.entries(tools)) {
    const name = tool.unwindTool ?? options.names?.[key] ?? key;
    let lastOptions: unknown;
    const own = tool.execute ? (args: unknown) => tool.execute!(args, lastOptions) : undefined;
    if (own) agentRun.register(name, own);
    wrapped[key] = {
      ...tool,
      execute: async (input: unknown, callOptions: unknown) => {
        lastOptions = callOptions;
        if (!input || typeof input !== "object" || Array.isArray(input)) {
          return { status: "refused", code: "invalid_json", message: "refused: the arguments must be a JSON object" };
        }
        return (await agentRun.call(name, input as Record<string, unknown>, own)).data;
      },
    };
  }
  return wrapped as T;
}

/** The tenant's tools as Unwind lists them (optionally only `names`), as AI SDK tools keyed by their model names. */
export async function serverTools(unwind: Unwind, options: { jsonSchema: (schema: any) => unknown; names?: string[] }): Promise<Record<string, AiTool>> {
  const specs = await toolSpecs(unwind, options.names);
  return Object.fromEntries(specs.map((spec) => [spec.modelName, {
    description: spec.description, inputSchema: options.jsonSchema(spec.parameters), unwindTool: spec.name,
  }]));
}
