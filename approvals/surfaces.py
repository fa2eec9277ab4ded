"""What a message (a Slack post, an email) can show of a request, and whether it may carry the decision.

The rule, for every channel: a surface that cannot show everything a decision covers does not carry the decision.
It shows what fits, says plainly what it left out ("3 more arguments are not shown here, and 2 long values are
cut short"), and offers the approval page ("Open to decide") instead of approve/reject buttons or one-tap links.
A decision from that channel for such a request is refused too (`fits`), whatever the message looked like: the
request's preview is fixed when it is made, so this is the same answer the message was built from.

Values read as their tool's display hint has them (ledger/policy/display.py: "€482.00", not 48200), the value as sent
beside it, and what a request is about in money comes from one place (`amounts`): an undo (a refund names only the
charge) is about the amounts of the step it undoes.

Only what the agent sent is labelled as the agent's words. An undo is Unwind's: its arguments are worked out from
the step it undoes, and its goal ("undo step 3 (payments.charge)") is Unwind's sentence, so of an undo's texts only
the run's goal and whom the run acts for are the agent's (`agent_texts`); what it undoes is in `Shown.undo`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from approvals.models import ApprovalRequest
from ledger.engine import decision
from ledger.models import Action, ActionKind
from ledger.policy.display import money_in, shown_value


def _plain_line(name: str, text: str) -> str:
    return f"{name}: {text}"


def _plain(text: str) -> str:
    return text


@dataclass(frozen=True)
class Limits:
    """How much one surface shows, counted as it renders: `line(name, text)` is an argument's line and `prose(text)`
    a piece of agent text, both as that surface writes them (Slack's escapes count against Slack's limits)."""

    value_chars: int  # a longer value is cut short
    total_chars: int  # the argument lines together
    prose_chars: int  # each piece of the agent's other text (reasoning, goal, target, on behalf of)
    line: Callable[[str, str], str] = _plain_line
    prose: Callable[[str], str] = _plain


# An email can be long; a value or a text longer than these is past what a person reads in a mail.
EMAIL = Limits(value_chars=2000, total_chars=60_000, prose_chars=10_000)


@dataclass
class Shown:
    """The request as one surface shows it: `args` [{name, text}], the agent's own texts, and what was left out."""

    args: list[dict] = field(default_factory=list)
    texts: dict = field(default_factory=dict)
    left_out: int = 0
    cut: int = 0
    cut_texts: list[str] = field(default_factory=list)
    why: list[dict] = field(default_factory=list)  # [{policy, values}]: why a person is asked (`why`)
    amounts: list[str] = field(default_factory=list)  # what the request is about, in money (`amounts`)
    undo: dict | None = None  # for an undo, Unwind's words about it (`undo`); None for a step the agent proposed

    @property
    def complete(self) -> bool:
        return not (self.left_out or self.cut or self.cut_texts)

    @property
    def missing(self) -> str:
        """What this surface does not show, in one sentence; "" when it shows everything."""
        parts = []
        if self.left_out:
            parts.append(f"{self.left_out} more argument{'s are' if self.left_out != 1 else ' is'} not shown here")
        if self.cut:
            parts.append(f"{self.cut} long value{'s are' if self.cut != 1 else ' is'} cut short")
        if self.cut_texts:
            parts.append(f"the agent's {' and '.join(self.cut_texts)} {'are' if len(self.cut_texts) > 1 else 'is'} "
                         "cut short")
        if not parts:
            return ""
        sentence = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
        return sentence[0].upper() + sentence[1:] + "."


def value_text(value, *, name: str, display: dict, args: dict) -> str:
    """One argument value on one line: the display hint's words with the value as sent, else compact JSON (a
    string as it is)."""
    shown = shown_value(value, name=name, display=display, args=args)
    if shown["hinted"]:
        return f"{shown['text']} ({json.dumps(value)} as sent)"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def amounts(action: Action) -> list[str]:
    """What a step is about, in money ("€610.00"): the amounts among its own arguments, as its tool's display hint
    reads them; for an undo whose own arguments name none (a refund names only the charge), the amounts of the step
    it undoes, as that step's tool reads them. Every approval surface (page, list, email, Slack) asks here."""
    own = money_in(action.args, action.tool.display)
    if own or action.kind != ActionKind.COMPENSATION or action.compensates_id is None:
        return own
    forward = action.compensates
    return money_in(forward.args, forward.tool.display)


