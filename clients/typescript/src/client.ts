/**
 * The Unwind client: every state-changing tool call of an agent goes through `Run.act`.
 *
 *     const unwind = new Unwind("http://127.0.0.1:8000", process.env.UNWIND_AGENT_KEY!);
 *     await unwind.withRun({ goal: "Onboard Ashu", onBehalfOf: "carol@company.com" }, async (run) => {
 *       const user = await run.act("hr.create_user", { email: "ashu@company.com", name: "Ashu Kumar" });
 *       await run.act("licenses.provision", { user_id: user.id });
 *     });
 *
 * `withRun` completes the run when the callback returns and cancels it (Unwind undoes what was done) when it
 * throws. Lost answers and 502/503/504/429 are retried with the same idempotency key, so a retried call never acts
 * twice: without an explicit `idempotencyKey`, Unwind derives the key from the call's content (`deriveKey` computes
 * the same key here). Mirrors the Python client (`unwind_client/client.py`).
 */
import { deriveKey, type KeyPolicy } from "./canonical.js";
import {
  ActionError, ApprovalPending, InFlight, Refused, Rejected, ReportRequired, Unavailable, UnwindClientError,
  Unwound, refusalFor, type Outcome,
} from "./errors.js";
import type { Action, Intent, PendingCompensation, Problem, RunData, Tool, Trail } from "./types.js";

const RETRY_STATUSES = new Set([502, 503, 504]);
const MAX_LONG_POLL = 30;
const PENDING = new Set(["planned", "approved", "running", "retry_scheduled", "held"]);
const REFUSED_BY_PERSON = new Set(["rejected", "expired"]);
export const FINISHED = new Set(["completed", "compensated", "closed"]);

export interface UnwindOptions {
  /** Seconds a request may take (default 30). */
  timeout?: number;
  /** Tries per request (default 4). */
  retries?: number;
  /** Seconds of the first pause between tries, doubled each time (default 0.25). */
  backoff?: number;
  /** Headers sent with every request (a `traceparent`, say). */
  headers?: Record<string, string>;
  /** Another fetch (default: the platform's). */
  fetch?: typeof fetch;
  /** The tenant's id, only for `Run.derivedKey` (the API does not report it to agents). */
  tenantId?: number;
}

export interface RequestOptions {
  json?: unknown;
  params?: Record<string, string | number | undefined>;
  headers?: Record<string, string>;
  /** Reads and writes Unwind deduplicates: retried after lost answers and 502/503/504 (default true). */
  idempotent?: boolean;
  /** Seconds. */
  timeout?: number;
}

export interface Answer<T = any> {
  status: number;
  headers: Headers;
  body: T;
}

export interface RunOptions {
  goal?: string;
  onBehalfOf?: string;
  /** Tool names, checked against the ordering law before the run opens. */
  plan?: string[];
  intent?: Intent;
}

export interface ActOptions {
  intent?: Intent;
  target?: string;
  idempotencyKey?: string;
  /** For a client-executed tool: runs it with the args as given, its outcome is reported. */
  execute?: (args: any) => unknown | Promise<unknown>;
  /** Seconds to wait for a pending step (default 300; null waits as long as it takes). */
  timeout?: number | null;
  /** Do an earlier step of the run (its id) again on purpose. */
  repeatOf?: number;
}

const sleep = (seconds: number) => new Promise((resolve) => setTimeout(resolve, seconds * 1000));

/** A connection to an Unwind server with one agent's API key (or, for `putTool`/`loadPolicy`, a deploy key). */
export class Unwind {
  readonly baseUrl: string;
  readonly timeout: number;
  readonly retries: number;
  readonly backoff: number;
  readonly tenantId: number | undefined;
  private readonly headers: Record<string, string>;
  private readonly fetcher: typeof fetch;
  private toolPolicies: Map<string, KeyPolicy> | undefined;

