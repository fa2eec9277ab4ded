"""A proposal's decision by its tool's rules and limits (ledger/policy/rules.py, ledger/policy/limits.py), and its explanation.

Decided once, in the proposal's transaction, after the tenant's chain lock and the run's lock (`proposal._record`):
- a rule that holds with `deny`, a rule that cannot be evaluated, or a limit the call would pass refuses the call
  (the first in the policy's order names the refusal; rules before limits);
- otherwise the risk is the highest of the tool's and of every rule that holds with `risk`, and the approvals
  needed follow the tenant's threshold for that risk (`law.approvals_needed`), raised to the largest
  `approvals_required` of a rule that holds (a rule that asks for people asks whatever the threshold).

On PostgreSQL's one-call proposal (`in_one_call`) the rules are decided before the call, from the run as the request
read it, and the call counts the limits under the same locks, going on only with the room each needs; what it
cannot take (a refusal, a person asked, a step count that moved) the Python path decides as above.

What it read and why is recorded on the action (`policy_decision`): the tool's policy version, each rule that held
(or could not be decided) with the values it read, each limit with what was used and what the call asked. The
approval request carries it to the page, the email, the Slack message and the MCP answer (`sentences`).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from decimal import Decimal

from django.utils import timezone

from ledger.policy import limits as tool_limits, rules as tool_rules
from ledger.policy.display import shown_value
from ledger.errors import UnwindError
from ledger.models import RISK_ORDER, Action, ActionStatus as A, Run, Tool
from ledger.policy.law import approvals_needed


class PolicyDenied(UnwindError):
    """A rule or a limit of the tool's policy refused the call: it was recorded as refused, and nothing was done."""

    code, status, title = "policy_denied", 403, "Refused by the tool's policy"


@dataclass
class Decision:
    risk: str
    required: int
    denied: str = ""  # the refusal's text; "" when the call may go on
    record: dict = field(default_factory=dict)  # what is kept on the action (`policy_decision`)


def applies(tool: Tool) -> bool:
    """Whether the tool's policy has rules or limits (`decide`; before PostgreSQL's one-call proposal, `in_one_call`)."""
    return bool(tool.rules or tool.limits)


def context_of(*, run: Run, args: dict, agent_name: str | None = None, reads_agent: bool = True,
               steps: int | None = None) -> dict:
    """What an expression sees: the call's arguments, the run's goal, on-behalf-of and step count (`steps`, else as
    the locked run has it once its step number is taken), the agent (its name read only when a rule reads it)."""
    agent = agent_name if agent_name is not None else run.agent.name if run.agent_id and reads_agent else ""
    steps = run.next_seq - 2 if steps is None else steps
    return {"args": args, "run": {"goal": run.goal, "on_behalf_of": run.on_behalf_of, "steps": steps},
            "agent": {"name": agent}}


def _rules_read(tool: Tool, prefix: str) -> bool:
    """Whether a rule of the tool reads a value whose path starts with `prefix`."""
    return any(path.startswith(prefix) for rule in tool.rules for path in tool_rules.compiled(rule["when"])[1].reads)


