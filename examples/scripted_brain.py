"""What the framework examples' scripted models decide: the next tool call of a task, from the tool outputs so far.

No model provider is involved. A `Plan` is a task's tool calls in order; each step's arguments may use earlier
results. The plan reads the outputs the way a model reads the adapters' answers: a result goes on to the next
step; a refusal tries the step's other arguments, if it has any; waiting for a person, a rejection, a failure
or a refusal with nothing else to try ends the turn with a message saying so.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# The sandbox tools the examples' agents get, and how each example task's run should end.
TOOLS = ["hr.create_user", "licenses.provision", "email.send", "payments.charge", "crm.update_ticket"]
EXPECTED = {"onboard": "completed", "unwind": "compensated", "approval": "completed"}

# The adapters' answers that are not a tool's result (unwind_client.adapters.AgentRun.call).
NOT_A_RESULT = {"pending_approval", "in_progress", "rejected", "refused", "failed", "run_over"}


@dataclass
class Seen:
    """One tool call the model made and the output it got back."""

    name: str
    args: dict
    output: Any

    @property
    def outcome(self) -> str:
        status = self.output.get("status") if isinstance(self.output, dict) else None
        return status if status in NOT_A_RESULT else "ok"


@dataclass
class Step:
    name: str  # the tool's name as the model sees it (hr_create_user)
    args: Callable[[dict[str, Any]], dict]  # from the results so far, by tool name
    instead: Callable[[dict[str, Any]], dict] | None = None  # the arguments to try after a refusal


@dataclass
class Plan:
    steps: list[Step]
    done: str = "Done."
    turns: list[str] = field(default_factory=list)  # what the model said at the end of each turn

    def next(self, seen: list[Seen]) -> tuple[str, dict] | str:
        """The next call `(tool name, args)`, or the turn's final message."""
        results: dict[str, Any] = {}
        index, refused_once = 0, False
        for call in seen:
            if call.outcome == "ok":
                results[call.name] = call.output
                index, refused_once = index + 1, False
            elif call.outcome == "refused" and not refused_once and self.steps[index].instead is not None:
                refused_once = True
            else:
                return self._say(call.output.get("message", call.outcome))
        if index >= len(self.steps):
            return self._say(self.done)
        step = self.steps[index]
        return step.name, (step.instead if refused_once else step.args)(results)

    def _say(self, text: str) -> str:
        self.turns.append(text)
        return text


def parse(output: Any) -> Any:
    """A tool output as the model reads it: JSON when it is JSON."""
    if isinstance(output, str):
        try:
            return json.loads(output)
        except ValueError:
            return output
    return output


def onboarding(email: str, name: str, *, charge: bool = False) -> Plan:
    """Create the user, then a license and the welcome email, or the annual plan's charge."""
    user = Step("hr_create_user", lambda seen: {"email": email, "name": name})
    if charge:
        return Plan([user, Step("payments_charge", lambda seen: {"customer": "acme-corp", "amount_cents": 120000,
                                                                 "currency": "EUR"})], done=f"{name} is onboarded.")
    return Plan([
        user,
        Step("licenses_provision", lambda seen: {"user_id": seen["hr_create_user"]["id"]}),
        Step("email_send", lambda seen: {"to": email, "subject": "Welcome", "body": f"Welcome aboard, {name}."}),
    ], done=f"{name} is onboarded.")
