/**
 * What the framework adapters share (mirrors `unwind_client/adapters.py`): one Unwind run per agent run, and each
 * tool call's outcome in words a model understands. Needs neither framework.
 */
import { FINISHED, Run, Unwind, type RunOptions } from "./client.js";
import {
  ApprovalPending, InFlight, NotAllowed, Refused, Rejected, ReportRequired, UnwindClientError, Unwound,
} from "./errors.js";
import type { Action, Intent } from "./types.js";

const SETTLED_RUN = new Set([...FINISHED, "needs_attention"]);
const ENDED_BY = new Set(["failed", "lost"]); // a step in these states ended its run (failed, or its outcome is unknown)

/** The name a model sees: letters, digits, `_` and `-` only (`hr.create_user` → `hr_create_user`). */
export function modelName(toolName: string): string {
  return toolName.replace(/[^a-zA-Z0-9_-]/g, "_").slice(0, 64);
}

export type AnswerKind = "ok" | "pending_approval" | "in_progress" | "rejected" | "refused" | "failed" | "run_over";

/** What a tool call answers the model: `data` (the result, or `{status, message, …}`), its JSON `text`, its kind. */
export interface ToolAnswer {
  kind: AnswerKind;
  error: boolean;
  data: unknown;
  text: string;
}

/** A tool as Unwind lists it, for a model: the adapters turn these into their framework's tools. */
export interface ToolSpec {
  name: string;
  modelName: string;
  description: string;
  parameters: Record<string, unknown>;
  clientExecuted: boolean;
}

/** The tenant's tools as Unwind lists them (optionally only `names`). */
export async function toolSpecs(unwind: Unwind, names?: string[]): Promise<ToolSpec[]> {
  const wanted = names ? new Set(names) : undefined;
  const listed = (await unwind.tools()).filter((tool) => !wanted || wanted.has(tool.name));
  const missing = names?.filter((name) => !listed.some((tool) => tool.name === name)) ?? [];
  if (missing.length) throw new UnwindClientError(`Unwind has no tool named ${missing.sort().join(", ")} for this agent`);
  return listed.map((tool) => {
    const policy = (tool.policy ?? {}) as Record<string, any>;
    let description: string = policy.description || tool.name;
    if (policy.approval === "manual" || ["high", "critical"].includes(policy.risk)) {
      description += " A call may wait for a person's approval.";
    }
    const executor = policy.executor;
    const kind = typeof executor === "object" && executor ? executor.kind : executor;
    return { name: tool.name, modelName: modelName(tool.name), description,
      parameters: policy.args_schema || { type: "object" }, clientExecuted: kind === "client" };
  });
}

export type ToolFunction = (args: any) => unknown | Promise<unknown>;

export interface AgentRunOptions extends RunOptions {
  /** Seconds a call waits for its step to settle before answering the model "pending" (default 30). */
  wait?: number;
  /** Attach to an open run (the next agent run after a person decided, say). */
  runId?: number;
}

/**
 * One Unwind run for one agent run: opened on the first tool call, completed by `commit()`, cancelled (unwound) by
 * `rollback()`. Functions of client-executed tools (`register`) run when the model calls them, and compensations of
 * such tools run when Unwind asks for them (`compensate`), newest first.
 */
export class AgentRun {
  over = ""; // why the run can take no more steps, once it cannot
  private current: Promise<Run> | undefined;
  private readonly functions = new Map<string, ToolFunction>();
  private executors: Promise<Map<string, boolean>> | undefined;

  constructor(readonly unwind: Unwind, readonly options: AgentRunOptions = {}) {
    if (options.runId !== undefined) this.current = unwind.getRun(options.runId);
  }

  /** The run, opened now if no call opened it yet (with the agent's goal). */
  open(): Promise<Run> {
    this.current ??= this.unwind.run(this.options);
    return this.current;
  }