  constructor(baseUrl: string, apiKey: string, options: UnwindOptions = {}) {
    this.baseUrl = baseUrl.replace(/\/+$/, "");
    this.timeout = options.timeout ?? 30;
    this.retries = Math.max(1, options.retries ?? 4);
    this.backoff = options.backoff ?? 0.25;
    this.tenantId = options.tenantId;
    this.fetcher = options.fetch ?? globalThis.fetch.bind(globalThis);
    this.headers = { Accept: "application/json", "User-Agent": "unwind-client-ts/1", ...options.headers,
      Authorization: `Bearer ${apiKey}` };
  }

  // --- transport ------------------------------------------------------------------------------

  /** Send a request, retrying what is safe to retry; throw a Refused (by code) for a problem answer. */
  async request<T = any>(method: string, path: string, options: RequestOptions = {}): Promise<Answer<T>> {
    const url = new URL(/^https?:\/\//.test(path) ? path : this.baseUrl + path);
    for (const [name, value] of Object.entries(options.params ?? {})) {
      if (value !== undefined) url.searchParams.set(name, String(value));
    }
    const headers: Record<string, string> = { ...this.headers, ...options.headers };
    let body: string | undefined;
    if (options.json !== undefined) {
      body = JSON.stringify(options.json);
      headers["Content-Type"] = "application/json";
    }
    const idempotent = options.idempotent ?? true;
    for (let attempt = 1; attempt <= this.retries; attempt++) {
      const last = attempt === this.retries;
      let response: Response;
      try {
        response = await this.fetcher(url, { method, headers, body,
          signal: AbortSignal.timeout((options.timeout ?? this.timeout) * 1000) });
      } catch (error) {
        if (last || !(idempotent || notSent(error))) {
          throw new Unavailable(`${method} ${url}: ${describe(error)}`);
        }
        await this.pause(attempt);
        continue;
      }
      const retryable = response.status === 429 || (idempotent && RETRY_STATUSES.has(response.status));
      if (retryable && !last) {
        await response.body?.cancel();
        await this.pause(attempt, response.headers.get("Retry-After"));
        continue;
      }
      if (RETRY_STATUSES.has(response.status)) {
        await response.body?.cancel();
        throw new Unavailable(`${method} ${url}: HTTP ${response.status}`);
      }
      const text = await response.text();
      if (response.status >= 400) throw this.refusal(response, text);
      return { status: response.status, headers: response.headers, body: text ? JSON.parse(text) : null };
    }
    throw new Unavailable(`${method} ${url}: no answer`); // the loop always returns or throws before this
  }

  private async pause(attempt: number, retryAfter?: string | null): Promise<void> {
    let delay = this.backoff * 2 ** (attempt - 1) * (0.5 + Math.random() / 2);
    if (retryAfter && /^\d+$/.test(retryAfter)) delay = Math.max(delay, Math.min(Number(retryAfter), 30));
    await sleep(delay);
  }

  private refusal(response: Response, text: string): Refused {
    let problem: Problem = {};
    try {
      const parsed = JSON.parse(text);
      if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) problem = parsed;
    } catch { /* not JSON: the status says it */ }
    const code = (problem.code as string) || `http_${response.status}`;
    const message = (problem.detail as string) || text.slice(0, 300) || response.statusText;
    if (code === "in_flight") {
      const actionId = problem.action_id as number;
      return new InFlight(code, message, response.status, problem,
        async (timeout) => this.settle(await this.action(actionId), { timeout }));
    }
    return refusalFor(code, message, response.status, problem);
  }

  // --- runs ----------------------------------------------------------------------------------

  /** Open a run (a declared `plan` of tool names is checked against the ordering law first). */
  async run(options: RunOptions = {}): Promise<Run> {
    const body: Record<string, unknown> = { goal: options.goal ?? "", on_behalf_of: options.onBehalfOf ?? "" };
    if (options.plan !== undefined) body.plan = options.plan;
    if (options.intent !== undefined) body.intent = options.intent;
    // One key per run() call, reused on our own retries: a retry after a lost answer gets the same run.
    const headers = { "Idempotency-Key": `run-${globalThis.crypto?.randomUUID?.() ?? randomId()}` };
    return new Run(this, (await this.request("POST", "/api/v1/runs", { json: body, headers })).body);
  }

