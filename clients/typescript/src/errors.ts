/**
 * What `Run.act` throws instead of returning the tool's result: each says what happened and, in `next`, what the
 * agent should do now. Mirrors the Python client's `unwind_client.errors`; refusals also get a class per code.
 */
import type { Action, Problem } from "./types.js";

/** Base class of everything the client throws. */
export class UnwindClientError extends Error {
  /** What the agent should do next, in a sentence. */
  next = "";
  constructor(message: string) {
    super(message);
    this.name = new.target.name;
  }
}

/** Unwind could not be reached (or answered 5xx) after the client's retries. */
export class Unavailable extends UnwindClientError {
  override next = "Unwind is unreachable: try again later with the same arguments (the call is deduplicated).";
}

/** Unwind refused the request: `code` is the stable machine code, `message` the sentence saying why. */
export class Refused extends UnwindClientError {
  override next = "Fix the request as the message says and send it again.";
  constructor(readonly code: string, readonly detail: string, readonly status: number, readonly problem: Problem = {}) {
    super(`${code}: ${detail}`);
  }
  /** The refused field, when the problem names one. */
  get field(): string | undefined {
    return (this.problem.field as string | null | undefined) ?? undefined;
  }
}

/** 400 validation_error / parse_error, 404 unknown_tool: the arguments or the tool name are wrong. */
export class ValidationFailed extends Refused {
  override next = "Nothing was done: correct the arguments (see `field` and `problem.errors`) and call again.";
}

/** 409 ordering_violation: the step breaks the saga ordering law (compensatable steps, one pivot, retriable steps). */
export class OrderingViolation extends Refused {
  override next = "Nothing was done: this step may not follow the run's earlier steps; plan the steps in law order " +
    "(compensatable, then the pivot, then retriable) in a new run, or finish this one without it.";
  get rule(): string | undefined { return this.problem.rule as string | undefined; }
}

/** 403 policy_denied: a rule or limit of the tool's policy refused the call; it was recorded, nothing was done. */
export class PolicyDenied extends Refused {
  override next = "Nothing was done and the run stays open: the policy refuses these arguments; change them or tell the user.";
  get reason(): string { return (this.problem.reason as string | undefined) ?? this.detail; }
}

/** 422 tool_refused: the tool turned the call down (a 4xx); nothing was done and the run stays open. */
export class ToolRefused extends Refused {
  override next = "Nothing was done: the tool refused these arguments; try other arguments.";
  get reason(): string { return (this.problem.reason as string | undefined) ?? this.detail; }
}

/** 422 idempotency_mismatch, 409 repeat_of_mismatch: a key or repeat_of reused for another call. */
export class IdempotencyMismatch extends Refused {
  override next = "Nothing was done: this Idempotency-Key (or repeat_of) belongs to another call; use a new key.";
}

/** 409 run_not_active / run_cancelled / run_archived / state_conflict: the run takes no new step. */
export class RunNotActive extends Refused {
  override next = "The run takes no more steps: stop calling tools for this task and tell the user what happened.";
}

/** 401/403 (not policy_denied): the key is wrong or may not do this; a wiring mistake, not the model's. */
export class NotAllowed extends Refused {
  override next = "Check the agent key and the endpoint: an agent key acts only in its own runs and never governs.";
}

/** 404 not_found: no such run or action for this agent. */
export class NotFound extends Refused {
  override next = "Check the run or action id: another agent's is not found either.";
}

/** 429 too_many_open_approvals / throttled (after the client's retries). */
export class Throttled extends Refused {
  override next = "Too many requests or approvals waiting: wait for people to decide, then call again.";
}

/** The same logical action is still running (409 in_flight, or still pending after the wait); `wait()` for its outcome. */
export class InFlight extends Refused {
  override next = "The call is still running: call again later with the same arguments, or `wait()`.";
  readonly actionId: number | undefined;
  constructor(code: string, detail: string, status: number, problem: Problem,
              private readonly settleLater: (timeout?: number | null) => Promise<unknown>) {
    super(code, detail, status, problem);
    this.actionId = problem.action_id as number | undefined;
  }
  /** Wait for the running action and return its result (or throw what `act` would). Seconds; null waits on. */
  wait(timeout?: number | null): Promise<unknown> { return this.settleLater(timeout); }
}