def decide(*, tool: Tool, run: Run, args: dict, threshold: str, count_limits: bool = True,
           agent_name: str | None = None, steps: int | None = None) -> Decision:
    """The decision for a proposal of `tool` with canonical `args` in `run` (locked, its step number taken), under
    the tenant's approval `threshold`. `count_limits` False (policy_try, which reads no ledger): limits are left
    out; `agent_name` stands for the run's agent there. `steps`: the run's step count as the one-call proposal has it
    (`in_one_call`)."""
    outcomes = tool_rules.evaluate(tool.rules, context_of(run=run, args=args, agent_name=agent_name,
                                                          reads_agent=_rules_read(tool, "agent."), steps=steps))
    risk = tool.risk
    extra = 0
    denied = ""
    fired = []
    for outcome in outcomes:
        if not (outcome.held or outcome.error):
            continue
        rule = outcome.rule
        entry = {"rule": outcome.index + 1, "when": rule["when"], "read": outcome.read}
        if outcome.error:
            entry["error"] = outcome.error
            entry["effect"] = "deny"
            denied = denied or (f"rule {outcome.index + 1} of {tool.name} ({rule['when']}) could not be decided: "
                                f"{outcome.error}; a rule that cannot be decided refuses the call")
        elif "deny" in rule:
            entry["effect"] = "deny"
            denied = denied or rule["deny"]
        else:
            if "risk" in rule and RISK_ORDER[rule["risk"]] > RISK_ORDER[risk]:
                risk = rule["risk"]
            extra = max(extra, rule.get("approvals_required", 0))
            entry["effect"] = "ask"
        if "reason" in rule or "deny" in rule:
            entry["reason"] = rule.get("reason") or rule["deny"]
        for key in ("risk", "approvals_required"):
            if key in rule:
                entry[key] = rule[key]
        fired.append(entry)
    counted = []
    if not denied and tool.limits and count_limits:
        counted = tool_limits.count(tool.limits, tool_name=tool.name, run=run, args=args)
        denied = next((limit.refusal for limit in counted if limit.refusal), "")
    required = approvals_needed(rule=tool.approval, risk=risk, required=tool.approvals_required, threshold=threshold)
    if extra:
        required = max(required, extra)
    record = {"tool_version": tool.version, "risk": risk, "required": 0 if denied else required, "fired": fired,
              "limits": [limit.as_record() for limit in counted]}
    if denied:
        record["denied"] = denied
    return Decision(risk=risk, required=0 if denied else required, denied=denied, record=record)


@dataclass
class OneCall:
    """What the PostgreSQL one-call proposal needs of a tool's rules and limits, decided before it (`in_one_call`):
    the decision as it stands but for the limits' counts, the limits to count under its locks with the room each
    needs, and the step number the rules were decided for when they read `run.steps`."""

    decided: Decision | None  # None: the tool has no rules and no limits
    limits: list[dict] | None = None
    step: int | None = None

    def counted(self, used: list | None) -> Decision | None:
        """The decision once the call counted each limit (`used`, each within its room, so none refuses): what each
        had used, as `decide` records it and as the call wrote it on the action."""
        if self.decided is None:
            return None
        for entry, value in zip(self.decided.record["limits"], used or []):
            entry["used"] = tool_limits.plain(Decimal(str(value)))
        return self.decided


def in_one_call(*, tool: Tool, run: Run, args: dict, threshold: str) -> OneCall | None:
    """The tool's approval rule and its rules decided before the one-call proposal, from the run as its caller read
    it: None when they refuse the call or ask a person, or a limit refuses it whatever was used (the Python path
    records why). Otherwise the limits go to the call with their room (`limits.asked`), counted there under the
    tenant's lock."""
    if not applies(tool):
        needed = approvals_needed(rule=tool.approval, risk=tool.risk, required=tool.approvals_required,
                                  threshold=threshold)
        return None if needed else OneCall(decided=None)
    decided = decide(tool=tool, run=run, args=args, threshold=threshold, count_limits=False, steps=run.next_seq - 1)
    if decided.denied or decided.required:
        return None
    nothing_used = tool_limits.count(tool.limits, tool_name=tool.name, run=run, args=args,
                                     used=[Decimal(0)] * len(tool.limits))
    if any(limit.refusal for limit in nothing_used):
        return None
    decided.record["limits"] = [limit.as_record() for limit in nothing_used]  # each count filled in by the call
    limits = [{**spec, "room": str(limit.room)} for spec, limit in zip(tool_limits.specs(tool.limits), nothing_used)]
    return OneCall(decided=decided, limits=limits or None, step=run.next_seq if _rules_read(tool, "run.steps") else None)


def policy_words(tool: Tool) -> list[dict]:
    """A version's rules and limits as the console lists them: [{"when", "does"}]."""
    words = []
    for rule in tool.rules or []:
        if "deny" in rule:
            does = f"refuse: {rule['deny']}"
        else:
            parts = [f"risk {rule['risk']}" for _ in [1] if "risk" in rule]
            if "approvals_required" in rule:
                count = rule["approvals_required"]
                parts.append(f"{count} approval{'s' if count != 1 else ''}")
            does = " and ".join(parts) + (f": {rule['reason']}" if rule.get("reason") else "")
        words.append({"when": rule["when"], "does": does})
    for limit in tool.limits or []:
        if "count" in limit:
            what = f"at most {limit['count']} call{'s' if limit['count'] != 1 else ''}"
        else:
            what = f"{limit['sum']} adds up to at most {limit['max']}"
        words.append({"when": "", "does": f"limit: {what} {tool_limits.scope_words(limit)}"})
    return words