  /** Open a run, call `body` with it, complete the run when it returns and cancel it (unwind) when it throws. */
  async withRun<T>(options: RunOptions, body: (run: Run) => Promise<T>): Promise<T> {
    const run = await this.run(options);
    let value: T;
    try {
      value = await body(run);
    } catch (error) {
      await run.cancelAfter(error);
      throw error;
    }
    await run.complete();
    return value;
  }

  /** Attach to an existing run, e.g. after a restart. */
  async getRun(runId: number): Promise<Run> {
    return new Run(this, (await this.request("GET", `/api/v1/runs/${runId}`)).body);
  }

  // --- actions -------------------------------------------------------------------------------

  async action(actionId: number): Promise<Action> {
    return (await this.request("GET", `/api/v1/actions/${actionId}`)).body;
  }

  /** Long-poll until the action settles or `timeout` seconds pass (null: as long as it takes). */
  async waitFor(actionId: number, timeout: number | null = null): Promise<Action> {
    const deadline = timeout === null ? null : Date.now() + timeout * 1000;
    for (;;) {
      const remaining = deadline === null ? MAX_LONG_POLL : Math.max(0, (deadline - Date.now()) / 1000);
      const step = Math.min(MAX_LONG_POLL, remaining);
      const answer = await this.request<Action>("GET", `/api/v1/actions/${actionId}/wait`,
        { params: { timeout: step.toFixed(3) }, timeout: step + this.timeout });
      if (answer.status === 200 || (deadline !== null && Date.now() >= deadline)) return answer.body;
    }
  }

  /**
   * Turn an action as Unwind answered it into the tool's result, or the error that says why not. `sent` is the args
   * as the agent passed them to `act`: a client-executed tool gets those, not Unwind's canonical echo.
   */
  async settle(action: Action, options: { timeout?: number | null; execute?: ActOptions["execute"]; sent?: unknown } = {}): Promise<any> {
    const { timeout = null, execute, sent } = options;
    const status = action.status;
    if (status === "succeeded") return action.result;
    if (sent !== undefined) action = { ...action, args: sent };
    if (action.awaiting_report) {
      if (!execute) throw new ReportRequired(action, (id, outcome) => this.report(id, outcome));
      return this.executeAndReport(action, execute);
    }
    const later = this.later(action.id, execute, sent);
    if (status === "awaiting_approval") throw new ApprovalPending(action, later);
    if (PENDING.has(status)) {
      const settled = await this.waitFor(action.id, timeout);
      if (PENDING.has(settled.status) && !settled.awaiting_report) {
        throw new InFlight("in_flight", `action ${action.id} is still ${settled.status}`, 202,
          { action_id: action.id }, later);
      }
      return this.settle(settled, { timeout, execute, sent });
    }
    if (REFUSED_BY_PERSON.has(status) || (status === "skipped" && action.stopped_by)) throw new Rejected(action);
    const error = action.error;
    if (status === "failed" && error?.error_class === "refused") {
      // The tool turned the call down and the run is still open (it ran in the worker, after an approval, say):
      // the same answer as a proposal's 422 tool_refused, so the agent handles both alike.
      throw refusalFor("tool_refused", error.message, 422, { code: "tool_refused", reason: error.message,
        action_id: action.id, run_status: action.run_status, action });
    }
    throw new Unwound(action);
  }

  private later(actionId: number, execute: ActOptions["execute"], sent: unknown) {
    return async (timeout?: number | null) => {
      const wait = timeout ?? null;
      const deadline = wait === null ? null : Date.now() + wait * 1000;
      const action = await this.waitFor(actionId, wait);
      const remaining = deadline === null ? null : Math.max(0, (deadline - Date.now()) / 1000);
      return this.settle(action, { timeout: remaining, execute, sent });
    };
  }

