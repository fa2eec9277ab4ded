"""Input of the console pages: filters, and the reasons people give for their decisions."""
from __future__ import annotations

from django import forms

from ledger.db import received
from ledger.models import Risk, RunStatus
from ledger.engine.unknowns import CHOICES as UNKNOWN_CHOICES
from recovery.metrics import DEFAULT_WINDOW, WINDOWS
from recovery.models import ItemStatus, Reason
from recovery.selectors import AGE_BUCKETS, QUEUE_SORTS, Access
from recovery.services import UNDO_PLAN_THEN

OPERATIONS = {"resume": "Resume", "compensate": "Compensate", "close": "Close"}
# Items about a step whose outcome is unknown: resuming it is the person's word that the tool did not act.
UNKNOWN_OUTCOME = ("lease_lost", "outcome_unknown", "settle_failed")
SEND_AGAIN = "The tool says it did not happen: send it again"


def operations_for(item) -> dict:
    """The decisions the moves model offers on `item`'s run (ledger/engine/moves.py), each in words that say what it
    does: {operation: Move} with the move's label set for this item."""
    from dataclasses import replace

    from ledger.engine import moves

    offered = moves.run_moves(item.run)
    operations = {}
    for operation in OPERATIONS:
        move = offered.get(moves.OPERATOR, operation)
        if not move.allowed:
            continue
        if operation == "resume" and item.reason in UNKNOWN_OUTCOME and item.action is not None \
                and item.action.status == "lost":
            move = replace(move, label=SEND_AGAIN)
        operations[operation] = move
    return operations


BULK_OPERATIONS = ("compensate", "close")
BULK_LIMIT = 100
CLOSE_NEEDS_REASON = "Say why this can be closed; the reason goes into the audit chain."


def _blank(label: str, choices) -> list:
    return [("", label), *choices]


class TenantChoiceMixin:
    """A tenant filter listing the person's tenants; any other id simply matches nothing (reads are scoped)."""

    def set_tenants(self, access: Access) -> None:
        self.fields["tenant"].widget.choices = _blank("all tenants", [(pk, t.slug) for pk, t in access.tenants.items()])


class QueueFilterForm(TenantChoiceMixin, forms.Form):
    q = forms.CharField(required=False, max_length=200, label="Search")
    tenant = forms.IntegerField(required=False, widget=forms.Select)
    reason = forms.ChoiceField(required=False, choices=_blank("any reason", Reason.choices))
    risk = forms.ChoiceField(required=False, choices=_blank("any risk", Risk.choices))
    age = forms.ChoiceField(required=False, choices=_blank("any age", [(k, v[0]) for k, v in AGE_BUCKETS.items()]))
    status = forms.ChoiceField(required=False, choices=[*ItemStatus.choices, ("all", "open and resolved")])
    tool = forms.ChoiceField(required=False)
    sort = forms.ChoiceField(required=False, choices=[(k, k) for k in QUEUE_SORTS])

    def __init__(self, data, *, access: Access, tool_names: list[str]):
        super().__init__(data)
        self.set_tenants(access)
        self.fields["tool"].choices = _blank("any tool", [(name, name) for name in tool_names])

    def filters(self) -> dict:
        """The cleaned filters; an invalid value is ignored rather than failing the whole page."""
        self.is_valid()
        data = {name: self.cleaned_data.get(name) for name in self.fields if name not in self.errors}
        status = data.get("status") or ItemStatus.OPEN
        return {
            "q": data.get("q") or "", "tenant": data.get("tenant"), "reason": data.get("reason") or "",
            "risk": data.get("risk") or "", "age": data.get("age") or "", "tool": data.get("tool") or "",
            "status": "" if status == "all" else status, "sort": data.get("sort") or "newest",
        }


class RunFilterForm(TenantChoiceMixin, forms.Form):
    q = forms.CharField(required=False, max_length=200, label="Search")
    tenant = forms.IntegerField(required=False, widget=forms.Select)
    status = forms.ChoiceField(required=False, choices=_blank("any status", RunStatus.choices))

    def __init__(self, data, *, access: Access):
        super().__init__(data)
        self.set_tenants(access)

    def filters(self) -> dict:
        self.is_valid()
        data = {name: self.cleaned_data.get(name) for name in self.fields if name not in self.errors}
        return {"q": data.get("q") or "", "tenant": data.get("tenant"), "status": data.get("status") or ""}