  /** The Unwind run, once a call opened it. */
  get run(): Promise<Run | undefined> {
    return this.current ?? Promise.resolve(undefined);
  }

  /** Know the function that runs a client-executed tool (or a compensation Unwind may ask this agent to run). */
  register(tool: string, fn: ToolFunction): void {
    if (!this.functions.has(tool)) this.functions.set(tool, fn);
  }

  private async clientExecuted(tool: string): Promise<boolean> {
    this.executors ??= toolSpecs(this.unwind).then((specs) => new Map(specs.map((s) => [s.name, s.clientExecuted])));
    return (await this.executors).get(tool) ?? false;
  }

  /** Put one call through the run and say what became of it, as the model should read it. */
  async call(tool: string, args: Record<string, unknown>, fn?: ToolFunction): Promise<ToolAnswer> {
    if (fn) this.register(tool, fn);
    if (this.over) {
      return answer("run_over", true, { message: `not done: ${this.over} Do not call more tools for this task; tell the user what happened.` });
    }
    const run = await this.open();
    const execute = (await this.clientExecuted(tool)) ? this.functions.get(tool) : undefined;
    let result: unknown;
    try {
      result = await run.act(tool, args, { intent: this.options.intent as Intent | undefined, execute, timeout: this.options.wait ?? 30 });
    } catch (error) {
      if (error instanceof ApprovalPending) {
        return answer("pending_approval", false, { approval_url: error.url, action_id: error.actionId,
          message: `pending approval at ${error.url}: a person must approve this ${tool} call. Call ${modelName(tool)} ` +
            "again later with the same arguments to get its result." });
      }
      if (error instanceof InFlight) {
        return answer("in_progress", false, { action_id: error.actionId,
          message: `${tool} is still running; call ${modelName(tool)} again later with the same arguments to get its result.` });
      }
      if (error instanceof Rejected) return this.rejected(error.action);
      if (error instanceof Unwound) {
        if (ENDED_BY.has(error.action.status)) return this.failed(error.action);
        return this.runEnded(error.message); // an earlier step replayed, since undone: say what ended the run
      }
      if (error instanceof ReportRequired || error instanceof NotAllowed) throw error; // wiring, not the model's
      if (error instanceof Refused) return this.refusal(error);
      throw error;
    }
    return { kind: "ok", error: false, data: result, text: typeof result === "string" ? result : JSON.stringify(result) };
  }

  private async rejected(action: Action): Promise<ToolAnswer> {
    const reason = action.decision_reason || "no reason given";
    await this.ended(action, `a person rejected ${action.tool}: ${reason}; Unwind undoes the run's steps.`);
    return answer("rejected", false, { reason: action.decision_reason, tool: action.tool, run_status: action.run_status,
      message: `rejected: ${reason}. A person turned down ${action.tool} and Unwind is undoing this task's earlier ` +
        "steps; do not retry it, tell the user." });
  }

  private async failed(action: Action): Promise<ToolAnswer> {
    const why = action.error?.message || action.status;
    await this.ended(action, `${action.tool} failed (${why}) and Unwind undid the run's earlier steps.`);
    return answer("failed", true, { tool: action.tool, error_message: action.error?.message,
      error_class: action.error?.error_class, run_status: action.run_status,
      message: `error: ${action.tool} failed (${why}); Unwind is undoing this task's earlier steps (run ` +
        `${action.run_status}). The task cannot go on; tell the user.` });
  }

  private async runEnded(detail: string): Promise<ToolAnswer> {
    const run = await (await this.open()).refresh();
    for (const action of [...(run.data.actions ?? [])].reverse()) {
      if (action.kind === "forward" && ["rejected", "expired"].includes(action.status)) {
        return this.rejected({ ...action, run_status: run.data.status });
      }
      if (action.kind === "forward" && ENDED_BY.has(action.status)) return this.failed({ ...action, run_status: run.data.status });
    }
    this.over = `the run is ${run.status.replace(/_/g, " ")}: ${detail}`;
    return answer("run_over", true, { run_status: run.status,
      message: `not done: ${this.over} Do not call more tools for this task; tell the user.` });
  }