def _reads(entry: dict, display: dict, args: dict) -> list[str]:
    """"amount is 750.00 USD": each value a rule read, as the tool's display hint writes it."""
    words = []
    for path, value in sorted(entry.get("read", {}).items()):
        name = path.split(".", 1)[1] if path.startswith("args.") else path
        if value is None:
            words.append(f"{name} is missing")
            continue
        top = path.split(".")[1] if path.startswith("args.") and path.count(".") == 1 else None
        text = shown_value(value, name=top, display=display, args=args)["text"] if top else str(value)
        words.append(f"{name} is {text}")
    return words


def sentences(record: dict | None, *, display: dict | None = None, args: dict | None = None) -> list[dict]:
    """The decision in words, one per rule that held (or could not be decided) and per limit that refused:
    {"policy": the policy's own words (Unwind's and the policy author's), "values": the values read (the agent's,
    shown through ledger/agent_text.py on every surface)}. A person reads "needs a person: refunds above 500 need
    a person" then "amount is 750.00 USD"."""
    if not record:
        return []
    display, args = display or {}, args or {}
    lines = []
    for entry in record.get("fired", []):
        if entry.get("error"):
            head = f"refused: rule {entry['rule']} ({entry['when']}) could not be decided, {entry['error']}"
        elif entry.get("effect") == "deny":
            head = f"refused: {entry['reason']}"
        else:
            people = entry.get("approvals_required")
            who = f"needs {people} people" if people and people > 1 else "needs a person"
            if "risk" in entry and not people:
                who = f"raises the risk to {entry['risk']}" if not record.get("required") else who
            head = f"{who}: {entry.get('reason') or 'rule ' + str(entry['rule']) + ' holds (' + entry['when'] + ')'}"
        lines.append({"policy": head, "values": ", ".join(_reads(entry, display, args))})
    for limit in record.get("limits", []):
        if limit.get("refused"):
            lines.append({"policy": f"refused: {limit['refused']}", "values": ""})
    return lines


def summary(record: dict | None, *, display: dict | None = None, args: dict | None = None) -> str:
    """The sentences on one line (an MCP answer, a problem's detail): policy words — values; …"""
    return "; ".join(line["policy"] + (f" — {line['values']}" if line["values"] else "")
                     for line in sentences(record, display=display, args=args))


# The error_class of a step its tool's policy refused (as of a step the tool itself refused: the ordering law and
# the content match pass over both, `runsteps.order_conflicts`, CONTENT_MATCHES).
REFUSED = "refused"


def bind(action: Action, decided: Decision | None) -> Action:
    """The proposed step as the decision has it: its risk and why (`policy_decision`); refused, when denied.

    A refused step keeps no idempotency key: the same request sent again is decided again (a limit may have room
    by then), as a request refused for its input is. Its key is recorded under a prefix of its own."""
    if decided is None:
        return action
    action.risk = decided.risk
    action.policy_decision = decided.record
    action.totalled = any(limit["per"] != "run" for limit in action.tool.limits)  # migration 0022's triggers
    if decided.denied:
        action.status, action.attempts, action.approvals_required = A.FAILED, 0, 0
        action.lease_owner, action.lease_expires_at = "", None
        action.error_class, action.error_message = REFUSED, decided.denied[:2000]
        action.finished_at = timezone.now()
        action.idempotency_key = f"refused-{secrets.token_hex(6)}:{action.idempotency_key}"[:255]
    return action


def record_refusal(action: Action, decided: Decision, *, log, actor: str, run: Run) -> None:
    """The audit chain's record of the refusal, beside the step's `forward.proposed`."""
    log.record("forward.refused", actor=actor, action=action, tool=action.tool.name, by="policy",
               reason=decided.denied[:500], tool_version=decided.record.get("tool_version"), run_status=run.status)


def refusal(action: Action, decided: Decision) -> PolicyDenied:
    return PolicyDenied(f"{decided.denied}. Nothing was done: step {action.seq} (action {action.pk}) records the "
                        f"refusal", action_id=action.pk, reason=decided.denied,
                        decision=sentences(decided.record, display=action.tool.display, args=action.args))