/** An action that did not simply succeed: carries the action as Unwind recorded it. */
export class ActionError extends UnwindClientError {
  readonly actionId: number | undefined;
  readonly runId: number | undefined;
  readonly runStatus: string | undefined;
  constructor(message: string, readonly action: Action) {
    super(message);
    this.actionId = action.id;
    this.runId = action.run;
    this.runStatus = action.run_status;
  }
}

/** The action waits for a person. Send them `url`; `wait(timeout)` returns the result once approved. */
export class ApprovalPending extends ActionError {
  readonly url: string | undefined;
  readonly approvalId: number | undefined;
  constructor(action: Action, private readonly settleLater: (timeout?: number | null) => Promise<unknown>) {
    const approval = action.approval ?? undefined;
    super(`${action.tool} (action ${action.id}) waits for approval at ${approval?.url}`, action);
    this.url = approval?.url;
    this.approvalId = approval?.id;
    this.next = `A person must approve this call at ${this.url}: call again later with the same arguments, or wait().`;
  }
  /** Wait for the decision; return the tool's result, or throw Rejected (or ApprovalPending again on timeout). */
  wait(timeout?: number | null): Promise<unknown> { return this.settleLater(timeout); }
}

/** A person rejected the action (or the approval expired, or someone stopped it while it was held: `stoppedBy`). */
export class Rejected extends ActionError {
  readonly reason: string;
  readonly stoppedBy: string;
  constructor(action: Action) {
    const reason = action.decision_reason || "";
    super(`${action.tool} (action ${action.id}) was ${action.status}: ${reason}`, action);
    this.reason = reason;
    this.stoppedBy = action.stopped_by || "";
    this.next = "A person turned this call down: do not retry it; Unwind undoes the run's earlier steps. Tell the user.";
  }
}

/** The step failed (or was skipped or undone): the run is unwinding, compensated, or needs a person (`runStatus`). */
export class Unwound extends ActionError {
  readonly error: string;
  readonly errorClass: string;
  constructor(action: Action) {
    const error = action.error ?? { message: "", error_class: "" };
    super(`${action.tool} (action ${action.id}) ${action.status}${error.message ? ": " + error.message : ""}; ` +
      `the run is ${action.run_status}`, action);
    this.error = error.message || "";
    this.errorClass = error.error_class || "";
    this.next = "The task cannot go on: Unwind undoes its earlier steps (or a person finishes it). Tell the user.";
  }
}

/** A client-executed tool and no `execute` given: run it yourself with `toolArgs`, then `report(...)`. */
export class ReportRequired extends ActionError {
  readonly tool: string;
  readonly toolArgs: unknown;
  constructor(action: Action, private readonly reportTo: (actionId: number, outcome: Outcome) => Promise<Action>) {
    super(`${action.tool} is executed by the agent: run it and report action ${action.id}`, action);
    this.tool = action.tool;
    this.toolArgs = action.args;
    this.next = `Run ${action.tool} yourself with these arguments and report its outcome.`;
  }
  report(outcome: Outcome): Promise<Action> { return this.reportTo(this.action.id, outcome); }
}

export type Outcome = { ok: true; result?: unknown } | { ok: false; error: string };

const BY_CODE: Record<string, new (code: string, detail: string, status: number, problem: Problem) => Refused> = {
  validation_error: ValidationFailed, parse_error: ValidationFailed, unknown_tool: ValidationFailed,
  target_mismatch: ValidationFailed, target_not_found: ValidationFailed, payload_too_large: ValidationFailed,
  ordering_violation: OrderingViolation,
  policy_denied: PolicyDenied,
  tool_refused: ToolRefused,
  idempotency_mismatch: IdempotencyMismatch, repeat_of_mismatch: IdempotencyMismatch,
  run_not_active: RunNotActive, run_cancelled: RunNotActive, run_archived: RunNotActive, state_conflict: RunNotActive,
  not_found: NotFound,
  too_many_open_approvals: Throttled, throttled: Throttled,
};

/** The Refused subclass for a problem answer (in_flight is built by the client, which can wait on it). */
export function refusalFor(code: string, detail: string, status: number, problem: Problem): Refused {
  const Kind = BY_CODE[code] ?? (status === 401 || status === 403 ? NotAllowed : Refused);
  return new Kind(code, detail, status, problem);
}