  private async executeAndReport(action: Action, execute: NonNullable<ActOptions["execute"]>): Promise<unknown> {
    let result: unknown;
    try {
      result = await execute(action.args);
    } catch (error) {
      const reported = await this.report(action.id, { ok: false, error: describe(error).slice(0, 4000) });
      throw new Unwound(reported);
    }
    return this.settle(await this.report(action.id, { ok: true, result }));
  }

  /** Report the outcome of a client-executed tool (a forward step or a compensation). */
  async report(actionId: number, outcome: Outcome): Promise<Action> {
    const body: Record<string, unknown> = { ok: outcome.ok };
    if (outcome.ok && outcome.result !== undefined && outcome.result !== null) body.result = outcome.result;
    if (!outcome.ok) body.error = outcome.error;
    return (await this.request("POST", `/api/v1/actions/${actionId}/report`, { json: body })).body;
  }

  /** Compensations of client-executed tools waiting for this agent to run them and `report`. */
  async pendingCompensations(options: { run?: number } = {}): Promise<PendingCompensation[]> {
    const found: PendingCompensation[] = [];
    let page = (await this.request("GET", "/api/v1/compensations/pending", { params: { run: options.run } })).body;
    for (;;) {
      found.push(...page.results);
      if (!page.next) return found;
      page = (await this.request("GET", page.next)).body;
    }
  }

  // --- tools ---------------------------------------------------------------------------------

  async tools(): Promise<Tool[]> {
    return (await this.request("GET", "/api/v1/tools")).body;
  }

  /** What the key derivation needs of a tool's policy (read once from `tools()`). */
  async keyPolicy(tool: string): Promise<KeyPolicy> {
    if (!this.toolPolicies?.has(tool)) {
      this.toolPolicies = new Map((await this.tools()).map((each) => {
        const policy = (each.policy ?? {}) as any;
        return [each.name, { targetFrom: policy.target?.from ?? "", keyFields: policy.idempotency?.key_fields ?? [] }];
      }));
    }
    const found = this.toolPolicies.get(tool);
    if (!found) throw new Refused("unknown_tool", `${JSON.stringify(tool)} is not a registered tool of this tenant`, 404);
    return found;
  }

  // Writing tools and policy takes a deploy key (`new Unwind(url, "uwd_…")`, from manage.py create_deploy_key): an
  // agent's key is refused with 403 agents_cannot_govern, since the policy is the agent's guardrail.

  /** Register or update a tool (with a deploy key). */
  async putTool(name: string, policy: Record<string, unknown>): Promise<Tool> {
    return (await this.request("PUT", `/api/v1/tools/${name}`, { json: policy })).body;
  }

  /** Load a whole policy document, all or nothing (with a deploy key). */
  async loadPolicy(document: Record<string, unknown>): Promise<unknown> {
    return (await this.request("POST", "/api/v1/policy", { json: document })).body;
  }
}

/** One agent workflow. `Unwind.withRun` completes it on success and cancels (unwinds) it on error. */
export class Run {
  readonly id: number;
  constructor(readonly client: Unwind, public data: RunData) {
    this.id = data.id;
  }

  get status(): string {
    return this.data.status;
  }

  async refresh(): Promise<this> {
    this.data = (await this.client.request("GET", `/api/v1/runs/${this.id}`)).body;
    return this;
  }

