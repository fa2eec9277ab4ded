"""Input of the approver pages: the inbox filters and one person's decision."""
from django import forms

from approvals.models import ApprovalStatus
from approvals.selectors import ANY_STATUS
from ledger.models import Risk, Tenant


class InboxFilterForm(forms.Form):
    tenant = forms.ChoiceField(required=False)
    risk = forms.ChoiceField(required=False, choices=[("", "any risk"), *Risk.choices])
    tool = forms.ChoiceField(required=False)
    status = forms.ChoiceField(required=False, choices=[*ApprovalStatus.choices, (ANY_STATUS, "any status")])

    def __init__(self, data, *, tenants: list[Tenant], tool_names: list[str]):
        super().__init__(data)
        self.fields["tenant"].choices = [("", "all my tenants"), *((t.slug, t.name) for t in tenants)]
        self.fields["tool"].choices = [("", "any tool"), *((name, name) for name in tool_names)]

    def filters(self) -> dict:
        """The valid filters; a value that is not a choice (a stale link, another tenant) is left out."""
        self.is_valid()
        cleaned = getattr(self, "cleaned_data", {})
        return {
            "tenant": cleaned.get("tenant", ""),
            "risk": cleaned.get("risk", ""),
            "tool": cleaned.get("tool", ""),
            "status": cleaned.get("status") or ApprovalStatus.PENDING,
        }


class DecisionForm(forms.Form):
    APPROVE, REJECT = "approve", "reject"

    decision = forms.ChoiceField(choices=[(APPROVE, "approve"), (REJECT, "reject")])
    reason = forms.CharField(required=False, max_length=4000, strip=True, widget=forms.Textarea(attrs={"rows": 3}))

    def clean(self):
        cleaned = super().clean()
        if cleaned.get("decision") == self.REJECT and not cleaned.get("reason"):
            self.add_error("reason", "Say why you reject it: the agent and the person it acts for will read "
                                     "the reason.")
        return cleaned

    @property
    def approve(self) -> bool:
        return self.cleaned_data["decision"] == self.APPROVE