  private async refusal(refused: Refused): Promise<ToolAnswer> {
    if (refused.code === "run_not_active" || refused.code === "run_cancelled" || refused.code === "run_archived") {
      return this.runEnded(refused.detail);
    }
    if (refused.code === "tool_refused" || refused.code === "policy_denied") {
      const reason = (refused.problem.reason as string) || refused.detail;
      return answer("refused", false, { code: refused.code, reason, message: `refused: ${reason}; ${refused.next}` });
    }
    return answer("refused", false, { code: refused.code, field: refused.field,
      message: `refused (${refused.code}): ${refused.detail}; ${refused.next}` });
  }

  private async ended(action: Action, why: string): Promise<void> {
    this.over = why;
    if (action.run_status === "unwinding") await this.compensate();
  }

  /**
   * Run the compensations of client-executed steps Unwind asks this agent for, newest first; return how many. Unwind
   * plans them one at a time, so this loops until none waits. One whose function is unknown here is left for a person.
   */
  async compensate(): Promise<number> {
    const run = await this.run;
    if (!run) return 0;
    let done = 0;
    const failed = new Set<number>();
    for (;;) {
      const [compensation] = await this.unwind.pendingCompensations({ run: run.id });
      if (!compensation || failed.has(compensation.id)) return done;
      const undo = this.functions.get(compensation.tool);
      if (!undo) {
        console.warn(`run ${run.id}: no function for compensation ${compensation.id} (${compensation.tool})`);
        return done;
      }
      try {
        await this.unwind.report(compensation.id, { ok: true, result: await undo(compensation.args) });
      } catch (error) {
        if (error instanceof UnwindClientError) throw error;
        failed.add(compensation.id);
        await this.unwind.report(compensation.id, { ok: false, error: String(error).slice(0, 4000) });
      }
      done++;
    }
  }

  /**
   * Complete the run. Nothing to do if no call opened it or a failure already ended it; a run with a step waiting
   * for a person stays open (the agent calls that tool again once it is decided, in `new AgentRun(unwind, {runId})`).
   */
  async commit(): Promise<Run | undefined> {
    const current = await this.run;
    if (!current) return undefined;
    const run = await current.refresh();
    if (this.over || SETTLED_RUN.has(run.status) || run.status === "awaiting_approval") return run;
    return run.complete();
  }

  /** Cancel the run: Unwind undoes its steps, newest first (client-executed ones through `compensate`). */
  async rollback(reason = ""): Promise<Run | undefined> {
    const run = await this.run;
    if (!run) return undefined;
    if (!this.over && !SETTLED_RUN.has((await run.refresh()).status)) await run.cancel(reason.slice(0, 1000));
    this.over ||= `the run was rolled back${reason ? ": " + reason : ""}.`;
    await this.compensate();
    return run.refresh();
  }

  /** Run `body`; commit when it returns, roll back (and rethrow) when it throws. */
  async around<T>(body: () => Promise<T>): Promise<T> {
    let value: T;
    try {
      value = await body();
    } catch (error) {
      try {
        await this.rollback(error instanceof Error ? `${error.name}: ${error.message}` : String(error));
      } catch (failed) {
        console.warn(`rollback after ${String(error)} failed: ${String(failed)}`);
      }
      throw error;
    }
    await this.commit();
    return value;
  }
}

function answer(kind: AnswerKind, error: boolean, fields: Record<string, unknown>): ToolAnswer {
  const data: Record<string, unknown> = { status: kind };
  for (const [key, value] of Object.entries(fields)) {
    if (key !== "message" && value !== undefined && value !== null && value !== "") data[key] = value;
  }
  data.message = fields.message;
  return { kind, error, data, text: JSON.stringify(data) };
}