class ResolveForm(forms.Form):
    """The reason for a decision, and for compensating a run with a step of unknown outcome, what became of it."""

    reason = forms.CharField(required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 3}),
                             help_text="Recorded in the audit chain with your name.")

    def __init__(self, *args, operation: str, unknown_steps: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.operation = operation
        if operation == "compensate" and unknown_steps:
            # One decision per run: what became of the step whose outcome is unknown is asked here too.
            self.fields["unknown"] = forms.ChoiceField(
                choices=list(UNKNOWN_CHOICES.items()), widget=forms.RadioSelect,
                error_messages={"required": "Say what became of the step whose outcome is unknown."})
        if operation == "close":
            self.fields["reason"].required = True
            self.fields["reason"].error_messages["required"] = CLOSE_NEEDS_REASON
            self.fields["reason"].help_text = "Required: why this can be closed (recorded in the audit chain)."

    def clean_reason(self) -> str:
        reason = (self.cleaned_data.get("reason") or "").strip()
        if self.operation == "close" and not reason:
            raise forms.ValidationError(CLOSE_NEEDS_REASON)
        return reason


class BulkForm(forms.Form):
    operation = forms.ChoiceField(choices=[(op, OPERATIONS[op]) for op in BULK_OPERATIONS])
    items = forms.TypedMultipleChoiceField(coerce=int, error_messages={"required": "Select at least one item."})
    reason = forms.CharField(required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 3}))
    confirmed = forms.BooleanField(required=False)

    def __init__(self, data):
        super().__init__(data)
        raw = data.getlist("items") if hasattr(data, "getlist") else data.get("items", [])
        self.fields["items"].choices = [(value, value) for value in raw if str(value).isdigit()]

    def clean_items(self) -> list[int]:
        items = list(dict.fromkeys(self.cleaned_data["items"]))
        if len(items) > BULK_LIMIT:
            raise forms.ValidationError(f"Select at most {BULK_LIMIT} items at a time.")
        return items

    def clean(self):
        data = super().clean()
        if data.get("confirmed") and data.get("operation") == "close" and not (data.get("reason") or "").strip():
            self.add_error("reason", "Say why these can be closed; the reason goes into the audit chain.")
        return data


class MetricsForm(TenantChoiceMixin, forms.Form):
    window = forms.ChoiceField(required=False, choices=[(k, k) for k in WINDOWS])
    tenant = forms.IntegerField(required=False, widget=forms.Select)

    def __init__(self, data, *, access: Access):
        if not data.get("window"):
            data = data.copy()
            data["window"] = DEFAULT_WINDOW
        super().__init__(data)
        self.set_tenants(access)

    def filters(self) -> dict:
        self.is_valid()
        data = {name: self.cleaned_data.get(name) for name in self.fields if name not in self.errors}
        return {"window": data.get("window") or DEFAULT_WINDOW, "tenant": data.get("tenant")}


class UndoPlanForm(forms.Form):
    """The undo a person completes on a `read_back_incomplete` item: its arguments as one JSON object."""

    args = forms.CharField(max_length=20000, strip=False, label="The undo's arguments (JSON)",
                           widget=forms.Textarea(attrs={"rows": 6, "spellcheck": "false"}),
                           error_messages={"required": "Give the undo's arguments as a JSON object."})
    then = forms.ChoiceField(choices=list(UNDO_PLAN_THEN.items()), widget=forms.RadioSelect, initial="compensate",
                             error_messages={"required": "Choose what happens next: undo the step now, or resume."})
    reason = forms.CharField(required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 2}),
                             help_text="Recorded in the audit chain with your name and the arguments.")

    def clean_args(self):
        text = self.cleaned_data["args"]
        try:
            value = received.loads(text)
        except (ValueError, RecursionError) as error:
            raise forms.ValidationError(f"The undo's arguments are not valid JSON: {error}.") from None
        if not isinstance(value, dict):
            raise forms.ValidationError(f"The undo's arguments must be a JSON object ({{\"name\": value, ...}}), "
                                        f"not {type(value).__name__}.")
        return value

    def clean_reason(self) -> str:
        return (self.cleaned_data.get("reason") or "").strip()