  /**
   * Put one tool call through Unwind and return the tool's result.
   *
   * Throws ApprovalPending (a person must approve: `.url`, `.wait()`), Rejected (`.reason`), Unwound (the step
   * failed; the run is unwinding, compensated or needs a person), a Refused by code (OrderingViolation,
   * PolicyDenied, ToolRefused, ValidationFailed, …), InFlight (the same call is still running), ReportRequired (a
   * client-executed tool and no `execute` given). A call with the same content as an earlier step of the run is that
   * step (its result, or InFlight while it runs), whatever the key; to do it again on purpose, pass `repeatOf`.
   */
  async act<T = any>(tool: string, args: Record<string, unknown>, options: ActOptions = {}): Promise<T> {
    const { timeout = 300, execute } = options;
    const body: Record<string, unknown> = { tool, args };
    if (options.repeatOf !== undefined) body.repeat_of = options.repeatOf;
    if (options.intent !== undefined) body.intent = options.intent;
    if (options.target !== undefined) body.target = String(options.target);
    const headers = options.idempotencyKey ? { "Idempotency-Key": options.idempotencyKey } : undefined;
    let answer: Action;
    try {
      answer = (await this.client.request("POST", `/api/v1/runs/${this.id}/actions`, { json: body, headers })).body;
    } catch (error) {
      if (!(error instanceof InFlight) || error.actionId === undefined) throw error;
      // Our own first attempt got through before its answer was lost (or an earlier step with the same content
      // runs): wait for it, do not redo it.
      const ours = error.problem.matched_by !== "content";
      return this.client.settle(await this.client.action(error.actionId), { timeout, execute, sent: ours ? args : undefined });
    }
    // Our own call: its tool gets our args as we wrote them. A step matched by content runs with its own.
    const ours = answer.matched_by !== "content";
    return this.client.settle(answer, { timeout, execute, sent: ours ? args : undefined });
  }

  /**
   * The Idempotency-Key the server derives for this call when none is sent (needs `tenantId` in the Unwind options:
   * the API does not report it to agents). Sending it as `idempotencyKey` is the same call as sending none.
   */
  async derivedKey(tool: string, args: Record<string, unknown>, options: { target?: string; repeatOf?: number } = {}): Promise<string> {
    if (this.client.tenantId === undefined) {
      throw new UnwindClientError("derivedKey needs the tenant's id: new Unwind(url, key, { tenantId })");
    }
    return deriveKey({ tenantId: this.client.tenantId, runId: this.id, tool, args, target: options.target,
      repeatOf: options.repeatOf, policy: await this.client.keyPolicy(tool) });
  }

  report(actionId: number, outcome: Outcome): Promise<Action> {
    return this.client.report(actionId, outcome);
  }

  async cancel(reason = ""): Promise<this> {
    this.data = (await this.client.request("POST", `/api/v1/runs/${this.id}/cancel`, { json: { reason } })).body;
    return this;
  }

  async complete(): Promise<this> {
    this.data = (await this.client.request("POST", `/api/v1/runs/${this.id}/complete`)).body;
    return this;
  }

  /** The correction trail: what changed for the end user, and what became of it. */
  async trail(): Promise<Trail> {
    return (await this.client.request("GET", `/api/v1/runs/${this.id}/trail`)).body;
  }

  /** Cancel after `error` ended the agent's work, unless that failure already finished the run. */
  async cancelAfter(error: unknown): Promise<void> {
    if (error instanceof ActionError && FINISHED.has(error.runStatus ?? "")) return;
    try {
      await this.cancel(`${error instanceof Error ? error.name + ": " + error.message : String(error)}`.slice(0, 1000));
    } catch (cancelFailed) {
      // The run may have finished meanwhile (a rejection unwinds it): then there was nothing to cancel. Either way
      // the error that ended the block wins.
      let finished = false;
      try { finished = FINISHED.has((await this.refresh()).status); } catch { /* unreachable: warn below */ }
      if (!finished) console.warn(`run ${this.id}: cancel after ${describe(error)} failed: ${describe(cancelFailed)}`);
    }
  }
}

function describe(error: unknown): string {
  if (error instanceof Error) {
    const cause = (error as { cause?: unknown }).cause;
    return `${error.name}: ${error.message}${cause instanceof Error ? ` (${cause.message})` : ""}`;
  }
  return String(error);
}

/** Whether a fetch failure happened before the request reached the server (safe to retry anything). */
function notSent(error: unknown): boolean {
  const code = (error as { cause?: { code?: string } })?.cause?.code;
  return code === "ECONNREFUSED" || code === "ENOTFOUND" || code === "EAI_AGAIN" || code === "UND_ERR_CONNECT_TIMEOUT";
}

function randomId(): string {
  return Array.from({ length: 4 }, () => Math.random().toString(16).slice(2, 10)).join("-");
}