def undo(request: ApprovalRequest) -> dict | None:
    """For an undo, the step it undoes ({"seq": 3, "tool": "payments.charge"}), which a surface names in Unwind's
    words in place of the goal Unwind recorded for it ("undo step 3 (payments.charge)"); None for a step the agent
    proposed."""
    if not request.is_compensation:
        return None
    undoes = (request.preview or {}).get("undoes") or {}
    return {"seq": undoes.get("seq"), "tool": str(undoes.get("tool") or "")}


def agent_texts(request: ApprovalRequest) -> dict:
    """The texts a message shows beside the arguments, by key: the agent's own words, and the target (the agent's
    for its own step; for an undo, the undone step's target). An undo's goal and reasoning are Unwind's, not the
    agent's (`undo`), so they are empty here."""
    preview = request.preview or {}
    target = preview.get("target") or {}
    intent = {} if request.is_compensation else preview.get("intent") or {}
    return {
        "target": str(target.get("id") or ""),
        "on_behalf_of": str(preview.get("on_behalf_of") or ""),
        "run_goal": str(preview.get("run_goal") or ""),
        "goal": str(intent.get("goal") or ""),
        "reasoning": str(intent.get("reasoning") or ""),
    }


def _cut(text: str, limit: int, render: Callable[[str], str]) -> str:
    """The longest start of `text` whose rendering, with the "…" that says it goes on, is within `limit`."""
    size = min(len(text), limit)
    while size and len(render(text[:size] + "…")) > limit:
        size = size * 9 // 10
    return text[:size] + "…"


def why(request: ApprovalRequest) -> list[dict]:
    """Why the tool's rules ask a person, in words: [{"policy": Unwind's and the policy's words ("needs a person:
    refunds above 500 need a person"), "values": what the rule read, the agent's ("amount is $750.00")}]."""
    preview = request.preview or {}
    display = (request.tool.display if request.tool_id else request.action.tool.display) or {}
    return decision.sentences(preview.get("policy"), display=display, args=preview.get("args") or {})


def shown(request: ApprovalRequest, limits: Limits) -> Shown:
    """What a surface with these limits shows of the request: arguments by name until the next would not fit
    (the rest left out, counted), values past `value_chars` cut short (counted), the agent's texts likewise."""
    preview = request.preview or {}
    args = preview.get("args") or {}
    display = (request.tool.display if request.tool_id else request.action.tool.display) or {}
    result = Shown()
    used = 0
    for name in sorted(args):
        text = value_text(args[name], name=name, display=display, args=args)
        cut = len(text) > limits.value_chars
        if cut:
            text = text[:limits.value_chars] + "…"
        length = len(limits.line(name, text)) + 1
        if used + length > limits.total_chars:
            result.left_out = len(args) - len(result.args)
            break
        used += length
        result.cut += cut
        result.args.append({"name": name, "text": text, "cut": cut})
    for key, text in agent_texts(request).items():
        if len(limits.prose(text)) > limits.prose_chars:
            result.cut_texts.append(key.replace("_", " "))
            text = _cut(text, limits.prose_chars, limits.prose)
        result.texts[key] = text
    for line in why(request):
        values = line["values"]
        if len(values) > limits.value_chars:
            result.cut_texts.append("values the policy read")
            values = values[:limits.value_chars] + "…"
        result.why.append({"policy": line["policy"], "values": values})
    result.amounts = amounts(request.action)
    result.undo = undo(request)
    return result


def fits(request: ApprovalRequest, limits: Limits) -> bool:
    """Whether a message with these limits shows everything the request's decision covers."""
    return shown(request, limits).complete
